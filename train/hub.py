"""Push a trained drafter to the Hugging Face Hub, with a model card generated from its run.

    draftsmith push runs/medusa --repo-id me/llama-3.1-8b-medusa --private
    draftsmith push runs/eagle3 --repo-id me/llama-3.1-8b-eagle3 --format sglang
    draftsmith push runs/medusa --repo-id me/llama-3.1-8b-medusa --dry-run --out staged   # write, push nothing

    from draftsmith.train.hub import push, stage_run
    url = push("runs/medusa", "me/llama-3.1-8b-medusa", private=True)

What goes to the Hub (`stage_run`) is built in a temporary folder and renamed into place:
- the weights, as safetensors only (an artifact holding pickle weights is refused), and their
  config.json. Heads go in the layout a server loads: Medusa -> vLLM, EAGLE-3 -> vLLM
  (speculators), through the heads' own exporters; `format` picks another one ("medusa" for
  FasterDecoding/TGI, "sglang", "hf" = the draftsmith layout; EAGLE-1 heads have only "hf").
  A draft model goes as the plain HF model it is, with its tokenizer. A Medusa-2 run adds
  `adapter/`: the LoRA adapter its heads were trained against.
- recipe.yaml (the resolved recipe) and run_info.json, with anything token-like removed;
- README.md, the model card (`model_card`): target (name, revision, fingerprint), data
  provenance, training, the `draftsmith eval` results when the run has them, and the commands
  that serve the drafter with vLLM and SGLang.

Either a run folder (recipe.json + heads/, head/ or draft/) or a bare artifact folder is
accepted. The token comes from the argument or huggingface_hub's usual sources (HF_TOKEN,
`hf auth login`); it is never printed and never written into a pushed file.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from draftsmith.heads.artifacts import write_folder_atomic

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
# Pickle files run code when loaded; the Hub flags them and servers may refuse them.
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
# Draft length written into EAGLE server configs and serving commands when no evaluation says
# otherwise: speculators' own default proposal length, and `draftsmith export`'s.
EAGLE_SPECULATIVE_TOKENS = 3
DRAFT_SPECULATIVE_TOKENS = 4  # the evaluator's default K
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.json",
    "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json",
)  # fmt: skip
REDACTED = "<redacted>"
# `owner/name` or `name`: letters, digits, '-', '_', '.'; no '--' or '..'; no leading/trailing '-' or '.'.
_REPO_PART = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?")


class HubError(ValueError):
    """A run that cannot be staged or pushed; the message names the file, key or value."""


# ---------------------------------------------------------------------- what is being pushed
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


def _read_json(path: Path, what: str) -> dict:
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
    if config.get("model_type") == "draftsmith_eagle" or "speculators_model_type" in config or "LlamaForCausalLMEagle3" in architectures:
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
        raise HubError(f"{str(path)!r} holds several artifacts ({', '.join(p.name for p in inside)}): push one of the folders")
    if inside:
        artifact_dir, run_dir = inside[0], path
    elif (path / RECIPE).is_file() and not (path / "config.json").is_file():
        raise HubError(f"run folder {str(path)!r} has no heads/, head/ or draft/ with a config.json: its training has not finished")
    elif (path / "config.json").is_file():
        artifact_dir = path
        parent = path.resolve().parent
        run_dir = parent if path.resolve().name in ARTIFACT_DIRS and (parent / RECIPE).is_file() else None
    else:
        raise HubError(
            f"{str(path)!r} is neither a draftsmith run folder (recipe.json with heads/, head/ or draft/ inside) "
            "nor an artifact folder (config.json + safetensors weights)"
        )
    config = _read_json(artifact_dir / "config.json", "artifact config")
    kind = artifact_kind(config, str(artifact_dir / "config.json"))
    expected = ARTIFACT_DIRS.get(artifact_dir.resolve().name) if run_dir is not None else None
    if expected is not None and kind != expected:
        raise HubError(f"{str(artifact_dir / 'config.json')!r} holds a {kind} config, but {artifact_dir.name}/ of a run holds {expected}")
    recipe = _read_json(run_dir / RECIPE, "recipe") if run_dir else {}
    info = _read_json(run_dir / RUN_INFO, "run info") if run_dir else {}
    if not recipe and info.get("recipe"):
        recipe = dict(info["recipe"])
    summary = _read_json(run_dir / SUMMARY, "training summary") if run_dir else {}
    if kind == "medusa":
        method = "medusa2" if recipe.get("mode") == "medusa2" or (run_dir and (run_dir / "adapter").is_dir()) else "medusa1"
    elif kind == "eagle":
        method = config.get("version") or config.get("speculators_model_type") or "eagle3"
        if method not in ("eagle1", "eagle3"):
            raise HubError(f"{str(artifact_dir / 'config.json')!r}: EAGLE version {method!r}; expected eagle1 or eagle3")
    else:
        method = "draft"
    return Artifact(artifact_dir, kind, method, config, run_dir, recipe, info, summary)


def resolve_format(artifact: Artifact, format: str | None) -> str:
    allowed = FORMATS[artifact.method]
    if format is None:
        return allowed[0]
    fmt = FORMAT_ALIASES.get(format, format)
    if fmt not in allowed:
        raise HubError(f"format {format!r}: {_METHOD_NAMES[artifact.method]} pushes as {', '.join(allowed)}")
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


def _pickle_files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file() and p.suffix.lower() in PICKLE_SUFFIXES)


def _check_no_pickle(folder: Path) -> None:
    found = _pickle_files(folder)
    if found:
        raise HubError(
            f"{str(folder)!r} holds pickle weights ({', '.join(found)}): only safetensors are pushed (pickle files run code "
            "when loaded). Re-save with save_pretrained(..., safe_serialization=True) and remove the pickle files."
        )


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
        report = _read_json(path, "eval report")
    methods = report.get("methods")
    if not isinstance(methods, list) or not methods or not all(isinstance(m, dict) and "method" in m and "tau" in m for m in methods):
        raise HubError(f"{where}: expected a 'methods' list of rows with 'method' and 'tau' (the report.json of `draftsmith eval`)")
    if not isinstance(report.get("settings"), dict) or "num_draft_tokens" not in report["settings"]:
        raise HubError(f"{where}: missing 'settings' with 'num_draft_tokens' (the report.json of `draftsmith eval`)")
    return report


# ---------------------------------------------------------------------- secrets
_HF_TOKEN_VALUE = re.compile(r"hf_[A-Za-z0-9]{20,}")
_SECRET_WORDS = ("secret", "password", "passwd", "api_key", "apikey", "credential", "private_key")
# "<word>_token" names a vocabulary entry for these words (pad_token, eos_token, ...), not a credential.
_VOCABULARY_WORDS = {
    "bos", "eos", "pad", "unk", "sep", "cls", "mask", "bonus", "draft", "special", "start", "end", "stop", "next",
    "new", "first", "last", "target", "image", "audio", "video", "think", "sentinel", "decoder", "add", "split",
}  # fmt: skip


def is_secret_key(key: str) -> bool:
    """True for names of credentials (token, hub_token, use_auth_token, api_key, ...); False for
    vocabulary names (pad_token, eos_token_id, max_new_tokens, tokenizer, token_map)."""
    k = str(key).lower().replace("-", "_").strip("_")
    if any(word in k for word in _SECRET_WORDS):
        return True
    parts = k.split("_")
    return parts[-1] == "token" and (len(parts) == 1 or parts[-2] not in _VOCABULARY_WORDS)


def _scrub_text(text: str, secrets: tuple[str, ...]) -> str:
    for secret in secrets:
        if secret:
            text = text.replace(secret, REDACTED)
    return _HF_TOKEN_VALUE.sub(REDACTED, text)


def _scrub_argv(argv: list, secrets: tuple[str, ...]) -> list:
    """A command line with the values of credential flags (`--hub-token X`, `hub_token=X`) redacted."""
    out, hide_next = [], False
    for item in argv:
        text = str(item)
        if hide_next:
            out.append(REDACTED)
            hide_next = False
            continue
        name, sep, _ = text.lstrip("-").partition("=")
        if is_secret_key(name) and (sep or text.startswith("-")):
            if sep:
                out.append(text.split("=", 1)[0] + "=" + REDACTED)
            else:
                out.append(text)
                hide_next = True
            continue
        out.append(_scrub_text(text, secrets))
    return out


def scrub(value, secrets: tuple[str, ...] = ()):
    """`value` without credential keys, with token-like strings and `secrets` redacted."""
    if isinstance(value, dict):
        return {
            k: (_scrub_argv(v, secrets) if k == "command" and isinstance(v, list) else scrub(v, secrets))
            for k, v in value.items()
            if not is_secret_key(k)
        }
    if isinstance(value, (list, tuple)):
        return [scrub(v, secrets) for v in value]
    if isinstance(value, str):
        return _scrub_text(value, secrets)
    return value


def _check_no_secret(folder: Path, secrets: tuple[str, ...]) -> None:
    """Last guard before anything leaves the machine: no staged file contains a secret. Weights
    are read only in their safetensors header (tensors cannot hold a string on purpose)."""
    needles = [s.encode() for s in secrets if s]
    if not needles:
        return
    for path in folder.rglob("*"):
        if not path.is_file():
            continue
        if path.suffix == ".safetensors":
            with path.open("rb") as f:
                head = f.read(8)
                data = f.read(int.from_bytes(head, "little")) if len(head) == 8 else b""
        else:
            data = path.read_bytes()
        if any(n in data for n in needles):
            raise HubError(f"{str(path.relative_to(folder))!r} would carry the Hub token; nothing was pushed. Remove it from that file.")


# ---------------------------------------------------------------------- staging
def _is_staging(folder: Path) -> bool:
    """A folder an earlier `stage_run` wrote (replaced on a new dry run)."""
    readme = Path(folder) / "README.md"
    try:
        from huggingface_hub import ModelCard

        return readme.is_file() and "draftsmith" in (ModelCard(readme.read_text(encoding="utf-8")).data.tags or [])
    except (OSError, ValueError):
        return False


def stage_run(run_dir, staging_dir, *, format=None, eval_report=None, repo_id=None, base_model=None, revision=None, _secrets=()) -> Path:
    """Write what would be pushed for `run_dir` into `staging_dir` (built aside, then renamed).

    `staging_dir` must not exist or be empty, or hold an earlier staging (replaced). `repo_id`
    (and `revision`, the branch) name the repository in the card's commands (`ORG/NAME` when
    not given). `base_model` is the target's Hub id when the run loaded it from a local folder."""
    artifact = find_artifact(run_dir)
    fmt = resolve_format(artifact, format)
    _check_no_pickle(artifact.path)
    if artifact.adapter is not None:
        _check_no_pickle(artifact.adapter)
    report = _resolve_report(artifact, eval_report)
    k = serving_tokens(artifact, report)
    secrets = tuple(s for s in _secrets if s)
    card = _card(artifact, repo_id=repo_id or "ORG/NAME", fmt=fmt, report=report, base_model=base_model, revision=revision)

    def write(tmp: Path) -> None:
        _write_weights(artifact, fmt, k, tmp)
        if artifact.adapter is not None:
            (tmp / "adapter").mkdir()
            for src in sorted(artifact.adapter.iterdir()):
                if src.is_file() and (src.suffix == ".safetensors" or src.name == "adapter_config.json"):
                    shutil.copy2(src, tmp / "adapter" / src.name)
        if artifact.recipe:
            header = (
                "# The resolved recipe of this run (every default filled in; credentials removed).\n"
                f"# Paths are those of the machine it trained on. Retrain: {_train_command(artifact)} --recipe recipe.yaml\n"
            )
            text = yaml.safe_dump(scrub(artifact.recipe, secrets), sort_keys=False, allow_unicode=True)
            (tmp / "recipe.yaml").write_text(header + text, encoding="utf-8")
        if artifact.run_info:
            (tmp / "run_info.json").write_text(json.dumps(scrub(artifact.run_info, secrets), indent=2) + "\n", encoding="utf-8")
        (tmp / "README.md").write_text(_scrub_text(card, secrets), encoding="utf-8")
        weights = [p.name for p in tmp.rglob("*.safetensors")]
        if not weights:
            raise HubError(f"{str(artifact.path)!r}: no safetensors weights to push")
        _check_no_pickle(tmp)
        _check_no_secret(tmp, secrets)

    return write_folder_atomic(staging_dir, write, overwrite=False, may_replace=_is_staging, error=HubError)


