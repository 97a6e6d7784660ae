"""The docs' HTTP API reference is generated from the routes and current."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from chronomq.cluster.cli.commands import main
from chronomq.cluster.httpapi import apidoc, openapi

PAGE = Path(__file__).resolve().parents[2] / apidoc.PAGE


def test_the_docs_reference_is_current() -> None:
    text = PAGE.read_text()
    assert apidoc.splice(text) == text, (
        f"{apidoc.PAGE}'s HTTP API reference is stale: run "
        f"`chronomq api reference --write {apidoc.PAGE}`"
    )


def test_every_route_is_listed_once() -> None:
    table = apidoc.reference()
    for method, path in openapi.ROUTES:
        assert table.count(f"| `{method}` | `{path}` |") == 1, (method, path)
    assert apidoc.undocumented() == []


def test_shapes_mark_optional_request_fields_and_list_answers() -> None:
    request = {
        "type": "object",
        "required": ["topic"],
        "properties": {
            "topic": {"type": "string"},
            "mode": {"type": "string", "enum": ["sync", "async"]},
            "items": {"type": "array", "items": {"type": "object", "properties": {"a": {}}}},
        },
    }
    assert apidoc._shape(request, optional_marks=True) == (
        "{topic, mode?: sync/async, items?: [{a?}]}"
    )
    assert apidoc._shape(request, optional_marks=False) == "{topic, mode: sync/async, items: [{a}]}"
    assert apidoc._shape({"type": "object"}, optional_marks=False) == "object"
    assert apidoc._shape({"type": "string", "format": "binary"}, optional_marks=False) == "bytes"
    assert apidoc._shape(None, optional_marks=True) == ""


def test_a_changed_route_makes_the_check_fail(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    copy = tmp_path / "http.md"
    copy.write_text(PAGE.read_text())
    assert main(["api", "reference", "--check", str(copy)]) == 0
    routes: dict[tuple[str, str], Any] = dict(openapi.ROUTES)
    routes[("GET", "/v1/shiny")] = ("Shows shiny things.", None, {"type": "object"}, [])
    monkeypatch.setattr(apidoc, "ROUTES", routes)
    assert main(["api", "reference", "--check", str(copy)]) == 1
    assert main(["api", "reference", "--write", str(copy)]) == 0
    assert "`/v1/shiny`" in copy.read_text()
    assert main(["api", "reference", "--check", str(copy)]) == 0


def test_a_file_without_markers_is_refused(tmp_path: Path) -> None:
    bare = tmp_path / "notes.md"
    bare.write_text("# notes\n")
    assert main(["api", "reference", "--check", str(bare)]) == 1
