"""What is being pushed: the trained artifact of a run folder, its layout, and its eval report.

Either a run folder (recipe.json + heads/, head/ or draft/) or a bare artifact folder is
accepted; everything here only reads files and raises `HubError` on what it cannot use.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from draftsmith.heads.registry import METHODS, Method, get_method, method_of_config

# The run folder's sub-folder each trainer writes its artifact to (methods may share one: head/).
ARTIFACT_DIRS = tuple(dict.fromkeys(m.run_folder for m in METHODS.values()))
RECIPE, RUN_INFO, SUMMARY = "recipe.json", "run_info.json", "training_summary.json"
EVAL_REPORTS = ("eval/report.json", "report.json")  # where `draftsmith eval --out` is looked for

# Pushed layouts per method, from the registry; the first is the default (the one a server loads).
FORMATS = {kind: m.export_formats for kind, m in METHODS.items()}
# A variant a run records (recipe `mode` / `version`) whose heads have fewer layouts than its method.
VARIANT_FORMATS = {"eagle1": ("hf",)}  # a variant with no server layout implemented (docs/publishing.md)
FORMAT_ALIASES = {"draftsmith": "hf", "speculators": "vllm"}
METHOD_NAMES = {kind: m.title for kind, m in METHODS.items()}
# `owner/name` or `name`: letters, digits, '-', '_', '.'; no '--' or '..'; no leading/trailing '-' or '.'.
_REPO_PART = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?")


class HubError(ValueError):
    """A run that cannot be staged or pushed; the message names the file, key or value."""


@dataclass
class Artifact:
    """A trained drafter on disk and the run folder it came from (None for a bare artifact)."""

    path: Path
    kind: str  # the registry's kind (draftsmith.heads.registry.METHODS)
    method: str  # the variant the run or config records (e.g. medusa2, eagle1), else the kind
    config: dict
    run_dir: Path | None = None
    recipe: dict = field(default_factory=dict)
    run_info: dict = field(default_factory=dict)
    summary: dict = field(default_factory=dict)

    @property
    def spec(self) -> Method:
        return get_method(self.kind)

    @property
    def title(self) -> str:
        """The method's title, its first word numbered by the variant (KIND2 -> "Title-2 heads")."""
        number = self.method.removeprefix(self.kind)
        brand, _, rest = self.spec.title.partition(" ")
        return f"{brand}-{number} {rest}".strip() if number.isdigit() else self.spec.title

    @property
    def formats(self) -> tuple[str, ...]:
        return VARIANT_FORMATS.get(self.method, self.spec.export_formats)

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
        return f"draftsmith train {self.kind}"

    @property
    def eval_flag(self) -> str:
        """The `draftsmith eval` flag that loads this drafter, its folder to follow after `=`."""
        return f"--drafter {self.kind}"


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
    """The registry's kind of an artifact, from its config.json (any layout draftsmith writes)."""
    method = method_of_config(config)
    if method is None:
        raise HubError(
            f"{where} has no model_type: it is neither a drafter head of {', '.join(METHODS)} nor a transformers "
            "model (expected a folder written by `draftsmith train KIND` or `draftsmith export`)"
        )
    return method.kind


def variant(kind: str, config: dict, recipe: dict) -> str:
    """The variant a run's recipe (`mode`, `version`) or its config (`version`, the speculators
    type) names for this kind (KIND followed by digits, e.g. KIND3), else the kind itself."""
    provenance = config.get("draftsmith") if isinstance(config.get("draftsmith"), dict) else {}
    named = (recipe.get("mode"), recipe.get("version"), config.get("version"), provenance.get("version"))
    named += (config.get("speculators_model_type"),)
    return next((v for v in named if isinstance(v, str) and v.startswith(kind) and v[len(kind) :].isdigit()), kind)


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
    folder = artifact_dir.resolve().name
    if run_dir is not None and folder in ARTIFACT_DIRS and get_method(kind).run_folder != folder:
        raise HubError(f"{where!r} holds a {kind} config, but {folder}/ of a run holds no {kind} artifact")
    recipe = read_json(run_dir / RECIPE, "recipe") if run_dir else {}
    info = read_json(run_dir / RUN_INFO, "run info") if run_dir else {}
    if not recipe and info.get("recipe"):
        recipe = dict(info["recipe"])
    summary = read_json(run_dir / SUMMARY, "training summary") if run_dir else {}
    return Artifact(artifact_dir, kind, variant(kind, config, recipe), config, run_dir, recipe, info, summary)


