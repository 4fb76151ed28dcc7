"""docs/cli.md, the command-line reference, generated from the argparse parsers of `draftsmith`.

    python -m draftsmith.scripts.cli_reference --write     # regenerate docs/cli.md after changing a flag
    python -m draftsmith.scripts.cli_reference --check     # exit 1, naming the difference, when it is stale

Every command and sub-command gets its `--help` text, formatted at a fixed width (COLUMNS=100)
so the file is the same on every terminal. tests/test_docs.py runs the check.
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
from collections.abc import Iterator
from pathlib import Path

from draftsmith.scripts.cli import build_parser

WIDTH = "100"  # the help width: fixed, or the file would follow the terminal that wrote it
CLI_MD = Path(__file__).resolve().parents[1] / "docs" / "cli.md"  # in a checkout: docs/ beside scripts/
REGENERATE = "python -m draftsmith.scripts.cli_reference --write"


def _subcommands(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    """The parser, then every sub-command's parser, depth first, in the order `--help` lists them."""
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            seen = set()
            for sub in action.choices.values():
                if id(sub) not in seen:  # an alias maps a second name to the same parser
                    seen.add(id(sub))
                    yield from _subcommands(sub)


def _anchor(prog: str) -> str:
    """GitHub's anchor of a `## prog` heading: lower case, spaces to dashes."""
    return prog.lower().replace(" ", "-")


def render() -> str:
    """The Markdown of docs/cli.md."""
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = WIDTH  # HelpFormatter reads it through shutil.get_terminal_size
    try:
        parsers = list(_subcommands(build_parser()))
        helps = [(p.prog, p.format_help().rstrip()) for p in parsers]
    finally:
        if old is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = old
    lines = [
        "# Command-line reference",
        "",
        f"Generated from the argparse parsers by `{REGENERATE}`; do not edit by hand.",
        "`tests/test_docs.py` fails when a flag changes and this file is not regenerated.",
        "How the commands fit together: [the docs index](index.md).",
        "",
    ]
    lines += [f"- [`{prog}`](#{_anchor(prog)})" for prog, _ in helps]
    for prog, text in helps:
        lines += ["", f"## {prog}", "", "```text", text, "```"]
    return "\n".join(lines) + "\n"


def difference(path: Path = CLI_MD) -> str:
    """A unified diff of `path` against the generated text; empty when they agree."""
    want = render()
    have = path.read_text(encoding="utf-8") if path.is_file() else ""
    diff = difflib.unified_diff(
        have.splitlines(keepends=True), want.splitlines(keepends=True), f"{path} (on disk)", f"{path} (generated)"
    )
    return "".join(diff)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m draftsmith.scripts.cli_reference", description=__doc__.split("\n\n")[0]
    )
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true", help="write the reference")
    mode.add_argument("--check", action="store_true", help="exit 1 when the reference on disk differs")
    parser.add_argument("--path", type=Path, default=CLI_MD, help=f"the file (default: {CLI_MD.name} in docs/)")
    args = parser.parse_args(argv)
    if args.write:
        args.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.path.with_name(args.path.name + ".tmp")
        tmp.write_text(render(), encoding="utf-8")
        tmp.replace(args.path)  # never a half-written reference
        print(f"wrote {args.path}")
        return 0
    diff = difference(args.path)
    if diff:
        print(f"{args.path} differs from the parsers' --help (rerun `{REGENERATE}`):", file=sys.stderr)
        print(diff, end="", file=sys.stderr)
        return 1
    print(f"{args.path} matches the parsers' --help")
    return 0


if __name__ == "__main__":
    sys.exit(main())
