"""What is being pushed: the trained artifact of a run folder, its layout, and its eval report.

Either a run folder (recipe.json + heads/, head/ or draft/) or a bare artifact folder is
accepted; everything here only reads files and raises `HubError` on what it cannot use.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

# Run folder layout written by train/{medusa,eagle,draft}.py.
ARTIFACT_DIRS = {"heads": "medusa", "head": "eagle", "draft": "draft"}
RECIPE, RUN_INFO, SUMMARY = "recipe.json", "run_info.json", "training_summary.json"
EVAL_REPORTS = ("eval/report.json", "report.json")  # where `draftsmith eval --out` is looked for

# Pushed layouts per method; the first is the default (the one a server loads).
FORMATS = {
    "medusa1": ("vllm", "medusa", "hf"),
    "medusa2": ("vllm", "medusa", "hf"),
    "eagle3": ("vllm", "sglang", "hf"),
    "eagle1": ("hf",),  # no server layout for EAGLE-1 heads is implemented
    "draft": ("hf",),  # a plain HF causal LM: every server reads it as is
}
FORMAT_ALIASES = {"draftsmith": "hf", "speculators": "vllm"}
METHOD_NAMES = {
    "medusa1": "Medusa-1",
    "medusa2": "Medusa-2",
    "eagle1": "EAGLE-1",
    "eagle3": "EAGLE-3",
    "draft": "draft model",
}
# Pickle files run code when loaded; the Hub flags them and servers may refuse them.
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
# Draft length written into EAGLE server configs and serving commands when no evaluation says
# otherwise: speculators' own default proposal length, and `draftsmith export`'s.
EAGLE_SPECULATIVE_TOKENS = 3
DRAFT_SPECULATIVE_TOKENS = 4  # the evaluator's default K
# `owner/name` or `name`: letters, digits, '-', '_', '.'; no '--' or '..'; no leading/trailing '-' or '.'.
_REPO_PART = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?")


class HubError(ValueError):
    """A run that cannot be staged or pushed; the message names the file, key or value."""


@dataclass
class Artifact:
    """A trained drafter on disk and the run folder it came from (None for a bare artifact)."""

    path: Path
    kind: str  # medusa | eagle | draft
    method: str  # medusa1 | medusa2 | eagle1 | eagle3 | draft
    config: dict
    run_dir: Path | None = None
    recipe: dict = field(default_factory=dict)
    run_info: dict = field(default_factory=dict)
    summary: dict = field(default_factory=dict)

    @property
    def provenance(self) -> dict:
        """The target/data fields the heads' config records (nested in the server layouts)."""
        return self.config.get("draftsmith") or self.config

    @property
    def adapter(self) -> Path | None:
        adapter = self.run_dir / "adapter" if self.run_dir is not None else None
        return adapter if adapter is not None and adapter.is_dir() else None

    @property
    def train_command(self) -> str:
        script = {"medusa": "train/medusa.py", "eagle": "train/eagle.py", "draft": "train/draft.py"}[self.kind]
        return f"accelerate launch {script}"

    @property
    def eval_flag(self) -> str:
        """The `draftsmith eval` flag that loads this kind of drafter."""
        return {"medusa": "--medusa", "eagle": "--eagle", "draft": "--draft"}[self.kind]


def read_json(path: Path, what: str) -> dict:
    """A JSON object from `path`; {} when the file is missing."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as err:
        raise HubError(f"{what} {str(path)!r} is not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise HubError(f"{what} {str(path)!r} must hold a JSON object, got {type(data).__name__}")
    return data


def artifact_kind(config: dict, where: str = "config.json") -> str:
    """medusa, eagle or draft, from an artifact's config.json (any layout draftsmith writes)."""
    architectures = config.get("architectures") or []
    if (
        config.get("model_type") in ("draftsmith_medusa", "medusa")
        or "MedusaModel" in architectures
        or "medusa_num_heads" in config
    ):
        return "medusa"
    if (
        config.get("model_type") in ("draftsmith_eagle", "draftsmith_peagle")
        or "speculators_model_type" in config
        or "LlamaForCausalLMEagle3" in architectures
    ):
        return "eagle"
    if config.get("model_type"):
        return "draft"
    raise HubError(
        f"{where} has no model_type: it is neither Medusa heads, an EAGLE head nor a transformers model "
        "(expected a folder written by train/medusa.py, train/eagle.py, train/draft.py or `draftsmith export`)"
    )


