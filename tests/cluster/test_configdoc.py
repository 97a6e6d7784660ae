"""The docs' configuration reference is generated from the key definitions and current."""

from __future__ import annotations

from pathlib import Path

import pytest

from chronomq.cluster.config import doc as configdoc
from chronomq.cluster.config import keys as configkeys

PAGE = Path(__file__).resolve().parents[2] / configdoc.PAGE


def test_the_docs_reference_is_current() -> None:
    text = PAGE.read_text()
    assert configdoc.splice(text) == text, (
        f"{configdoc.PAGE}'s configuration reference is stale: run "
        f"`chronomq config reference --write {configdoc.PAGE}`"
    )


def test_every_key_is_documented_and_listed() -> None:
    assert configdoc.undocumented() == []
    table = configdoc.reference()
    for key in configkeys.KEYS:
        assert f"| `{key.name}` |" in table


def test_a_new_key_without_documentation_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    extra = configkeys.Key("shiny_new_knob", int, 1, "")
    monkeypatch.setattr(configdoc, "KEYS", (*configkeys.KEYS, extra))
    assert configdoc.undocumented() == ["shiny_new_knob"]
    assert configdoc.main() == 1
    documented = configkeys.Key("shiny_new_knob", int, 1, "Turns the shiny new knob.")
    monkeypatch.setattr(configdoc, "KEYS", (*configkeys.KEYS, documented))
    assert configdoc.main("check", str(PAGE)) == 1  # documented, but not in the docs yet