def _write_weights(artifact: Artifact, fmt: str, k: int, out: Path) -> None:
    if artifact.kind == "draft":
        names = [p.name for p in artifact.path.iterdir() if p.is_file() and not p.name.startswith(".") and p.name != "README.md"]
        if not any(n.endswith(".safetensors") for n in names):
            raise HubError(f"draft {str(artifact.path)!r} has no safetensors weights (save it with save_pretrained)")
        if not any(n in TOKENIZER_FILES for n in names):
            raise HubError(
                f"draft {str(artifact.path)!r} has no tokenizer files: save the target's tokenizer beside it "
                "(AutoTokenizer.from_pretrained(target).save_pretrained(draft_dir))"
            )
        for name in sorted(names):
            shutil.copy2(artifact.path / name, out / name)
        return
    if artifact.kind == "medusa":
        from draftsmith.heads.medusa import MedusaError, export_medusa, load_medusa, save_medusa

        try:
            heads = load_medusa(artifact.path)
            if fmt == "hf":
                save_medusa(heads, out, overwrite=True)
                return
            if heads.config.share_lm_head:
                heads = load_medusa(artifact.path, target=_load_target(artifact, heads.dtype))
            export_medusa(heads, out, fmt, overwrite=True)
        except MedusaError as err:
            raise HubError(str(err)) from None
        return
    from draftsmith.heads.eagle import EagleError, export_eagle, load_eagle

    try:
        export_eagle(load_eagle(artifact.path), out, fmt, num_speculative_tokens=k, overwrite=True)
    except EagleError as err:
        hint = " (push with format 'hf' for the draftsmith layout)" if fmt != "hf" else ""
        raise HubError(f"{err}{hint}") from None