def find_artifact(path) -> Artifact:
    """The artifact of a run folder, or a bare artifact folder (with its run when its parent is one)."""
    path = Path(path).expanduser()
    if not path.is_dir():
        raise HubError(f"{str(path)!r} does not exist or is not a folder")
    inside = [path / name for name in ARTIFACT_DIRS if (path / name / "config.json").is_file()]
    if len(inside) > 1:
        names = ", ".join(p.name for p in inside)
        raise HubError(f"{str(path)!r} holds several artifacts ({names}): push one of the folders")
    if inside:
        artifact_dir, run_dir = inside[0], path
    elif (path / RECIPE).is_file() and not (path / "config.json").is_file():
        raise HubError(
            f"run folder {str(path)!r} has no heads/, head/ or draft/ with a config.json: its training has not finished"
        )
    elif (path / "config.json").is_file():
        artifact_dir = path
        parent = path.resolve().parent
        run_dir = parent if path.resolve().name in ARTIFACT_DIRS and (parent / RECIPE).is_file() else None
    else:
        raise HubError(
            f"{str(path)!r} is neither a draftsmith run folder (recipe.json with heads/, head/ or draft/ inside) "
            "nor an artifact folder (config.json + safetensors weights)"
        )
    where = str(artifact_dir / "config.json")
    config = read_json(artifact_dir / "config.json", "artifact config")
    kind = artifact_kind(config, where)
    expected = ARTIFACT_DIRS.get(artifact_dir.resolve().name) if run_dir is not None else None
    if expected is not None and kind != expected:
        raise HubError(f"{where!r} holds a {kind} config, but {artifact_dir.name}/ of a run holds {expected}")
    recipe = read_json(run_dir / RECIPE, "recipe") if run_dir else {}
    info = read_json(run_dir / RUN_INFO, "run info") if run_dir else {}
    if not recipe and info.get("recipe"):
        recipe = dict(info["recipe"])
    summary = read_json(run_dir / SUMMARY, "training summary") if run_dir else {}
    if kind == "medusa":
        adapted = recipe.get("mode") == "medusa2" or (run_dir and (run_dir / "adapter").is_dir())
        method = "medusa2" if adapted else "medusa1"
    elif kind == "eagle":
        method = config.get("version") or config.get("speculators_model_type") or "eagle3"
        if method not in ("eagle1", "eagle3"):
            raise HubError(f"{where!r}: EAGLE version {method!r}; expected eagle1 or eagle3")
    else:
        method = "draft"
    return Artifact(artifact_dir, kind, method, config, run_dir, recipe, info, summary)


def resolve_format(artifact: Artifact, format: str | None) -> str:
    """The pushed layout: `format` (or its alias) when the method has it, else the method's default."""
    allowed = FORMATS[artifact.method]
    if format is None:
        return allowed[0]
    fmt = FORMAT_ALIASES.get(format, format)
    if fmt not in allowed:
        raise HubError(f"format {format!r}: {METHOD_NAMES[artifact.method]} pushes as {', '.join(allowed)}")
    return fmt


def check_repo_id(repo_id) -> str:
    """`NAME` or `ORG/NAME` as the Hub spells repo ids; raised before any network call."""
    if not isinstance(repo_id, str) or not repo_id:
        raise HubError(f"repo id {repo_id!r}: expected NAME or ORG/NAME")
    parts = repo_id.split("/")
    bad = len(parts) > 2 or not all(_REPO_PART.fullmatch(p) and "--" not in p and ".." not in p for p in parts)
    if bad or repo_id.endswith(".git"):
        raise HubError(
            f"repo id {repo_id!r}: expected NAME or ORG/NAME (letters, digits, '-', '_', '.'; at most 96 characters "
            "per part; no '--' or '..'; not starting or ending with '-' or '.')"
        )
    return repo_id