def resolve_format(artifact: Artifact, format: str | None) -> str:
    """The pushed layout: `format` (or its alias) when the method has it, else the method's default."""
    allowed = artifact.formats
    if format is None:
        return allowed[0]
    fmt = FORMAT_ALIASES.get(format, format)
    if fmt not in allowed:
        raise HubError(f"format {format!r}: expected one of {', '.join(allowed)} for the {artifact.title}")
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
    from draftsmith.heads.draft import PICKLE_SUFFIXES

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
    evaluated = report.get("drafts")  # {row name: folder} as `draftsmith eval` records it
    if isinstance(evaluated, dict) and evaluated and not evaluated_names(artifact, evaluated):
        flags = ", ".join(f"{k}={v}" for k, v in evaluated.items())
        raise HubError(
            f"eval report {str(where)!r} measured {flags}, not this {artifact.title}: pass the report of this drafter"
        )
    return report


def evaluated_names(artifact: Artifact, evaluated: dict) -> list[str]:
    """The names a report's `drafts` ({name: folder}) gives this artifact: those of its folder,
    else the method's own name (the row name of a bare `--drafter KIND=DIR`)."""
    here = artifact.path.resolve()
    same = [name for name, folder in evaluated.items() if isinstance(folder, str) and Path(folder).resolve() == here]
    return same or [name for name in evaluated if name == artifact.kind]


def draft_limit(kind: str, config: dict) -> int | None:
    """The most tokens one call of a head proposes, when its config bounds it: one per head
    of a multi-head drafter (`num_heads`), a block head's block_size - 1; None for a draft model
    (any K)."""
    if not get_method(kind).model_types:
        return None
    heads = config.get("num_heads") or config.get("medusa_num_heads")
    if heads:
        return int(heads)
    return int(config["block_size"]) - 1 if config.get("block_size") else None


def default_tokens(kind: str, config: dict, recipe: dict | None = None) -> int:
    """K when no evaluation or tuning says otherwise: the recipe's, the draft length the folder's
    server config proposes, the depths a head trained (`num_depths`), else every token one call
    proposes, else the method's default; never above `draft_limit`."""
    own = config.get("draftsmith") if isinstance(config.get("draftsmith"), dict) else {}
    proposals = (config.get("speculators_config") or {}).get("proposal_methods") or [{}]
    limit = draft_limit(kind, config)
    k = int(
        (recipe or {}).get("num_draft_tokens")
        or proposals[0].get("speculative_tokens")
        or config.get("num_speculative_tokens")
        or config.get("num_depths")
        or own.get("num_depths")
        or limit
        or get_method(kind).default_k
    )
    return min(k, limit) if limit else k


def serving_tokens(artifact: Artifact, report: dict | None = None) -> int:
    """K in the serving commands (and the server configs the export writes): the evaluated K when
    there is an evaluation (within `draft_limit`), else `default_tokens`."""
    measured = int(report["settings"]["num_draft_tokens"]) if report else None
    limit = draft_limit(artifact.kind, artifact.config)
    if measured:
        return min(measured, limit) if limit else measured
    return default_tokens(artifact.kind, artifact.config, artifact.recipe)


def local_eval_command(run_dir, prompts: str = "PROMPTS.jsonl") -> str:
    """The `draftsmith eval` command that evaluates a run in place (its report lands where
    `push` looks for it: OUT/eval/report.json)."""
    artifact = find_artifact(run_dir)
    target = artifact.recipe.get("target") or artifact.provenance.get("target_name_or_path") or "TARGET"
    out = (artifact.run_dir or artifact.path) / "eval"
    return f"draftsmith eval --target {target} {artifact.eval_flag} {artifact.path} --prompts {prompts} --out {out}"
