"""What goes to the Hub, built in a temporary folder and renamed into place (`stage_run`).

- the weights, as safetensors only (an artifact holding pickle weights is refused), and their
  config.json, in the layout asked for (by default the one a server loads), written by the
  method's exporter (`Method.export` of draftsmith.heads.registry): a draft model goes as the
  plain HF model it is, with its tokenizer; a run that trained LoRA adapters on the target with
  its heads adds `adapter/`.
- recipe.yaml (the resolved recipe) and run_info.json, with anything token-like removed;
- README.md, the model card (card.py).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import yaml

from draftsmith.heads.artifacts import write_folder_atomic
from draftsmith.publish.artifacts import (
    Artifact,
    HubError,
    check_no_pickle,
    find_artifact,
    resolve_format,
    resolve_report,
    serving_tokens,
)
from draftsmith.publish.card import render_card
from draftsmith.publish.scrub import check_no_secret, scrub, scrub_text


def stage_run(
    run_dir,
    staging_dir,
    *,
    format=None,
    eval_report=None,
    repo_id=None,
    base_model=None,
    revision=None,
    license=None,
    _secrets=(),
) -> Path:
    """Write what would be pushed for `run_dir` into `staging_dir` (built aside, then renamed).

    `staging_dir` must not exist or be empty, or hold an earlier staging (replaced). `repo_id`
    (and `revision`, the branch) name the repository in the card's commands (`ORG/NAME` when
    not given). `base_model` is the target's Hub id when the run loaded it from a local folder;
    `license` the target's license when its model card is not on this machine."""
    artifact = find_artifact(run_dir)
    fmt = resolve_format(artifact, format)
    check_no_pickle(artifact.path)
    if artifact.adapter is not None:
        check_no_pickle(artifact.adapter)
    report = resolve_report(artifact, eval_report)
    k = serving_tokens(artifact, report)
    secrets = tuple(s for s in _secrets if s)
    repo_id = repo_id or "ORG/NAME"
    card = render_card(
        artifact, repo_id=repo_id, fmt=fmt, report=report, base_model=base_model, revision=revision, license=license
    )

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
                "# Paths are those of the machine it trained on. "
                f"Retrain: {artifact.train_command} --recipe recipe.yaml\n"
            )
            text = yaml.safe_dump(scrub(artifact.recipe, secrets), sort_keys=False, allow_unicode=True)
            (tmp / "recipe.yaml").write_text(header + text, encoding="utf-8")
        if artifact.run_info:
            info = json.dumps(scrub(artifact.run_info, secrets), indent=2)
            (tmp / "run_info.json").write_text(info + "\n", encoding="utf-8")
        (tmp / "README.md").write_text(scrub_text(card, secrets), encoding="utf-8")
        if not any(tmp.rglob("*.safetensors")):
            raise HubError(f"{str(artifact.path)!r}: no safetensors weights to push")
        check_no_pickle(tmp)
        check_no_secret(tmp, secrets)

    return write_folder_atomic(staging_dir, write, overwrite=False, may_replace=_is_staging, error=HubError)


def _is_staging(folder: Path) -> bool:
    """A folder an earlier `stage_run` wrote (replaced on a new dry run)."""
    readme = Path(folder) / "README.md"
    try:
        from huggingface_hub import ModelCard

        return readme.is_file() and "draftsmith" in (ModelCard(readme.read_text(encoding="utf-8")).data.tags or [])
    except (OSError, ValueError):
        return False


def _write_weights(artifact: Artifact, fmt: str, k: int, out: Path) -> None:
    """The weights and config.json in layout `fmt`, by the method's exporter (the registry's);
    `k` is the draft length written into server configs. The target is loaded only when the
    exporter asks for it (a server layout holding its lm_head, or a product with its embeddings)."""
    from draftsmith.heads.registry import RegistryError

    method = artifact.spec
    try:
        method.export(artifact.path, out, fmt, num_speculative_tokens=k, target=lambda: _load_target(artifact))
    except (RegistryError, method.part("error")) as err:
        hint = " (push with format 'hf' for the draftsmith layout)" if fmt != "hf" else ""
        raise HubError(f"{err}{hint}") from None


def _load_target(artifact: Artifact):
    """The target the run recorded, on the CPU in its own dtype: a few layouts hold a copy of its
    weights (the lm_head of heads that share it) or a product with them (a Markov bias over its embeddings)."""
    import torch

    from draftsmith.heads.models import ModelLoadError, load_causal_lm

    name = artifact.recipe.get("target") or artifact.provenance.get("target_name_or_path")
    if not name:
        raise HubError(
            f"{str(artifact.path)!r}: the {artifact.title} need the target's weights for this layout, and no target "
            "is recorded; push with format 'hf'"
        )
    try:
        return load_causal_lm(name, device=torch.device("cpu"), dtype="auto", role="target")  # as saved
    except ModelLoadError as err:
        raise HubError(
            f"the {artifact.title} need the target's weights for this layout: {err}; or push with format 'hf'"
        ) from None
