"""What a finished run becomes outside draftsmith: the layout a server loads, or a Hub repository.

    export_heads("runs/medusa/heads", "served/medusa", "vllm", target="runs/toy/target")
    push_run("runs/medusa", "org/my-medusa", dry_run_out="staged")      # write what would be pushed
    push_run("runs/medusa", "org/my-medusa", private=True)             # token: HF_TOKEN or `hf auth login`

Bad input raises ReleaseError or HubError (a run that cannot be staged), MedusaError or EagleError
(heads that cannot be loaded or written), each naming the folder, flag or value.
"""

from __future__ import annotations

import json
from pathlib import Path


class ReleaseError(ValueError):
    """A folder or format that cannot be exported; the message says which and what was expected."""


def heads_kind(folder) -> str:
    """medusa or eagle, read as `draftsmith push` reads it (any layout draftsmith writes)."""
    from draftsmith.publish import artifact_kind

    config = Path(folder) / "config.json"
    if not config.is_file():
        raise ReleaseError(f"{str(folder)!r} has no config.json: not a folder of trained heads")
    kind = artifact_kind(json.loads(config.read_text(encoding="utf-8")), where=str(config))
    if kind == "draft":
        raise ReleaseError(
            f"{str(folder)!r} holds a draft model, not heads: export takes Medusa or EAGLE heads "
            "(a draft model is served as it is)"
        )
    return kind


def export_heads(
    heads,
    out,
    format: str,
    *,
    target=None,
    num_speculative_tokens: int = 3,
    overwrite: bool = False,
    device: str = "cpu",
    dtype: str = "auto",
) -> Path:
    """Write trained heads in `format` (Medusa: medusa, vllm; EAGLE: vllm, sglang, hf) to `out`.
    `target` is needed for Medusa heads that share its lm_head (the formats hold a copy);
    `dtype` "auto" keeps the weights as trained."""
    import torch

    from draftsmith.heads.models import load_causal_lm, parse_dtype, resolve_device
    from draftsmith.publish.serve import serving_commands

    device = resolve_device(device)
    dtype = None if dtype == "auto" else parse_dtype(dtype)
    if _is_dflash(heads):
        return _export_dflash(heads, out, format, target, overwrite=overwrite, device=device, dtype=dtype)
    if heads_kind(heads) == "eagle":
        from draftsmith.heads.eagle import EXPORT_FORMATS, export_eagle, load_eagle

        if format not in EXPORT_FORMATS:
            raise ReleaseError(f"--format {format!r}: EAGLE heads export to {', '.join(EXPORT_FORMATS)}")
        head = load_eagle(heads, device=device, dtype=dtype)
        written = export_eagle(head, out, format, num_speculative_tokens=num_speculative_tokens, overwrite=overwrite)
        c = head.config
        kind = "P-EAGLE" if getattr(c, "mask_token_id", None) is not None else c.version
        print(
            f"wrote {format} {kind} head (aux layers {list(c.aux_layer_ids)}, "
            f"draft vocabulary {c.draft_vocab_size}) to {written}"
        )
        print(serving_commands(written).text())
        return written
    from draftsmith.heads.medusa import EXPORT_FORMATS, export_medusa, load_medusa

    if format not in EXPORT_FORMATS:
        raise ReleaseError(f"--format {format!r}: Medusa heads export to {', '.join(EXPORT_FORMATS)}")
    target = load_causal_lm(target, device=device, dtype=dtype or torch.float32, role="target") if target else None
    medusa = load_medusa(heads, target=target, device=device, dtype=dtype)
    written = export_medusa(medusa, out, format, overwrite=overwrite)
    c = medusa.config
    print(f"wrote {format} Medusa heads ({c.num_heads} heads x {c.num_layers} blocks) to {written}")
    print(serving_commands(written).text())
    return written


def _is_dflash(folder) -> bool:
    from draftsmith.heads.artifacts import has_model_type
    from draftsmith.heads.dflash import DFlashConfig

    return has_model_type(Path(folder), DFlashConfig.model_type)


def _export_dflash(heads, out, format: str, target, *, overwrite: bool, device, dtype) -> Path:
    """A DFlash head in the speculators `dflash` layout; it loads with its target (the embeddings
    are the target's), which also checks that they belong together."""
    import torch

    from draftsmith.heads.dflash_formats import export_dflash, load_dflash
    from draftsmith.heads.models import load_causal_lm

    if format != "vllm":
        raise ReleaseError(f"--format {format!r}: DFlash heads export to vllm (the speculators dflash layout)")
    if not target:
        raise ReleaseError(
            "--target is needed for a DFlash head: it loads with its target (the embeddings are not saved)"
        )
    model = load_causal_lm(target, device=device, dtype=dtype or torch.float32, role="target")
    head = load_dflash(heads, target=model, device=device, dtype=dtype)
    written = export_dflash(head, out, overwrite=overwrite)
    c = head.config
    print(
        f"wrote vllm DFlash head (block {c.block_size}, aux layers {list(c.aux_layer_ids)}, mask token {c.mask_token_id}) to {written}"
    )
    return written


def push_run(
    run, repo_id: str, *, dry_run_out=None, private: bool = False, endpoint=None, commit_message=None, **options
) -> str:
    """Stage the run (weights as safetensors, config, card, recipe, run info) and upload it, or with
    `dry_run_out` only write what would be pushed there. `options`: format, eval_report,
    base_model, revision (see `stage_run`). The token comes from HF_TOKEN or `hf auth login` and
    is never printed. Returns the repository URL, or the staging folder of a dry run."""
    from draftsmith.publish import check_repo_id, find_eval_report, local_eval_command, push, stage_run

    check_repo_id(repo_id)
    if dry_run_out is not None:
        out = stage_run(run, dry_run_out, repo_id=repo_id, **options)
        files = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
        print(f"staged {len(files)} files for {repo_id} in {out}/ (nothing pushed): {', '.join(files)}")
        where = str(out)
    else:
        where = push(run, repo_id, private=private, endpoint=endpoint, commit_message=commit_message, **options)
        print(f"pushed {run} to {where}")
    if options.get("eval_report") is None and find_eval_report(run) is None:
        print(f"not evaluated (the card says so); measure it, then push again:\n  {local_eval_command(run)}")
    return where
