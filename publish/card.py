"""The model card (README.md) of a pushed drafter, rendered from card.md.j2.

Python gathers the facts (target, data provenance, training, the `draftsmith eval` results, K,
the repository's names) into plain values and table rows; the template holds the card's
sections, prose and commands. huggingface_hub's ModelCard reads the result back, so the
metadata block is what the Hub parses.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from pathlib import Path

from draftsmith.publish.artifacts import (
    Artifact,
    HubError,
    check_repo_id,
    evaluated_names,
    find_artifact,
    read_json,
    resolve_format,
    resolve_report,
    serving_tokens,
)
from draftsmith.publish.serve import FORMAT_TAGS, sglang_command, vllm_command

TEMPLATE = "card.md.j2"
# The training keys every method's card lists after the method's own recipe fields.
_TRAINING_KEYS = (
    "lr",
    "weight_decay",
    "warmup_steps",
    "max_steps",
    "batch_size",
    "grad_accum",
    "max_length",
    "grad_clip",
    "heldout_fraction",
    "seed",
)
# Recipe keys that are the run's plumbing (what every recipe has: paths, logging, checkpoints, the
# Hub), caches on the training machine, or speed and evaluation knobs: not hyperparameters.
_NOT_HYPERPARAMETERS = (
    "target",
    "data",
    "out",
    "device",
    "dtype",
    "target_sharding",
    "trust_remote_code",
    "allow_target_mismatch",
    "eval_every",
    "save_every",
    "keep_checkpoints",
    "resume",
    "init_from",
    "log_every",
    "serve_check_prompts",
    "serve_check_new_tokens",
    "report_to",
    "tracker_project",
    "push_to_hub",
    "hub_repo_id",
    "hub_private",
    "hidden_cache",
    "teacher_cache",
    "fixed_data",
    "chunk_size",
    "eval_topk",
    "eval_depth",
)
# The held-out metrics of training_summary.json ("eval"), whichever method wrote them.
_HELDOUT = {
    "top1": "top-1 accuracy per head",
    "top5": "top-5 accuracy per head",
    "top1_per_step": "top-1 accuracy per draft step",
    "top1_per_depth": "top-1 accuracy per depth (one forward)",
    "top1_per_slot": "top-1 accuracy per block slot",
    "acceptance": "acceptance E[sum min(p, q)] at the training temperature",
    "acceptance_greedy": "greedy acceptance (argmax agreement)",
    "tau_simulated": "simulated tau (counts the target's own token)",
    "kl_drift": "KL drift of the adapted target",
    "positions": "held-out positions",
}


def model_card(run_dir, *, repo_id, format, eval_report=None, base_model=None, revision=None, license=None) -> str:
    """README.md for the Hub: YAML front matter (base_model, license, datasets, library_name, tags,
    and the evaluation as model-index) and the card.

    `eval_report`: a `draftsmith eval` report.json (path or dict); by default the run's
    OUT/eval/report.json or OUT/report.json when there is one. `license`: the target's license
    (a Hub license id), when the target's own model card is not on this machine to read it from."""
    check_repo_id(repo_id)
    artifact = find_artifact(run_dir)
    report = resolve_report(artifact, eval_report)
    fmt = resolve_format(artifact, format)
    return render_card(
        artifact, repo_id=repo_id, fmt=fmt, report=report, base_model=base_model, revision=revision, license=license
    )


def render_card(
    artifact: Artifact,
    *,
    repo_id: str,
    fmt: str,
    report: dict | None,
    base_model: str | None,
    revision: str | None = None,
    license: str | None = None,
) -> str:
    """The card of `artifact` pushed as `fmt` to `repo_id` (at branch `revision`)."""
    from huggingface_hub import ModelCard

    values = card_values(
        artifact, repo_id=repo_id, fmt=fmt, report=report, base_model=base_model, revision=revision, license=license
    )
    return str(ModelCard(_template().render(values)))


@lru_cache(maxsize=1)
def _template():
    import jinja2

    env = jinja2.Environment(
        autoescape=False,  # Markdown, not HTML
        undefined=jinja2.StrictUndefined,  # a missing value is an error, not an empty cell
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )
    env.filters["paragraph"] = paragraph
    env.globals.update(table=table, vllm_command=vllm_command, sglang_command=sglang_command)
    return env.from_string(resources.files(__package__).joinpath(TEMPLATE).read_text(encoding="utf-8"))


# ---------------------------------------------------------------------- helpers of the template
def paragraph(text: str) -> str:
    """A paragraph written over several template lines, as the one Markdown line it is."""
    return " ".join(line.strip() for line in text.splitlines() if line.strip()) + "\n"


def table(rows: list[tuple[str, object]]) -> str:
    """A two-column Markdown table; rows whose value is None are left out."""
    lines = ["| | |", "|---|---|"]
    lines += [f"| {key} | {value} |" for key, value in rows if value is not None]
    return "\n".join(lines)


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


