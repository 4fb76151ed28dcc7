"""The publishing commands of `draftsmith`: a trained drafter, out of the run folder.

    draftsmith export HEADS_DIR --format FORMAT --out DIR     # the formats of its method (heads.registry)
    draftsmith push RUN_DIR --repo-id ORG/NAME [--private] [--format ...] [--dry-run --out DIR]

The work is `draftsmith.publish.release`.
"""

from __future__ import annotations

from draftsmith.scripts._args import UsageError, add_count


def _layouts() -> str:
    """Each method's layouts, from the registry (the default, what a server loads, first)."""
    from draftsmith.heads.registry import METHODS

    return "; ".join(f"{m.title}: {', '.join(m.export_formats)}" for m in METHODS.values())


#: The push flags that take one string and reach `push_run` under their own names (--eval-report is
#: eval_report): name -> help.
_PUSH_STRINGS = {
    "eval_report": "a `draftsmith eval` report.json for the card (default: RUN/eval/report.json or RUN/report.json)",
    "revision": "branch to push to, created from main when missing (default: main)",
    "endpoint": "Hub URL (default: $HF_ENDPOINT, else https://huggingface.co)",
    "base_model": "the target's Hub id (ORG/NAME) when the run loaded it from a local folder",
    "license": "the target's license as a Hub license id (default: read from the target's model card when it is on this machine)",
    "commit_message": "message of the Hub commit (default: the method and its steps)",
}


def add_commands(sub) -> None:
    layouts = _layouts()
    ex = sub.add_parser("export", help=f"write a trained drafter in the layout a server loads ({layouts})")
    ex.add_argument("heads", help="a drafter folder (OUT/heads, OUT/head or OUT/draft of a run), in any of its layouts")
    ex.add_argument(
        "--format",
        required=True,
        help=f"the layout: {layouts} (hf = the draftsmith layout; the others a server's or toolkit's, "
        "described in the method's module in heads/)",
    )
    ex.add_argument("--out", required=True, help="folder to write (must not exist or be empty, unless --overwrite)")
    ex.add_argument(
        "--target",
        help="the target, loaded only when the layout needs its weights (heads that share its lm_head); "
        "a head that loads with its target is checked against it",
    )
    add_count(ex, "--num-speculative-tokens", help="K written into the server config (default: the method's)")
    ex.add_argument("--overwrite", action="store_true")
    ex.add_argument("--device", default="cpu", help="device the target is loaded on (export runs fine on cpu)")
    ex.add_argument("--dtype", default="auto", help="dtype the target is loaded in (auto: as saved)")
    ex.set_defaults(func=cmd_export)

    pu = sub.add_parser("push", help="upload a trained drafter to the Hugging Face Hub with a generated model card")
    pu.add_argument("run", help="a run folder (the out of `draftsmith train KIND`) or a drafter folder")
    pu.add_argument(
        "--repo-id", required=True, help="NAME or ORG/NAME of the Hub model repository (created when missing)"
    )
    pu.add_argument(
        "--private", action="store_true", help="create the repository private (refused for an existing public one)"
    )
    pu.add_argument(
        "--format",
        help=f"pushed layout, the first the default: {layouts} (a head without that layout is refused, saying which it takes)",
    )
    for name, text in _PUSH_STRINGS.items():
        pu.add_argument("--" + name.replace("_", "-"), help=text)
    pu.add_argument("--dry-run", action="store_true", help="write what would be pushed to --out and push nothing")
    pu.add_argument(
        "--out", help="with --dry-run: the folder to write (must not exist or be empty, or hold an earlier dry run)"
    )
    pu.set_defaults(func=cmd_push)


def cmd_export(args) -> int:
    from draftsmith.publish import HubError
    from draftsmith.publish.release import ReleaseError, export_heads

    try:
        export_heads(
            args.heads,
            args.out,
            args.format,
            target=args.target,
            num_speculative_tokens=args.num_speculative_tokens,
            overwrite=args.overwrite,
            device=args.device,
            dtype=args.dtype,
        )
    except (ReleaseError, HubError) as err:
        raise UsageError(str(err)) from None
    return 0


def cmd_push(args) -> int:
    from draftsmith.publish import HubError
    from draftsmith.publish.release import push_run

    if args.dry_run and not args.out:
        raise UsageError("--dry-run writes what would be pushed to --out DIR: give --out")
    if args.out and not args.dry_run:
        raise UsageError("--out applies to --dry-run (a push stages in a temporary folder): add --dry-run")
    strings = {name: getattr(args, name) for name in _PUSH_STRINGS}
    try:
        push_run(args.run, args.repo_id, dry_run_out=args.out, private=args.private, format=args.format, **strings)
    except HubError as err:
        raise UsageError(str(err)) from None
    return 0