def _load_target(artifact: Artifact, dtype):
    """The target, for heads that share its lm_head: the server layouts hold a copy per head."""
    import torch

    from draftsmith.heads.models import ModelLoadError, load_causal_lm

    name = artifact.recipe.get("target") or artifact.provenance.get("target_name_or_path")
    if not name:
        raise HubError(f"{str(artifact.path)!r}: heads with share_lm_head need the target's lm_head, and no target is recorded; push with format 'hf'")
    try:
        return load_causal_lm(name, device=torch.device("cpu"), dtype=dtype, role="target")
    except ModelLoadError as err:
        raise HubError(f"heads with share_lm_head need the target's lm_head for this layout: {err}; or push with format 'hf'") from None


def _resolve_report(artifact: Artifact, eval_report) -> dict | None:
    where = eval_report if eval_report is not None else find_eval_report(artifact.path)
    if where is None:
        return None
    report = load_eval_report(where)
    evaluated = report.get("drafts")  # {"medusa" | "eagle" | "draft": path} as `draftsmith eval` records it
    if isinstance(evaluated, dict) and evaluated and artifact.kind not in evaluated:
        flags = ", ".join(f"--{k} {v}" for k, v in evaluated.items())
        raise HubError(f"eval report {str(where)!r} measured {flags}, not this {_METHOD_NAMES[artifact.method]}: pass the report of this drafter")
    return report


def serving_tokens(artifact: Artifact, report: dict | None = None) -> int:
    """K in the serving commands (and EAGLE server configs): the evaluated K when there is an
    evaluation, else the method's default; Medusa proposes at most one token per head."""
    measured = int(report["settings"]["num_draft_tokens"]) if report else None
    if artifact.kind == "medusa":
        heads = int(artifact.provenance.get("num_heads") or artifact.config.get("num_heads") or artifact.config.get("medusa_num_heads") or 1)
        return min(measured, heads) if measured else heads
    if artifact.kind == "eagle":
        return measured or EAGLE_SPECULATIVE_TOKENS
    return measured or int(artifact.recipe.get("num_draft_tokens") or DRAFT_SPECULATIVE_TOKENS)


# ---------------------------------------------------------------------- the model card
_METHOD_NAMES = {"medusa1": "Medusa-1", "medusa2": "Medusa-2", "eagle1": "EAGLE-1", "eagle3": "EAGLE-3", "draft": "draft model"}
_FORMAT_NAMES = {
    ("medusa", "vllm"): "vLLM's Medusa layout (`model_type: medusa`)",
    ("medusa", "medusa"): "the original Medusa layout (FasterDecoding, TGI: `medusa_lm_head.safetensors`)",
    ("medusa", "hf"): "the draftsmith layout (`load_medusa`)",
    ("eagle", "vllm"): "the speculators layout that vLLM loads (`speculators_model_type: eagle3`)",
    ("eagle", "sglang"): "SGLang's layout (`LlamaForCausalLMEagle3`)",
    ("eagle", "hf"): "the draftsmith layout (`load_eagle`)",
    ("draft", "hf"): "a plain transformers causal LM with its tokenizer",
}
_HYPERPARAMETERS = {
    "medusa": ("mode", "num_heads", "num_layers", "share_lm_head", "loss", "temperature", "head_decay", "lr", "weight_decay",
               "warmup_steps", "max_steps", "batch_size", "grad_accum", "max_length", "grad_clip", "heldout_fraction", "seed"),
    "eagle": ("version", "aux_layers", "draft_vocab_size", "vocab_map", "ttt_steps", "ttt_decay", "lr", "weight_decay",
              "warmup_steps", "max_steps", "batch_size", "grad_accum", "max_length", "grad_clip", "heldout_fraction", "seed"),
    "draft": ("draft_init", "draft_path", "draft_layers", "draft_hidden", "loss", "beta", "tv_weight", "temperature", "data_mode",
              "on_policy_fraction", "on_policy_new_tokens", "lora", "lr", "weight_decay", "warmup_steps", "max_steps",
              "batch_size", "grad_accum", "max_length", "grad_clip", "heldout_fraction", "num_draft_tokens", "seed"),
}  # fmt: skip
_METHOD_HYPERPARAMETERS = {  # on top of the kind's
    "medusa2": ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "medusa2_lambda", "lambda_warmup_steps", "head_lr_multiplier"),
    "eagle1": ("feature_weight", "ce_weight", "feature_noise"),
}


