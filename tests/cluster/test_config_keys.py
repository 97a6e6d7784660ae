"""Every key is a typed attribute of the node config, declared in the key table's order."""

from __future__ import annotations

import pytest

from chronomq.cluster import config
from chronomq.cluster.config import NodeConfig, load
from chronomq.cluster.configkeys import KEYS


def test_every_key_is_a_typed_attribute() -> None:
    assert "__getattr__" not in vars(NodeConfig)
    cfg = load(None, environ={})
    for key in KEYS:
        value = getattr(cfg, key.name)
        assert isinstance(value, tuple if key.name == "peers" else key.type), key.name
        declared = "tuple[Peer, ...]" if key.name == "peers" else key.type.__name__
        assert NodeConfig.__annotations__[key.name] == declared, key.name
    assert list(NodeConfig.__annotations__) == [k.name for k in KEYS]


def test_a_key_missing_from_the_attributes_stops_the_import(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    extra = KEYS[0].__class__("shiny_new_knob", int, 1, "Turns the shiny new knob.")
    monkeypatch.setattr(config, "KEYS", (*KEYS, extra))
    with pytest.raises(AssertionError, match="shiny_new_knob"):
        config._check_attributes()