def _code(value) -> str | None:
    return f"`{value}`" if value else None


# ---------------------------------------------------------------------- the facts
@dataclass
class _Target:
    name: str | None  # as recorded (hub id or local path)
    hub_id: str | None  # the Hub id, when the name is one (or base_model was given)
    revision: str | None
    fingerprint: str | None
    details: dict
    license: dict = field(default_factory=dict)  # license (+ license_name, license_link) of the target's card


def card_values(
    artifact: Artifact,
    *,
    repo_id: str,
    fmt: str,
    report: dict | None,
    base_model: str | None,
    revision: str | None,
    license: str | None = None,
) -> dict:
    """Everything card.md.j2 reads, as plain values and table rows."""
    from huggingface_hub import ModelCardData

    folder, provenance, summary = _data(artifact)
    target = _target(artifact, provenance, base_model)
    target.license = {"license": license} if license else _target_license(target)
    k = serving_tokens(artifact, report)
    kind, c, p, r = artifact.kind, artifact.config, artifact.provenance, artifact.recipe
    model = not artifact.spec.model_types  # a draft: any transformers causal LM
    tags = ["draftsmith", "speculative-decoding"]
    tags += ["draft-model"] if model else [kind] + ([artifact.method] if artifact.method != kind else [])
    tags += list(FORMAT_TAGS.get(fmt, ()))
    results = _eval_results(artifact, report) if report is not None else []
    source = ((provenance.get("source") or {}).get("name")) or ""
    metadata = ModelCardData(
        base_model=target.hub_id,
        **target.license,  # the target's terms bind a model trained on its outputs
        datasets=[source] if _looks_like_hub_id(source) else None,  # the prompts' Hub dataset
        library_name="transformers" if model else "draftsmith",
        pipeline_tag="text-generation" if model else None,
        tags=tags,
        model_name=repo_id.split("/")[-1] if results else None,  # model-index needs a name
        eval_results=results or None,
    )
    local = repo_id.split("/")[-1]
    rev = f" --revision {revision}" if revision else ""
    target_arg = target.hub_id or target.name or "TARGET"
    return {
        "metadata": metadata.to_yaml(),
        "repo_id": repo_id,
        "revision": revision,
        "local": local,  # the folder `hf download` writes
        "download": f"hf download {repo_id}{rev} --local-dir {local}",
        "kind": kind,
        "method": artifact.method,
        "method_name": artifact.title,
        "fmt": fmt,
        "k": k,
        "report": report is not None,
        "target_label": target.hub_id or target.name or "its target",
        "target_arg": target_arg,
        "target_hub_id": target.hub_id,
        "target_revision": target.revision,
        "eval_flag": artifact.eval_flag,
        "train_command": artifact.train_command,
        "loader": artifact.spec.loader.split(":"),  # [module, function] of draftsmith's loader
        "medusa_heads": p.get("num_heads") or c.get("num_heads") or c.get("medusa_num_heads"),
        "share_lm_head": bool(p.get("share_lm_head")),
        "aux_layers": _fmt(
            p.get("aux_layer_ids") or c.get("eagle_aux_hidden_state_layer_ids") or c.get("aux_hidden_state_layer_ids")
        ),
        "draft_vocab": _fmt(c.get("draft_vocab_size") or p.get("draft_vocab_size")),
        "block_size": c.get("block_size"),
        "num_depths": c.get("num_depths") or p.get("num_depths"),
        "mask_token_id": c.get("mask_token_id"),
        "ttt_steps": r.get("ttt_steps"),
        "loss": r.get("loss"),
        "loss_temperature": _fmt(r.get("temperature"), 2),
        "has_adapter": artifact.adapter is not None,
        "has_recipe": bool(artifact.recipe),
        "has_run_info": bool(artifact.run_info),
        "target_rows": _target_rows(target),
        "data_rows": _data_rows(artifact, folder, provenance, summary),
        "training": _training(artifact) if artifact.recipe else None,
        "evaluation": _evaluation(report) if report is not None else None,
    }


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
    provenance = read_json(folder / "provenance.json", "data provenance")
    return folder, provenance, read_json(folder / "summary.json", "data summary")


def _target(artifact: Artifact, provenance: dict, base_model: str | None) -> _Target:
    recorded = provenance.get("target") or {}
    build = ((artifact.summary.get("draft") or {}).get("build")) or {}
    heads = artifact.provenance if artifact.spec.model_types else {}  # a draft's config is the model's own
    name = heads.get("target_name_or_path") or artifact.recipe.get("target") or recorded.get("name_or_path")
    name = name or build.get("target_name_or_path")
    revision = heads.get("target_revision") or recorded.get("revision")
    fingerprint = heads.get("target_fingerprint") or recorded.get("fingerprint") or build.get("target_fingerprint")
    if base_model is not None and not (
        isinstance(base_model, str) and base_model.count("/") == 1 and _looks_like_hub_id(base_model)
    ):
        raise HubError(
            f"base model {base_model!r}: expected the target's Hub id as ORG/NAME (the Hub rejects paths there)"
        )
    hub_id = base_model or (name if name and _looks_like_hub_id(str(name)) else None)
    return _Target(name, hub_id, revision, fingerprint, recorded)