def model_card(run_dir, *, repo_id, format, eval_report=None, base_model=None, revision=None) -> str:
    """README.md for the Hub: YAML front matter (base_model, library_name, tags) and the card.

    `eval_report`: a `draftsmith eval` report.json (path or dict); by default the run's
    OUT/eval/report.json or OUT/report.json when there is one."""
    check_repo_id(repo_id)
    artifact = find_artifact(run_dir)
    report = _resolve_report(artifact, eval_report)
    return _card(artifact, repo_id=repo_id, fmt=resolve_format(artifact, format), report=report, base_model=base_model, revision=revision)


@dataclass
class _Target:
    name: str | None  # as recorded (hub id or local path)
    hub_id: str | None  # the Hub id, when the name is one (or base_model was given)
    revision: str | None
    fingerprint: str | None
    details: dict


def _looks_like_hub_id(name: str) -> bool:
    """`org/name` that is not a path on this machine or an absolute/relative path spelling."""
    if not name or name.startswith((".", "/", "~")) or "\\" in name or Path(name).expanduser().exists():
        return False
    try:
        check_repo_id(name)
    except HubError:
        return False
    return True


def _data(artifact: Artifact) -> tuple[Path | None, dict, dict]:
    """(data folder, provenance.json, summary.json) of the run's training data, when found."""
    data = artifact.recipe.get("data")
    if not data:
        return None, {}, {}
    folder = Path(data).expanduser()
    if not folder.is_dir():
        return folder, {}, {}
    return folder, _read_json(folder / "provenance.json", "data provenance"), _read_json(folder / "summary.json", "data summary")


def _target(artifact: Artifact, provenance: dict, base_model: str | None) -> _Target:
    recorded = provenance.get("target") or {}
    build = ((artifact.summary.get("draft") or {}).get("build")) or {}
    name = artifact.provenance.get("target_name_or_path") if artifact.kind != "draft" else None
    name = name or artifact.recipe.get("target") or recorded.get("name_or_path") or build.get("target_name_or_path")
    revision = (artifact.provenance.get("target_revision") if artifact.kind != "draft" else None) or recorded.get("revision")
    fingerprint = (artifact.provenance.get("target_fingerprint") if artifact.kind != "draft" else None) or recorded.get("fingerprint") or build.get("target_fingerprint")
    if base_model is not None and not (isinstance(base_model, str) and base_model.count("/") == 1 and _looks_like_hub_id(base_model)):
        raise HubError(f"base model {base_model!r}: expected the target's Hub id as ORG/NAME (the Hub rejects paths there)")
    hub_id = base_model or (name if name and _looks_like_hub_id(str(name)) else None)
    return _Target(name, hub_id, revision, fingerprint, recorded)


def _fmt(value, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_fmt(v, digits) for v in value) + "]"
    return str(value)


def _param(value) -> str:
    """A hyperparameter as it was written: 1e-3 stays 0.001, not 0.001000."""
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (list, tuple)):
        return ", ".join(map(str, value))
    return _fmt(value)


def _table(rows: list[tuple[str, object]]) -> str:
    lines = ["| | |", "|---|---|"]
    lines += [f"| {key} | {value} |" for key, value in rows if value is not None]
    return "\n".join(lines)


def _method_section(artifact: Artifact) -> str:
    c, p, r = artifact.config, artifact.provenance, artifact.recipe
    if artifact.kind == "medusa":
        heads = p.get("num_heads") or c.get("num_heads") or c.get("medusa_num_heads")
        text = (
            f"{heads} Medusa heads (Cai et al., 2024) on the target's last hidden state, after its final norm. Head k "
            "(0-based), a residual block x + SiLU(Wx + b) followed by a projection to the vocabulary, predicts the token "
            "k + 2 positions ahead; the target's own lm_head supplies the next one. At each step the heads propose a chain "
            "(or a tree) of tokens and the target verifies them all in one forward pass."
        )
        if artifact.method == "medusa2":
            return text + (
                "\n\n**Medusa-2**: the heads were trained jointly with LoRA adapters on the target's backbone (`adapter/`), with "
                "a KL term that keeps the adapted target close to the original. The heads match the ADAPTED target: serve them "
                "with the adapter merged into it. Decoding is then lossless with respect to the adapted model, whose outputs "
                "differ from the original target's (the held-out KL drift is below)."
            )
        return text + "\n\n**Medusa-1**: the target stayed frozen, so speculative decoding with these heads is lossless: every token is the target's."
    if artifact.kind == "eagle":
        if artifact.method == "eagle1":
            return (
                "An EAGLE-1 head (Li et al., 2024): fc(concat(embedding of the next token, the target's last feature)) feeds one "
                "Llama decoder layer that predicts the target's next feature; the target's frozen lm_head turns it into tokens. "
                "Drafting runs the layer on its own predicted features; the target verifies every drafted token, so decoding is lossless."
            )
        aux = p.get("aux_layer_ids") or c.get("eagle_aux_hidden_state_layer_ids")
        vd = c.get("draft_vocab_size") or p.get("draft_vocab_size")
        ttt = r.get("ttt_steps")
        return (
            f"An EAGLE-3 head (Li et al., 2025): one Llama decoder layer that drafts from the target's own features. It reads "
            f"the target's hidden states at layers {_fmt(aux)} (HF `output_hidden_states` indices), projected by fc to the "
            f"hidden size, together with the embedding of the last token, and predicts the next token over a reduced draft "
            f"vocabulary of {_fmt(vd)} tokens (`d2t` maps draft ids to target ids)."
            + (f" It was trained with training-time test: unrolled {ttt} steps on its own predicted features." if ttt else "")
            + " The target verifies every drafted token, so decoding is lossless."
        )
    loss = r.get("loss")
    return (
        "A small causal language model with the target's vocabulary, distilled on the target's own generations"
        + (f" (loss: `{loss}` at temperature {_fmt(r.get('temperature'), 2)})" if loss else "")
        + ". It drafts tokens for standard speculative sampling (Leviathan et al., 2023; Chen et al., 2023): the target "
        "accepts a drafted token x with probability min(1, p(x)/q(x)) and resamples from norm(max(0, p - q)) at the first "
        "rejection, so the output is distributed exactly as the target's."
    )


