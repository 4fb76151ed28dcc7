"""The docs stay true to the code: docs/cli.md is the parsers' `--help` (regenerate it with
`python -m draftsmith.scripts.cli_reference --write`), every relative link of README.md and docs/
reaches a file (and a heading, when it names one), and the README stays short."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from draftsmith.scripts import cli_reference

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
README_MAX_LINES = 300  # what it is, two commands, one table, where next: the rest lives in docs/

FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*$", re.M)


def _prose(path: Path) -> str:
    """The page without its code blocks (a `[x](y)` in a code sample is not a link)."""
    return FENCE.sub("", path.read_text(encoding="utf-8"))


def _anchors(path: Path) -> set[str]:
    """The anchors GitHub gives the page's headings: lower case, punctuation dropped, spaces to
    dashes, a repeated heading numbered -1, -2, ..."""
    seen: dict[str, int] = {}
    out = set()
    for title in HEADING.findall(_prose(path)):
        slug = re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def _links(path: Path) -> list[str]:
    return [t for t in LINK.findall(_prose(path)) if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


def test_cli_reference_matches_the_parsers():
    diff = cli_reference.difference()
    assert not diff, f"docs/cli.md is stale: run `{cli_reference.REGENERATE}`\n{diff[:4000]}"


def test_cli_reference_check_names_the_difference(tmp_path, capsys):
    stale = tmp_path / "cli.md"
    stale.write_text(cli_reference.render().replace("--target", "--tagret", 1), encoding="utf-8")
    assert cli_reference.main(["--check", "--path", str(stale)]) == 1
    err = capsys.readouterr().err
    assert "-" in err and "--tagret" in err and "--write" in err
    assert cli_reference.main(["--write", "--path", str(stale)]) == 0
    assert cli_reference.main(["--check", "--path", str(stale)]) == 0


def test_the_reference_covers_every_command():
    text = cli_reference.render()
    for command in ("eval", "tune", "check-lossless", "demo", "generate", "export", "push", "train"):
        assert f"\n## draftsmith {command}\n" in text, command


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_reach_a_file_and_heading(page):
    broken = []
    for target in _links(page):
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        if not dest.exists():
            broken.append(f"{target} (no file {dest.relative_to(REPO) if dest.is_relative_to(REPO) else dest})")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target} (no heading #{anchor} in {dest.name})")
    assert not broken, f"{page.relative_to(REPO)}: broken links: {broken}"


def test_readme_is_short_and_points_at_the_docs():
    lines = (REPO / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; at most {README_MAX_LINES}"
    linked = {Path(t.partition("#")[0]).name for t in _links(REPO / "README.md")}
    missing = {p.name for p in PAGES[1:]} - linked
    assert not missing, f"README.md links no page {sorted(missing)}"
