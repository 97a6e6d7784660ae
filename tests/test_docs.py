"""The README stays a door into the docs site, and what the site builder cannot check holds.

``mkdocs build --strict`` (``make docs``) fails on a broken link or anchor inside ``docs/``;
the files at the top of the repository (README.md, CONTRIBUTING.md, CHANGELOG.md) are not
part of the site, so their links are checked here. The command-line reference is written by
hand: every command must be in it.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from chronomq.cli import build_parser
from tests.cluster.test_cli_help import commands

ROOT = Path(__file__).resolve().parent.parent
README_MAX_LINES = 250
TOP_FILES = ("README.md", "CONTRIBUTING.md", "CHANGELOG.md")
_LINK = re.compile(r"\]\((?P<target>[^)\s]+)\)")


def local_links(text: str) -> list[str]:
    """The link targets of a Markdown text that point into the repository."""
    return [
        m["target"]
        for m in _LINK.finditer(text)
        if not re.match(r"[a-z]+:", m["target"]) and not m["target"].startswith("#")
    ]


def test_the_readme_is_short() -> None:
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines: keep it a door (what it is, the promises, how to start, "
        f"an example, links) and put the rest under docs/"
    )


@pytest.mark.parametrize("name", TOP_FILES)
def test_links_of_the_top_files_resolve(name: str) -> None:
    text = (ROOT / name).read_text()
    missing = []
    for target in local_links(text):
        path, _, anchor = target.partition("#")
        if not (ROOT / path).exists():
            missing.append(target)
        elif anchor and path.endswith(".md"):
            headings = re.findall(r"^#+ (.+)$", (ROOT / path).read_text(), re.M)
            if anchor not in {slug(h) for h in headings}:
                missing.append(target)
    assert missing == [], f"{name} links to what does not exist: {missing}"


def slug(heading: str) -> str:
    """The anchor mkdocs gives a heading (its default toc slugify)."""
    text = re.sub(r"[^\w\s-]", "", heading.strip().lower())
    return re.sub(r"[-\s]+", "-", text)


def test_slugs_match_the_site_builders() -> None:
    assert slug("How the replicated log stays identical and recovers") == (
        "how-the-replicated-log-stays-identical-and-recovers"
    )
    assert slug("Raft as the code configures it") == "raft-as-the-code-configures-it"


def test_every_command_is_in_the_cli_reference() -> None:
    page = (ROOT / "docs" / "reference" / "cli.md").read_text()
    listed = set(re.findall(r"^\| `chronomq ([a-z ]+?)` \|", page, re.M))
    leaves = {
        " ".join(path)
        for path, parser, _summary in commands(build_parser())
        if path and not any(a.__class__.__name__ == "_SubParsersAction" for a in parser._actions)
    }
    # `config` and `api` have one subcommand, `reference`, given as a positional choice.
    leaves = {f"{c} reference" if c in ("config", "api") else c for c in leaves}
    assert leaves - listed == set(), f"docs/reference/cli.md lacks {sorted(leaves - listed)}"
    assert listed - leaves == set(), f"docs/reference/cli.md lists {sorted(listed - leaves)}"