def _target_rows(target: _Target) -> list[tuple[str, object]]:
    d = target.details
    link = f"[`{target.hub_id}`](https://huggingface.co/{target.hub_id})" if target.hub_id else None
    sizes = ("num_layers", "hidden_size", "vocab_size")
    shape = " / ".join(str(d[key]) for key in sizes) if set(sizes) <= set(d) else None
    return [
        ("name", link or _code(target.name) or "not recorded"),
        ("trained against", _code(target.name) if target.hub_id and target.name != target.hub_id else None),
        ("revision", _code(target.revision) or "not recorded (the files the run loaded)"),
        ("fingerprint", _code(target.fingerprint) or "not recorded"),
        ("license", _code(target.license.get("license")) or "not found (push with --license ID: the target's license)"),
        ("architecture", _fmt(d.get("architectures")) if d.get("architectures") else None),
        ("layers / hidden / vocabulary", shape),
        ("dtype", d.get("dtype")),
    ]


def _target_license(target: _Target) -> dict:
    """license, license_name, license_link from the target's own model card (README.md front
    matter): in its local folder, or in the Hugging Face cache for a Hub id. Never downloads."""
    from huggingface_hub import metadata_load, try_to_load_from_cache

    readme = Path(str(target.name)).expanduser() / "README.md" if target.name else None
    if (readme is None or not readme.is_file()) and target.hub_id:
        cached = try_to_load_from_cache(target.hub_id, "README.md", revision=target.revision)
        readme = Path(cached) if isinstance(cached, str) else None
    if readme is None or not readme.is_file():
        return {}
    try:
        meta = metadata_load(readme) or {}
    except (OSError, ValueError):  # a card without valid front matter: no license to carry
        return {}
    return {key: str(meta[key]) for key in ("license", "license_name", "license_link") if meta.get(key)}


def _drafter_rows(artifact: Artifact, report: dict) -> list[dict]:
    """The report's rows that decoded with this drafter (NAME, or NAME-chain / NAME-tree), not
    target-only, prompt lookup or other drafters."""
    names = evaluated_names(artifact, report.get("drafts") or {}) or [artifact.kind]
    return [r for r in report["methods"] if any(r["method"] == n or r["method"].startswith(f"{n}-") for n in names)]


def _eval_results(artifact: Artifact, report: dict) -> list:
    """model-index entries (huggingface_hub EvalResult): per decoding method of this drafter, tau
    (counting the bonus token), alpha and the speedup over target-only, on the eval's prompts."""
    from huggingface_hub import EvalResult

    s = report["settings"]
    prompts = Path(report["prompts_file"]).name if report.get("prompts_file") else "prompts"
    setting = f"K={s['num_draft_tokens']}, temperature={_fmt(s.get('temperature'), 2)}"
    metrics = (
        ("tau", "mean_accepted_length", "tau (tokens per target call, counts the bonus token)"),
        ("alpha", "acceptance_rate", "alpha (accepted share of drafted tokens)"),
        ("speedup", "speedup", "speedup over target-only decoding"),
    )
    results = []
    for row in _drafter_rows(artifact, report):
        for key, kind, name in metrics:
            if isinstance(row.get(key), (int, float)) and not isinstance(row.get(key), bool):
                results.append(
                    EvalResult(
                        task_type="text-generation",
                        task_name=f"speculative decoding ({row['method']})",
                        dataset_type="json",
                        dataset_name=prompts,
                        metric_type=kind,
                        metric_name=name,
                        metric_value=round(float(row[key]), 4),
                        metric_config=setting,
                    )
                )
    return results


