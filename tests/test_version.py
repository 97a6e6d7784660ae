"""The version is written once, in ``pyproject.toml``, and every place that shows it reads it
from there (through the installed package's metadata, :mod:`chronomq.version`)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from chronomq.cli import main
from chronomq.cluster.httpapi.metrics import Metrics
from chronomq.cluster.httpapi.openapi import spec
from chronomq.version import VERSION

ROOT = Path(__file__).resolve().parent.parent
TOP = ("raftlog", "schedule", "timer", "cluster", "ops", "chronomq")


def _pyproject_version() -> str:
    return str(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"])


def test_the_installed_version_is_pyproject_s() -> None:
    assert _pyproject_version() == VERSION, "reinstall (make install) after changing the version"


def test_the_command_line_the_openapi_document_and_the_metrics_show_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"chronomq {VERSION}"
    assert spec(False)["info"]["version"] == VERSION
    text = generate_latest(Metrics().registry).decode()
    assert f'chronomq_build_info{{version="{VERSION}"}} 1.0' in text


def test_the_changelog_s_newest_entry_is_this_version() -> None:
    entries = re.findall(r"^## \[([^\]]+)\]", (ROOT / "CHANGELOG.md").read_text(), re.M)
    assert entries and entries[0] == _pyproject_version()


def test_no_source_file_writes_the_version_itself() -> None:
    pattern = re.compile(rf"[\"']{re.escape(_pyproject_version())}[\"']")
    found = [
        str(path.relative_to(ROOT))
        for top in TOP
        for path in sorted((ROOT / top).rglob("*.py"))
        if not path.is_symlink() and pattern.search(path.read_text())
    ]
    assert found == []