def check_no_pickle(folder: Path) -> None:
    """Refuse a folder holding pickle files: only safetensors are pushed."""
    found = [p for p in folder.rglob("*") if p.is_file() and p.suffix.lower() in PICKLE_SUFFIXES]
    if found:
        names = ", ".join(sorted(str(p.relative_to(folder)) for p in found))
        raise HubError(
            f"{str(folder)!r} holds pickle weights ({names}): only safetensors are pushed (pickle files run code when "
            "loaded). Re-save with save_pretrained(..., safe_serialization=True) and remove the pickle files."
        )


# ---------------------------------------------------------------------- its evaluation
def find_eval_report(run_dir) -> Path | None:
    """OUT/eval/report.json or OUT/report.json of a run folder (`draftsmith eval --out`)."""
    root = find_artifact(run_dir).run_dir
    found = [root / name for name in EVAL_REPORTS if root is not None and (root / name).is_file()]
    return found[0] if found else None


def load_eval_report(report) -> dict:
    """A `draftsmith eval` report.json (path or dict), checked for what the card reads."""
    where = "eval report"
    if not isinstance(report, dict):
        path = Path(report).expanduser()
        where = f"eval report {str(path)!r}"
        if not path.is_file():
            raise HubError(f"{where} does not exist")
        report = read_json(path, "eval report")
    methods = report.get("methods")
    rows = methods if isinstance(methods, list) else []
    if not rows or not all(isinstance(m, dict) and "method" in m and "tau" in m for m in rows):
        raise HubError(
            f"{where}: expected a 'methods' list of rows with 'method' and 'tau' (the report.json of `draftsmith eval`)"
        )
    if not isinstance(report.get("settings"), dict) or "num_draft_tokens" not in report["settings"]:
        raise HubError(f"{where}: missing 'settings' with 'num_draft_tokens' (the report.json of `draftsmith eval`)")
    return report


def resolve_report(artifact: Artifact, eval_report) -> dict | None:
    """The report given (path or dict), else the run's own; refused when it measured another drafter."""
    where = eval_report if eval_report is not None else find_eval_report(artifact.path)
    if where is None:
        return None
    report = load_eval_report(where)
    evaluated = report.get("drafts")  # {"medusa" | "eagle" | "draft": path} as `draftsmith eval` records it
    if isinstance(evaluated, dict) and evaluated and artifact.kind not in evaluated:
        flags = ", ".join(f"--{k} {v}" for k, v in evaluated.items())
        raise HubError(
            f"eval report {str(where)!r} measured {flags}, not this {METHOD_NAMES[artifact.method]}: "
            "pass the report of this drafter"
        )
    return report


def serving_tokens(artifact: Artifact, report: dict | None = None) -> int:
    """K in the serving commands (and EAGLE server configs): the evaluated K when there is an
    evaluation, else the method's default; Medusa proposes at most one token per head."""
    measured = int(report["settings"]["num_draft_tokens"]) if report else None
    if artifact.kind == "medusa":
        c = artifact.config
        heads = int(artifact.provenance.get("num_heads") or c.get("num_heads") or c.get("medusa_num_heads") or 1)
        return min(measured, heads) if measured else heads
    if artifact.kind == "eagle":
        return measured or EAGLE_SPECULATIVE_TOKENS
    return measured or int(artifact.recipe.get("num_draft_tokens") or DRAFT_SPECULATIVE_TOKENS)


def local_eval_command(run_dir, prompts: str = "PROMPTS.jsonl") -> str:
    """The `draftsmith eval` command that evaluates a run in place (its report lands where
    `push` looks for it: OUT/eval/report.json)."""
    artifact = find_artifact(run_dir)
    target = artifact.recipe.get("target") or artifact.provenance.get("target_name_or_path") or "TARGET"
    out = (artifact.run_dir or artifact.path) / "eval"
    return f"draftsmith eval --target {target} {artifact.eval_flag} {artifact.path} --prompts {prompts} --out {out}"