def _files_section(artifact: Artifact, fmt: str) -> str:
    rows = [f"- weights (`*.safetensors`) and `config.json`: {_FORMAT_NAMES[(artifact.kind, fmt)]}"]
    if artifact.kind == "draft":
        rows.append("- tokenizer files: the target's tokenizer (drafting and verification share token ids)")
    if artifact.adapter is not None:
        rows.append("- `adapter/`: the LoRA adapter of the target the heads were trained with (merge it before serving)")
    if artifact.recipe:
        rows.append("- `recipe.yaml`: the resolved training recipe")
    if artifact.run_info:
        rows.append("- `run_info.json`: versions, git revision and command of the training run")
    return "\n".join(rows)


def _target_section(target: _Target) -> str:
    d = target.details
    rows = [
        ("name", f"[`{target.hub_id}`](https://huggingface.co/{target.hub_id})" if target.hub_id else f"`{target.name}`" if target.name else "not recorded"),
        ("trained against", f"`{target.name}`" if target.hub_id and target.name and target.name != target.hub_id else None),
        ("revision", f"`{target.revision}`" if target.revision else "not recorded (the files the run loaded)"),
        ("fingerprint", f"`{target.fingerprint}`" if target.fingerprint else "not recorded"),
        ("architecture", _fmt(d.get("architectures")) if d.get("architectures") else None),
        ("layers / hidden / vocabulary", f"{d['num_layers']} / {d['hidden_size']} / {d['vocab_size']}" if {"num_layers", "hidden_size", "vocab_size"} <= set(d) else None),
        ("dtype", d.get("dtype")),
    ]
    note = (
        "\n\nThe fingerprint (draftsmith.heads.models.target_fingerprint) covers the target's config and a sample of every "
        "weight: draftsmith refuses a target whose fingerprint differs. A drafter trained on another revision of the target "
        "loads, but its acceptance collapses."
    )
    if not target.hub_id:
        note += (
            "\n\nThe target was a local folder, so the card has no `base_model`: push again with `--base-model ORG/NAME` "
            "to link the target's Hub page."
        )
    return _table(rows) + note


def _data_section(artifact: Artifact, folder: Path | None, provenance: dict, summary: dict) -> str:
    data_hash = summary.get("data_hash") or artifact.provenance.get("data_hash")
    if not provenance:
        where = f"`{folder}` was not found when this card was written" if folder else "no data folder is recorded"
        drafted = artifact.summary.get("data")
        return _table([("data", where), ("data hash", f"`{data_hash}`" if data_hash else None), ("training rows", f"`{drafted}`" if drafted else None)])
    source, settings, template = provenance.get("source") or {}, provenance.get("settings") or {}, provenance.get("chat_template") or {}
    sampling = ", ".join(
        f"{k} {_fmt(settings[k], 2)}" for k in ("temperature", "top_p", "top_k", "max_new_tokens", "num_samples", "seed") if k in settings
    )
    rows = [
        ("made by", "`draftsmith generate`: the target's own answers to the source's prompts (the loss covers the answer tokens)"),
        ("source", f"`{source.get('name')}` ({source.get('format')}, {source.get('records')} records)" if source else None),
        ("chat template", f"{template.get('spec')} ({'used' if template.get('used') else 'not used'})" if template else None),
        ("sampling", sampling or None),
        ("samples", _fmt(summary.get("samples"))),
        ("tokens", f"{_fmt(summary.get('tokens'))} ({_fmt(summary.get('trained_tokens'))} trained, under the loss mask)"),
        ("cut at max_new_tokens", f"{_fmt(summary.get('truncation_rate'), 3)}" if "truncation_rate" in summary else None),
        ("data hash", f"`{data_hash}`" if data_hash else None),
    ]
    return _table(rows)


def _heldout_rows(artifact: Artifact) -> list[tuple[str, object]]:
    s = artifact.summary
    ev = s.get("eval") or {}
    if artifact.kind == "medusa":
        return [
            ("top-1 accuracy per head", _fmt(ev.get("top1"))),
            ("top-5 accuracy per head", _fmt(ev.get("top5"))),
            ("simulated chain tau (counts the target's own token)", _fmt(ev.get("tau_simulated"))),
            ("KL drift of the adapted target (Medusa-2)", _fmt(ev["kl_drift"], 4) if "kl_drift" in ev else None),
            ("held-out positions", _fmt(ev.get("positions"), 0)),
        ]
    if artifact.kind == "eagle":
        return [
            ("top-1 accuracy per draft step", _fmt(ev.get("top1_per_step"))),
            ("simulated chain tau (counts the target's own token)", _fmt(ev.get("tau_simulated"))),
            ("draft vocabulary coverage of trained tokens", _fmt(s.get("vocab_coverage"))),
            ("held-out positions", _fmt(ev.get("positions"), 0)),
        ]
    init = s.get("initial") or {}
    k = artifact.recipe.get("num_draft_tokens")
    return [
        ("acceptance E[sum min(p, q)] at the training temperature", f"{_fmt(init.get('acceptance'))} -> {_fmt(ev.get('acceptance'))}" if init else _fmt(ev.get("acceptance"))),
        ("greedy acceptance (argmax agreement)", f"{_fmt(init.get('acceptance_greedy'))} -> {_fmt(ev.get('acceptance_greedy'))}" if init else _fmt(ev.get("acceptance_greedy"))),
        (f"simulated tau at K = {k} (counts the bonus token)", f"{_fmt(init.get('tau_simulated'))} -> {_fmt(ev.get('tau_simulated'))}" if init else _fmt(ev.get("tau_simulated"))),
        ("held-out positions", _fmt(ev.get("positions"), 0)),
    ]


