"""What a finished run becomes outside draftsmith: the layout a server loads, or a Hub repository.

    export_heads("runs/my-run/heads", "served/my-run", "vllm", target="runs/toy/target")
    push_run("runs/my-run", "org/my-drafter", dry_run_out="staged")      # write what would be pushed
    push_run("runs/my-run", "org/my-drafter", private=True)             # token: HF_TOKEN or `hf auth login`

Bad input raises ReleaseError (a folder, format or target that cannot be exported) or HubError (a
run that cannot be staged), each naming the folder, flag or value.
"""

from __future__ import annotations

from pathlib import Path


class ReleaseError(ValueError):
    """A folder or format that cannot be exported; the message says which and what was expected."""


def export_heads(
    heads,
    out,
    format: str,
    *,
    target=None,
    num_speculative_tokens: int | None = None,
    overwrite: bool = False,
    device: str = "cpu",
    dtype: str = "auto",
) -> Path:
    """Write the drafter folder `heads` (any layout of any method) to `out` in `format`, by its
    method's exporter (draftsmith.heads.registry: the formats are its `export_formats`; "hf" is
    the draftsmith layout). `target` (a folder or Hub id) is loaded, on `device` in `dtype`
    ("auto": as saved), only when the exporter asks for it: heads sharing its lm_head
    write a copy per head; others are checked against it. K defaults to the folder's
    (`default_tokens`)."""
    from draftsmith.heads.artifacts import write_folder_atomic
    from draftsmith.heads.models import ModelLoadError
    from draftsmith.heads.registry import RegistryError, method_of_folder
    from draftsmith.publish.artifacts import default_tokens, read_json
    from draftsmith.publish.serve import serving_commands

    if not (Path(heads) / "config.json").is_file():
        raise ReleaseError(f"{str(heads)!r} has no config.json: not a folder of a trained drafter")
    method = method_of_folder(heads)
    if method is None:
        raise ReleaseError(f"{str(Path(heads) / 'config.json')!r}: not the config of a drafter draftsmith writes")

    def load_target():
        from draftsmith.heads.models import load_causal_lm, parse_dtype, resolve_device

        return load_causal_lm(
            target,
            device=resolve_device(device),
            dtype="auto" if dtype == "auto" else parse_dtype(dtype),
            role="target",
        )

    # K: the one asked for, else what the folder says (a head's trained depths or block) or the method's
    k = num_speculative_tokens or default_tokens(method.kind, read_json(Path(heads) / "config.json", "drafter config"))

    def write(tmp: Path) -> None:
        method.export(heads, tmp, format, num_speculative_tokens=k, target=load_target if target else None)

    try:
        written = write_folder_atomic(out, write, overwrite=overwrite, error=ReleaseError)
    except (RegistryError, ModelLoadError, method.part("error")) as err:
        raise ReleaseError(str(err)) from None
    print(f"wrote the {method.title} of {heads} in the {format} layout to {written}")
    print(serving_commands(written).text())
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
