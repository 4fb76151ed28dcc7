"""The house rules, read off the source: imports flow
heads <- decoding <- distill <- eval <- publish <- train <- demo <- scripts and never back up,
no module imports itself round a cycle, and no library file holds more than one concern's worth
of lines. Every import counts, the ones inside functions too."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
#: Bottom to top: a module may import its own layer and the ones below it.
LAYERS = ["heads", "decoding", "distill", "eval", "publish", "train", "demo", "scripts"]
MAX_LINES = 600  # a library file past this holds more than one concern
MAX_WIDTH = 120


def _modules() -> dict[str, Path]:
    """draftsmith module name -> file, for every file of the five code folders."""
    out = {}
    for layer in LAYERS:
        for path in sorted((REPO / layer).rglob("*.py")):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(["draftsmith", *parts])] = path
    return out


def _imports(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """The draftsmith modules `path` imports (a `from package import module` counts the module)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return {m for m in found if m in modules and m != name}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(path, name, modules) for name, path in modules.items()}


def _layer(module: str) -> int:
    return LAYERS.index(module.split(".")[1])


def test_the_layout_is_read():
    graph = _graph()
    assert "draftsmith.decoding.loop" in graph and "draftsmith.scripts.cli" in graph
    assert "draftsmith.decoding.kv" in graph["draftsmith.decoding.loop"]


def test_no_import_runs_back_up_the_layers():
    graph = _graph()
    upward = sorted(f"{a} imports {b}" for a, deps in graph.items() for b in deps if _layer(b) > _layer(a))
    assert not upward, (
        "imports flow heads <- decoding <- distill <- eval <- publish <- train <- demo <- scripts:\n"
        + "\n".join(upward)
    )


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    cycles = _cycles(_graph())
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_the_cycle_finder_finds_one():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_library_files_stay_small():
    big = []
    for name, path in _modules().items():
        if name.startswith("draftsmith.scripts."):
            continue  # command-line glue (the benchmarks' tables live there)
        lines = path.read_text(encoding="utf-8").count("\n")
        if lines > MAX_LINES:
            big.append(f"{path.relative_to(REPO)}: {lines} lines")
    assert not big, f"library files over {MAX_LINES} lines (split them along their concerns):\n" + "\n".join(big)


def test_decoding_runtime_lines_fit():
    wide = []
    for path in sorted((REPO / "decoding").glob("*.py")):
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if len(line) > MAX_WIDTH:
                wide.append(f"{path.relative_to(REPO)}:{number}: {len(line)} characters")
    assert not wide, "\n".join(wide)