def _training_section(artifact: Artifact) -> str:
    if not artifact.recipe:
        return "No run folder came with these weights: the training recipe and metrics are not recorded."
    r, s, info = artifact.recipe, artifact.summary, artifact.run_info
    keys = _HYPERPARAMETERS[artifact.kind] + _METHOD_HYPERPARAMETERS.get(artifact.method, ())
    if artifact.kind == "eagle" and s.get("aux_layers"):
        r = {**r, "aux_layers": s["aux_layers"]}
    hyper = [(f"`{k}`", _param(r[k])) for k in keys if r.get(k) is not None]
    versions = info.get("versions") or {}
    parts = [
        _table([
            ("trainer", f"`{_train_command(artifact)}` (draftsmith {versions.get('draftsmith', '?')}, git {str(info.get('git_revision') or '?')[:12]})"),
            ("optimizer steps", _fmt(s.get("steps"))),
            ("device", f"{s.get('device')} x {s.get('processes')}" if s.get("device") else None),
        ]),
        "",
        "Hyperparameters (all of them are in `recipe.yaml`):",
        "",
        _table(hyper),
    ]
    if s.get("eval"):
        parts += ["", "Held-out metrics at the end of training (`training_summary.json`; rows of the training data held out from training):", "", _table(_heldout_rows(artifact))]
    else:
        parts += ["", "No held-out metrics were recorded (heldout_fraction = 0, or no training_summary.json)."]
    return "\n".join(parts)


def _local_name(repo_id: str) -> str:
    return repo_id.split("/")[-1]


def _download(repo_id: str, revision: str | None) -> str:
    rev = f" --revision {revision}" if revision else ""
    return f"hf download {repo_id}{rev} --local-dir {_local_name(repo_id)}"


def _eval_flag(artifact: Artifact) -> str:
    return {"medusa": "--medusa", "eagle": "--eagle", "draft": "--draft"}[artifact.kind]


def _evaluation_section(artifact: Artifact, report: dict | None, repo_id: str, target: str, k: int, revision: str | None) -> str:
    if report is None:
        return "\n".join([
            "Not evaluated with `draftsmith eval` yet. To measure acceptance per position, tau, speedup and KL against the target:",
            "",
            "```bash",
            _download(repo_id, revision),
            (
                f"draftsmith eval --target {target} {_eval_flag(artifact)} {_local_name(repo_id)} -k {k} "
                f"--prompts prompts.jsonl --out {_local_name(repo_id)}-eval"
            ),
            "```",
            "",
            'where prompts.jsonl holds one `{"prompt": ...}` per line, prompts that were not in the training data.',
        ])  # fmt: skip
    from draftsmith.eval.report import position_table, summary_table

    s, t = report["settings"], report.get("target") or {}
    settings = [
        ("mode", f"{report.get('mode', '?')} (" + (
            "lossless: the output is distributed exactly as the target's" if report.get("lossless", True)
            else "rows marked LOSSY use Medusa's typical acceptance, which changes the output; the others are lossless"
        ) + ")"),
        ("K (draft tokens per target call)", _fmt(s.get("num_draft_tokens"))),
        ("temperature / top-k / top-p", f"{_fmt(s.get('temperature'), 2)} / {_fmt(s.get('top_k'))} / {_fmt(s.get('top_p'), 2)}"),
        ("max new tokens", _fmt(s.get("max_new_tokens"))),
        ("prompts", f"{_fmt(report.get('num_prompts'))}" + (f" from `{Path(report['prompts_file']).name}`" if report.get("prompts_file") else "")),
        ("timed passes", _fmt(s.get("repeats"))),
        ("target dtype / device", f"{t.get('dtype', '?')} / {t.get('device', '?')}" if t else None),
        ("draftsmith", f"{report.get('draftsmith_version')} (git {str(report.get('git_revision') or '?')[:12]})" if report.get("draftsmith_version") else None),
    ]
    return "\n".join([
        "Measured with `draftsmith eval` (the lossless speculative decoder; every method decodes the same prompts):",
        "",
        _table(settings),
        "",
        summary_table(report),
        "",
        (
            "tau is the mean number of tokens per target forward pass and counts the bonus token the target adds at "
            "every call: decoding without a drafter scores exactly 1.00. alpha is the acceptance rate of drafted "
            "tokens; speedup is tokens/s relative to target-only decoding on the same hardware, in the same run."
        ),
        "",
        (
            "Acceptance and distance to the target per draft position (alpha_i given position i was reached; "
            "KL(p || q)_i and TV_i between the target's and the drafter's distributions):"
        ),
        "",
        position_table(report).replace("p||q", "p\\|\\|q"),  # a bare | would split the Markdown cell
    ])  # fmt: skip


def _vllm_command(target: str, target_revision: str | None, method: str, draft: str, k: int, revision: str | None = None) -> str:
    spec = {"method": method, "model": draft, "num_speculative_tokens": k}
    if revision:
        spec["revision"] = revision  # the draft's branch (vLLM's SpeculativeConfig.revision)
    rev = f" --revision {target_revision}" if target_revision else ""
    return f"vllm serve {target}{rev} --speculative-config '{json.dumps(spec)}'"


