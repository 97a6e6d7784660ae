"""Every key is a typed attribute of the node config; a renamed key's old name is still read,
with one warning naming the old and the new name, wherever keys are taken (config file,
environment, --set, test and drill settings, PATCH /v1/admin/config); an unknown key fails
naming it."""

from __future__ import annotations

import logging
import tomllib
from pathlib import Path

import pytest

from chronomq.cluster.config import doc as configdoc
from chronomq.cluster.config import nodeconfig as config
from chronomq.cluster.config.keys import KEY_BY_NAME, KEYS, RENAMED
from chronomq.cluster.config.nodeconfig import ConfigError, NodeConfig, load
from chronomq.cluster.node import runtimeconfig
from chronomq.cluster.node.errors import ApiError
from chronomq.cluster.process.launcher import LocalCluster, parse_sets

OLD, NEW = "max_message_size", "max_message_bytes"


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test sees the once-per-process warnings afresh."""
    monkeypatch.setattr(config, "_warned", set())


def renamed_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == config.__name__ and r.levelno == logging.WARNING
    ]


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


def test_old_names_are_renames_of_current_keys() -> None:
    assert RENAMED == {
        "max_message_size": "max_message_bytes",
        "idempotency_window": "idempotency_window_batches",
        "timer_max_delay_sec": "timer_max_delay_s",
    }
    for old, new in RENAMED.items():
        assert old not in KEY_BY_NAME and KEY_BY_NAME[new].formerly == old


@pytest.mark.parametrize(("old", "new"), sorted(RENAMED.items()))
def test_an_old_name_in_a_config_file_is_read_with_one_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, old: str, new: str
) -> None:
    value = KEY_BY_NAME[new].max
    path = tmp_path / "node.toml"
    path.write_text(f"{old} = {value}\n")
    caplog.set_level(logging.WARNING)
    cfg = load(path, environ={})
    assert getattr(cfg, new) == value
    assert cfg.values()[new] == value and old not in cfg.values()
    assert cfg.renamed_keys == (old,)
    load(path, environ={})  # once per key and process
    [warning] = renamed_warnings(caplog)
    assert old in warning and new in warning and f"CHRONOMQ_{new.upper()}" in warning


def test_an_old_environment_variable_is_read_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING)
    cfg = load(None, environ={"CHRONOMQ_TIMER_MAX_DELAY_SEC": "86400"})
    assert cfg.timer_max_delay_s == 86_400
    [warning] = renamed_warnings(caplog)
    assert "timer_max_delay_sec" in warning and "timer_max_delay_s " in warning
    # Both names in one place is a mistake, named.
    with pytest.raises(ConfigError) as err:
        load(
            None,
            environ={"CHRONOMQ_TIMER_MAX_DELAY_SEC": "1", "CHRONOMQ_TIMER_MAX_DELAY_S": "2"},
        )
    assert err.value.key == "timer_max_delay_s" and "timer_max_delay_sec" in err.value.problem


def test_an_old_name_in_overrides_and_a_bad_value_name_the_key() -> None:
    cfg = load(None, overrides={"idempotency_window": "500"}, environ={})
    assert cfg.idempotency_window_batches == 500
    with pytest.raises(ConfigError) as err:
        load(None, overrides={"idempotency_window": "5"}, environ={})
    assert err.value.key == "idempotency_window_batches" and ">= 100" in err.value.problem


def test_an_old_and_a_new_name_in_one_file_fail(tmp_path: Path) -> None:
    path = tmp_path / "node.toml"
    path.write_text(f"{OLD} = 1000\n{NEW} = 2000\n")
    with pytest.raises(ConfigError) as err:
        load(path, environ={})
    assert err.value.key == NEW and OLD in err.value.problem and "not both" in err.value.problem


def test_a_node_warns_once_its_logging_is_set_up(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    cfg = load(None, overrides={OLD: 2048}, environ={}, warn=False)
    assert cfg.max_message_bytes == 2048 and renamed_warnings(caplog) == []
    config.warn_renamed(cfg.renamed_keys)
    config.warn_renamed(cfg.renamed_keys)
    assert len(renamed_warnings(caplog)) == 1


def test_an_unknown_key_fails_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "node.toml"
    path.write_text("max_mesage_bytes = 10\n")
    with pytest.raises(ConfigError) as err:
        load(path, environ={})
    assert err.value.key == "max_mesage_bytes"
    assert str(err.value) == f"max_mesage_bytes: unknown key in {path}"
    with pytest.raises(ConfigError) as err:
        load(None, overrides={"max_message_sise": 10}, environ={})
    assert str(err.value) == "max_message_sise: unknown key"
    with pytest.raises(ConfigError) as err:
        LocalCluster(
            1, tmp_path / "c", http_port=18080, raft_port=19080, settings={"nope": 1}
        ).config_values(0)
    assert err.value.key == "nope"


def test_changes_take_an_old_name() -> None:
    cfg = load(None, environ={}).with_changes({OLD: 1234})
    assert cfg.max_message_bytes == 1234


def test_cluster_settings_write_the_new_name(tmp_path: Path) -> None:
    cluster = LocalCluster(
        1,
        tmp_path / "var",
        http_port=18080,
        raft_port=19080,
        settings=parse_sets([f"{OLD}=65536", "timer_max_delay_sec=3600"]),
    )
    cluster.write_configs()
    written = tomllib.loads((cluster.node_dir(0) / "node.toml").read_text())
    assert written[NEW] == 65536 and written["timer_max_delay_s"] == 3600
    assert OLD not in written and "timer_max_delay_sec" not in written


def test_patch_takes_an_old_name_as_its_key() -> None:
    with pytest.raises(ApiError) as err:
        runtimeconfig.validate({OLD: 1024})
    assert (err.value.status, err.value.code, err.value.field) == (409, "not_runtime", OLD)
    assert NEW in err.value.message
    with pytest.raises(ApiError) as err:
        runtimeconfig.validate({"log_levle": "debug"})
    assert (err.value.status, err.value.code, err.value.field) == (400, "unknown_key", "log_levle")


def test_the_reference_names_the_old_name() -> None:
    table = configdoc.reference()
    row = next(line for line in table.splitlines() if line.startswith(f"| `{NEW}` |"))
    assert f"Formerly `{OLD}` (`CHRONOMQ_{OLD.upper()}`)" in row