def _data_rows(artifact: Artifact, folder: Path | None, provenance: dict, summary: dict) -> list[tuple[str, object]]:
    data_hash = _code(summary.get("data_hash") or artifact.provenance.get("data_hash"))
    if not provenance:
        where = f"`{folder}` was not found when this card was written" if folder else "no data folder is recorded"
        return [("data", where), ("data hash", data_hash), ("training rows", _code(artifact.summary.get("data")))]
    src, chat, settings = (provenance.get(key) or {} for key in ("source", "chat_template", "settings"))
    source = f"`{src.get('name')}` ({src.get('format')}, {src.get('records')} records)" if src else None
    template = f"{chat.get('spec')} ({'used' if chat.get('used') else 'not used'})" if chat else None
    sampled = ("temperature", "top_p", "top_k", "max_new_tokens", "num_samples", "seed")
    sampling = ", ".join(f"{k} {_fmt(settings[k], 2)}" for k in sampled if k in settings)
    tokens, trained = _fmt(summary.get("tokens")), _fmt(summary.get("trained_tokens"))
    made_by = "the target's own answers to the source's prompts (the loss covers the answer tokens)"
    return [
        ("made by", f"`draftsmith generate`: {made_by}"),
        ("source", source),
        ("chat template", template),
        ("sampling", sampling or None),
        ("samples", _fmt(summary.get("samples"))),
        ("tokens", f"{tokens} ({trained} trained, under the loss mask)"),
        ("cut at max_new_tokens", _fmt(summary["truncation_rate"], 3) if "truncation_rate" in summary else None),
        ("data hash", data_hash),
    ]


def _training(artifact: Artifact) -> dict:
    """The run's table, its hyperparameters and its held-out metrics (None when not recorded)."""
    r, s, info = artifact.recipe, artifact.summary, artifact.run_info
    if s.get("aux_layers"):
        r = {**r, "aux_layers": s["aux_layers"]}  # the layers the run chose (the recipe may leave them to it)
    versions = info.get("versions") or {}
    git = str(info.get("git_revision") or "?")[:12]
    trainer = f"`{artifact.train_command}` (draftsmith {versions.get('draftsmith', '?')}, git {git})"
    return {
        "run": [
            ("trainer", trainer),
            ("optimizer steps", _fmt(s.get("steps"))),
            ("device", f"{s.get('device')} x {s.get('processes')}" if s.get("device") else None),
        ],
        "hyperparameters": [(f"`{k}`", _param(r[k])) for k in _hyperparameters(artifact) if r.get(k) not in (None, "")],
        "heldout": _heldout_rows(artifact) if s.get("eval") else None,
    }


def _hyperparameters(artifact: Artifact) -> list[str]:
    """The method's own recipe keys as the run recorded them, then the training keys."""
    skip = set(_TRAINING_KEYS) | set(_NOT_HYPERPARAMETERS)
    return [k for k in artifact.recipe if k not in skip] + list(_TRAINING_KEYS)


def _heldout_rows(artifact: Artifact) -> list[tuple[str, object]]:
    """The held-out metrics the run recorded; a metric measured before training too (a draft
    model's) reads before -> after."""
    s = artifact.summary
    ev, init = s.get("eval") or {}, s.get("initial") or {}
    digits = {"kl_drift": 4, "positions": 0}

    def value(key: str) -> str:
        after = _fmt(ev[key], digits.get(key, 3))
        return f"{_fmt(init[key], digits.get(key, 3))} -> {after}" if key in init and key != "positions" else after

    rows = [(label, value(key)) for key, label in _HELDOUT.items() if key in ev]
    k = artifact.recipe.get("num_draft_tokens")
    rows = [(f"{label} at K = {k}" if label.startswith("simulated tau") and k else label, v) for label, v in rows]
    if s.get("vocab_coverage") is not None:
        rows.insert(-1, ("draft vocabulary coverage of trained tokens", _fmt(s["vocab_coverage"])))
    return rows


def _evaluation(report: dict) -> dict:
    """The decoding settings of a `draftsmith eval` report and its two tables."""
    from draftsmith.eval.report import position_table, summary_table

    s, t = report["settings"], report.get("target") or {}
    lossless = (
        "lossless: the output is distributed exactly as the target's"
        if report.get("lossless", True)
        else "rows marked LOSSY use typical acceptance, which changes the output; the others are lossless"
    )
    prompts = _fmt(report.get("num_prompts"))
    if report.get("prompts_file"):
        prompts += f" from `{Path(report['prompts_file']).name}`"
    version, top_p = report.get("draftsmith_version"), _fmt(s.get("top_p"), 2)
    settings = [
        ("mode", f"{report.get('mode', '?')} ({lossless})"),
        ("K (draft tokens per target call)", _fmt(s.get("num_draft_tokens"))),
        ("temperature / top-k / top-p", f"{_fmt(s.get('temperature'), 2)} / {_fmt(s.get('top_k'))} / {top_p}"),
        ("max new tokens", _fmt(s.get("max_new_tokens"))),
        ("prompts", prompts),
        ("timed passes", _fmt(s.get("repeats"))),
        ("target dtype / device", f"{t.get('dtype', '?')} / {t.get('device', '?')}" if t else None),
        ("draftsmith", f"{version} (git {str(report.get('git_revision') or '?')[:12]})" if version else None),
    ]
    return {
        "settings": settings,
        "summary": summary_table(report),
        "positions": position_table(report).replace("p||q", "p\\|\\|q"),  # a bare | would split the Markdown cell
    }