def _sglang_command(target: str, algorithm: str, draft: str, k: int, revision: str | None = None) -> str:
    # A chain (top-k 1): K draft steps, K + 1 tokens verified per call, as draftsmith measures.
    rev = f" --speculative-draft-model-revision {revision}" if revision else ""
    return (
        f"python -m sglang.launch_server --model-path {target} --speculative-algorithm {algorithm} "
        f"--speculative-draft-model-path {draft}{rev} --speculative-num-steps {k} --speculative-eagle-topk 1 "
        f"--speculative-num-draft-tokens {k + 1}"
    )


def _serving_section(artifact: Artifact, fmt: str, repo_id: str, target: _Target, k: int, revision: str | None) -> str:
    name = target.hub_id or target.name or "TARGET"
    target_rev = target.revision
    local = _local_name(repo_id)
    parts = []
    if artifact.method == "medusa2":
        parts += [
            "These heads were trained against the target with `adapter/` merged in; merge it first and serve the merged model:",
            "",
            "```bash",
            _download(repo_id, revision),
            f"python -c \"from draftsmith.train.medusa import merge_adapter; merge_adapter('{name}', '{local}/adapter', '{local}-target')\"",
            "```",
            "",
        ]
        name, target_rev = f"{local}-target", None
    if artifact.kind == "medusa":
        if fmt == "vllm":
            parts += ["vLLM (it drafts the top-1 token of each head, no tree):", "", "```bash", _vllm_command(name, target_rev, "medusa", repo_id, k, revision), "```"]
        else:
            shared = f" --target {name}" if artifact.provenance.get("share_lm_head") else ""
            parts += [
                f"This repository holds {_FORMAT_NAMES[('medusa', fmt)]}. For vLLM, convert a download to vLLM's layout:",
                "",
                "```bash",
                _download(repo_id, revision),
                f"draftsmith export {local} --format vllm --out {local}-vllm{shared}",
                _vllm_command(name, target_rev, "medusa", f"{local}-vllm", k),
                "```",
            ]
        parts += ["", "SGLang has no Medusa drafter; `draftsmith eval --medusa DIR --medusa-tree auto` decodes with Medusa trees."]
        return "\n".join(parts)
    if artifact.kind == "eagle":
        if artifact.method == "eagle1":
            return (
                "This EAGLE-1 head is in the draftsmith layout, which vLLM and SGLang do not load; decode with it through "
                "draftsmith (below), e.g. `draftsmith eval --eagle DIR --eagle-tree 4,4,16`."
            )
        commands = {
            "vllm": lambda draft, rev=None: _vllm_command(name, target_rev, "eagle3", draft, k, rev),
            "sglang": lambda draft, rev=None: _sglang_command(name, "EAGLE3", draft, k, rev),
        }
        for server, layout in (("vLLM", "vllm"), ("SGLang", "sglang")):
            if fmt == layout:
                parts += [f"{server}:", "", "```bash", commands[layout](repo_id, revision), "```", ""]
            else:
                parts += [
                    f"{server} reads another layout: convert a download with `draftsmith export`:",
                    "",
                    "```bash",
                    _download(repo_id, revision),
                    f"draftsmith export {local} --format {layout} --num-speculative-tokens {k} --out {local}-{layout}",
                    commands[layout](f"{local}-{layout}"),
                    "```",
                    "",
                ]
        parts.append(
            f"The head reads the target's hidden states at fixed layers: serve it with exactly this target. K = {k} draft "
            "steps in a chain (top-k 1), the setting draftsmith measures."
        )
        return "\n".join(parts)
    return "\n".join([
        "vLLM:", "", "```bash", _vllm_command(name, target_rev, "draft_model", repo_id, k, revision), "```", "",
        "SGLang:", "", "```bash", _sglang_command(name, "STANDALONE", repo_id, k, revision), "```",
    ])  # fmt: skip


def _loading_section(artifact: Artifact, repo_id: str, target: str, revision: str | None, k: int, shown_above: bool) -> str:
    rev = f", revision=\"{revision}\"" if revision else ""
    if artifact.kind == "draft":
        code = [
            "from transformers import AutoModelForCausalLM",
            "",
            f'draft = AutoModelForCausalLM.from_pretrained("{repo_id}"{rev})',
        ]
    else:
        module, loader, var = ("medusa", "load_medusa", "heads") if artifact.kind == "medusa" else ("eagle", "load_eagle", "head")
        code = [
            "from huggingface_hub import snapshot_download",
            "from transformers import AutoModelForCausalLM",
            "",
            f"from draftsmith.heads.{module} import {loader}",
            "",
            f'target = AutoModelForCausalLM.from_pretrained("{target}")',
            f'{var} = {loader}(snapshot_download("{repo_id}"{rev}), target=target)  # checks the target fingerprint',
        ]
    parts = ["```python", *code, "```"]
    if not shown_above:  # the Evaluation section shows it already when there is no report
        parts += [
            "",
            "Measure it on your prompts with the same decoder:",
            "",
            "```bash",
            _download(repo_id, revision),
            f"draftsmith eval --target {target} {_eval_flag(artifact)} {_local_name(repo_id)} -k {k} --prompts prompts.jsonl --out eval",
            "```",
        ]
    return "\n".join(parts)


def _card(artifact: Artifact, *, repo_id: str, fmt: str, report: dict | None, base_model: str | None, revision: str | None = None) -> str:
    from huggingface_hub import ModelCard, ModelCardData

    folder, provenance, summary = _data(artifact)
    target = _target(artifact, provenance, base_model)
    k = serving_tokens(artifact, report)
    method = _METHOD_NAMES[artifact.method]
    tags = ["draftsmith", "speculative-decoding"]
    tags += {"medusa": ["medusa", artifact.method.replace("medusa", "medusa-")], "eagle": ["eagle", artifact.method]}.get(artifact.kind, ["draft-model"])
    tags += [t for t in {"vllm": ["vllm"], "sglang": ["sglang"], "medusa": ["tgi"]}.get(fmt, [])]
    data = ModelCardData(
        base_model=target.hub_id,
        library_name="transformers" if artifact.kind == "draft" else "draftsmith",
        pipeline_tag="text-generation" if artifact.kind == "draft" else None,
        tags=tags,
    )
    target_label = target.hub_id or target.name or "its target"
    target_arg = target.hub_id or target.name or "TARGET"
    eval_note = "" if report else " Not evaluated with `draftsmith eval` yet."
    body = [
        f"# {repo_id}",
        "",
        (
            f"A {method} drafter for speculative decoding with `{target_label}`, trained with draftsmith on the "
            f"target's own generations. Layout: {_FORMAT_NAMES[(artifact.kind, fmt)]}.{eval_note}"
        ),
        "",
        "## Method",
        "",
        _method_section(artifact),
        "",
        "## Files",
        "",
        _files_section(artifact, fmt),
        "",
        "## Target",
        "",
        _target_section(target),
        "",
        "## Training data",
        "",
        _data_section(artifact, folder, provenance, summary),
        "",
        "## Training",
        "",
        _training_section(artifact),
        "",
        "## Evaluation",
        "",
        _evaluation_section(artifact, report, repo_id, target_arg, k, revision),
        "",
        "## Serving",
        "",
        _serving_section(artifact, fmt, repo_id, target, k, revision),
        "",
        "## Loading with draftsmith",
        "",
        _loading_section(artifact, repo_id, target_arg, revision, k, report is None),
        "",
    ]  # fmt: skip
    card = ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(body))
    return str(card)


def _train_command(artifact: Artifact) -> str:
    script = {"medusa": "train/medusa.py", "eagle": "train/eagle.py", "draft": "train/draft.py"}[artifact.kind]
    return f"accelerate launch {script}"


def local_eval_command(run_dir, prompts: str = "PROMPTS.jsonl") -> str:
    """The `draftsmith eval` command that evaluates a run in place (its report lands where
    `push` looks for it: OUT/eval/report.json)."""
    artifact = find_artifact(run_dir)
    target = artifact.recipe.get("target") or artifact.provenance.get("target_name_or_path") or "TARGET"
    out = (artifact.run_dir or artifact.path) / "eval"
    return f"draftsmith eval --target {target} {_eval_flag(artifact)} {artifact.path} --prompts {prompts} --out {out}"


# ---------------------------------------------------------------------- pushing
def push(run_dir, repo_id, *, private=False, token=None, endpoint=None, revision=None, commit_message=None, format=None, eval_report=None, base_model=None) -> str:
    """Stage `run_dir` (see `stage_run`) and upload it to the Hub model repo `repo_id`; return its URL.

    The repo is created when missing (`private` applies to a new repo; pushing with
    private=True into an existing public repo is refused). `token`: the argument, else HF_TOKEN
    or the stored login. `endpoint`: the argument, else HF_ENDPOINT, else the Hub. `revision`: a
    branch, created from main when missing."""
    check_repo_id(repo_id)
    from huggingface_hub import HfApi, constants, get_token

    if constants.HF_HUB_OFFLINE:
        raise HubError("HF_HUB_OFFLINE is set: unset it to push to the Hub")
    token = token or get_token()
    if not token:
        raise HubError("no Hugging Face token: set HF_TOKEN, run `hf auth login`, or pass token=")
    endpoint = (endpoint or os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")
    tmp = Path(tempfile.mkdtemp(prefix="draftsmith-push-"))
    try:
        folder = stage_run(
            run_dir, tmp / "stage", format=format, eval_report=eval_report, repo_id=repo_id, base_model=base_model,
            revision=revision, _secrets=(token,),
        )  # fmt: skip
        if commit_message is None:
            artifact = find_artifact(run_dir)
            steps = artifact.summary.get("steps")
            commit_message = f"draftsmith: {_METHOD_NAMES[artifact.method]}" + (f", {steps} steps" if steps else "")
        api = HfApi(endpoint=endpoint, token=token)
        try:
            url = api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
            repo = url.repo_id  # NAME alone resolves to the token owner's namespace
            if private and api.repo_info(repo, repo_type="model").private is False:
                raise HubError(
                    f"{repo} already exists and is public: private=True does not change an existing repo. Make it private on "
                    "the Hub first, or push to a new repo id. Nothing was uploaded."
                )
            if revision and not revision.startswith("refs/"):
                api.create_branch(repo, branch=revision, exist_ok=True, repo_type="model")
            api.upload_folder(repo_id=repo, folder_path=str(folder), commit_message=commit_message, revision=revision, repo_type="model")
        except HubError:
            raise
        except Exception as err:  # the Hub's HTTP errors, connection errors, a rejected card
            if not _is_hub_failure(err):
                raise
            raise HubError(f"pushing to {repo_id} at {endpoint} failed: {_hub_message(err, (token,))}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    page = f"{endpoint}/{repo}"
    return f"{page}/tree/{revision}" if revision else page


def _is_hub_failure(err: Exception) -> bool:
    """Errors of the network and the Hub (not bugs): HTTP status errors, connection errors (of
    whichever HTTP library this huggingface_hub uses), invalid card metadata, offline mode."""
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    if isinstance(err, (HfHubHTTPError, OfflineModeIsEnabled, OSError)):
        return True
    if type(err).__module__.split(".")[0] in ("httpx", "httpx2", "requests", "urllib3"):
        return True
    return isinstance(err, ValueError) and "README.md" in str(err)


def _hub_message(err: Exception, secrets: tuple[str, ...]) -> str:
    """One line: the error's first line and what the Hub said (its server message)."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    text = lines[0] if lines else type(err).__name__
    server = getattr(err, "server_message", None)
    if server and server.strip() and server.strip() not in text:
        text += f" ({' '.join(server.split())})"
    elif "README.md" in text and len(lines) > 1:
        text += " " + " ".join(lines[1:])
    return _scrub_text(text, secrets)
