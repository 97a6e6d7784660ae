"""The runtime config core: how each runtime key is replicated, read back, overlaid and checked;
and the driver that keeps a node's config equal to the cluster's (fake broker, real loop)."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace
from typing import Any

import pytest

from chronomq.cluster.config.keys import KEY_BY_NAME, KEYS
from chronomq.cluster.config.nodeconfig import NodeConfig, load
from chronomq.cluster.node import runtimeconfig as rc
from chronomq.cluster.node.broker import MEMBER_PREFIX
from chronomq.cluster.node.errors import ApiError
from chronomq.cluster.node.offsets import GROUP_OFFSET_PREFIX, group_offset_key
from chronomq.schedule.state import MODE_KEY
from chronomq.timer.state import STOP_DEQUEUE, STOP_ENQUEUE

GOOD = {
    "log_level": "error",
    "ops_log_enabled": False,
    "ops_log_sample_rate": 0.25,
    "enable_schedule_async_deliver": True,
    "timer_stop_enqueue": True,
    "timer_stop_dequeue": False,
}


def file_config(**values: Any) -> NodeConfig:
    return load(None, overrides=values, environ={})


def test_every_runtime_key_says_how_it_is_replicated() -> None:
    assert set(rc.REPLICATED) == {k.name for k in KEYS if k.runtime} == set(GOOD)
    kv_keys = [r.kv_key for r in rc.REPLICATED.values()]
    assert len(set(kv_keys)) == len(kv_keys)


def test_plan_puts_plain_keys_and_the_mode_in_one_kv_update_and_switches_in_the_timers() -> None:
    todo = rc.plan(GOOD)
    assert todo.kv == {
        "cfg/log_level": "error",
        "cfg/ops_log_enabled": 0,
        "cfg/ops_log_sample_rate": "0.25",
        MODE_KEY: "async",
    }
    assert todo.timer == {"stop_enqueue": True, "stop_dequeue": False}
    # What apply stores: ints and short strings.
    assert all(type(v) is int or (type(v) is str and len(v) < 100) for v in todo.kv.values())
    assert rc.plan({"enable_schedule_async_deliver": False}).kv == {MODE_KEY: "sync"}


def test_values_round_trip_through_kv() -> None:
    for name, value in GOOD.items():
        r = rc.REPLICATED[name]
        kv = {r.kv_key: r.encode(value)}
        assert rc.read_overrides(kv) == rc.Overrides({name: value}), name
    # The timer's own apply writes 1/0 (timer.state); the schedule's "async"/"sync".
    kv = {STOP_ENQUEUE: 1, STOP_DEQUEUE: 0, MODE_KEY: "sync"}
    assert rc.read_overrides(kv).values == {
        "timer_stop_enqueue": True,
        "timer_stop_dequeue": False,
        "enable_schedule_async_deliver": False,
    }
    assert rc.read_overrides({}).values == {}


@pytest.mark.parametrize(
    ("kv_key", "raw"),
    [
        ("cfg/log_level", "loud"),
        ("cfg/log_level", 3),
        ("cfg/ops_log_enabled", 2),
        ("cfg/ops_log_enabled", "1"),
        ("cfg/ops_log_sample_rate", "nan"),
        ("cfg/ops_log_sample_rate", "1.5"),
        ("cfg/ops_log_sample_rate", "half"),
        ("cfg/ops_log_sample_rate", 1),
        (MODE_KEY, "fast"),
        (STOP_DEQUEUE, 7),
    ],
)
def test_an_entry_holding_no_value_of_its_key_is_ignored_and_reported(
    kv_key: str, raw: object
) -> None:
    good = (MODE_KEY, "async") if kv_key == "cfg/log_level" else ("cfg/log_level", "warning")
    found = rc.read_overrides({kv_key: raw, good[0]: good[1]})
    assert len(found.problems) == 1 and kv_key in found.problems[0]
    assert len(found.values) == 1  # the good entry still counts


def test_effective_config_is_the_file_overlaid_with_the_cluster() -> None:
    base = file_config(log_level="debug", timer_stop_dequeue=True, max_wait_ms=1234)
    assert rc.effective(base, {}) is base
    eff = rc.effective(base, {"log_level": "error", "timer_stop_dequeue": False})
    assert (eff.log_level, eff.timer_stop_dequeue, eff.max_wait_ms) == ("error", False, 1234)
    assert rc.differences(base, eff) == [
        ("log_level", "debug", "error"),
        ("timer_stop_dequeue", True, False),
    ]
    assert rc.differences(eff, eff) == []


def _refused(body: object) -> ApiError:
    with pytest.raises(ApiError) as info:
        rc.validate(body)
    return info.value


def test_validate_names_the_key_unknown_then_static_then_values() -> None:
    assert rc.validate(dict(GOOD)) == GOOD
    assert rc.validate({"ops_log_sample_rate": 1}) == {"ops_log_sample_rate": 1.0}
    for body in ({}, [], "x", None, 3):
        err = _refused(body)
        assert (err.status, err.field) == (400, "body")
    err = _refused({"log_level": "loud", "no_such": 1})
    assert (err.status, err.code, err.field) == (400, "unknown_key", "no_such")
    err = _refused({"log_level": "loud", "flush": "sync"})
    assert (err.status, err.code, err.field) == (409, "not_runtime", "flush")
    for name, bad in (
        ("log_level", "loud"),
        ("log_level", None),
        ("ops_log_enabled", 1),
        ("ops_log_sample_rate", 2.0),
        ("ops_log_sample_rate", True),
        ("enable_schedule_async_deliver", "yes"),
        ("timer_stop_dequeue", None),
    ):
        err = _refused({"log_level": "info", name: bad})
        assert (err.status, err.code, err.field) == (400, "invalid_config", name), (name, bad)


def test_no_client_kv_path_writes_runtime_entries() -> None:
    """Clients write kv only as group offsets (``go/``) and members (``member/``)."""
    for prefix in (GROUP_OFFSET_PREFIX, MEMBER_PREFIX):
        for r in rc.REPLICATED.values():
            assert not r.kv_key.startswith(prefix) and not prefix.startswith(r.kv_key)
    assert group_offset_key("cfg", "cfg/log_level", 0).startswith(GROUP_OFFSET_PREFIX)


def test_patch_schema_follows_the_keys() -> None:
    schema = rc.patch_schema()
    assert set(schema["properties"]) == set(GOOD)
    level = schema["properties"]["log_level"]
    assert level["enum"] == list(KEY_BY_NAME["log_level"].choices or ())
    assert schema["properties"]["ops_log_sample_rate"]["maximum"] == 1.0


# ---------------------------------------------------------------------- the driver


class FakeNode:
    """What :class:`RuntimeConfig` uses of a broker: its config, the store's kv, listeners."""

    def __init__(self, config: NodeConfig) -> None:
        self.listeners: list[Any] = []
        store = SimpleNamespace(kv={})
        self.raftlog = SimpleNamespace(store=store, add_apply_listener=self.listeners.append)
        self.config = config

    @property
    def kv(self) -> dict[str, Any]:
        kv: dict[str, Any] = self.raftlog.store.kv
        return kv

    def apply(self) -> None:
        for listener in self.listeners:
            listener(None)


class Recorder(logging.Handler):
    def __init__(self, events: list[tuple[str, str]]) -> None:
        super().__init__(logging.INFO)
        self.events = events

    def emit(self, record: logging.LogRecord) -> None:
        self.events.append(("log", record.getMessage()))


def test_driver_applies_changes_at_start_and_on_apply_in_order() -> None:
    events: list[tuple[str, str]] = []
    node = FakeNode(file_config(log_level="info"))
    file_cfg = node.config
    node.kv["cfg/log_level"] = "error"  # set before this node started: taken at start
    hooks = [lambda changes: events.append(("hook", repr(changes)))]
    driver = rc.RuntimeConfig(node, hooks, lambda level: events.append(("level", level)))  # type: ignore[arg-type]
    handler = Recorder(events)
    logger = logging.getLogger(rc.__name__)
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)

    async def go() -> None:
        loop = asyncio.get_running_loop()
        await driver.start()
        # Lowered: the line first, then the level.
        assert events == [
            ("log", "config changed cluster-wide: log_level info → error"),
            ("level", "error"),
            ("hook", "{'log_level': 'error'}"),
        ]
        assert node.config.log_level == "error" and driver.file_config is file_cfg
        events.clear()
        # An apply that changes nothing hands nothing to the loop.
        await loop.run_in_executor(None, node.apply)
        await asyncio.sleep(0)
        assert events == []
        # Raised: the level first, so the line is written.
        node.kv.update({"cfg/log_level": "debug", MODE_KEY: "async"})
        await loop.run_in_executor(None, node.apply)  # like the Raft thread
        for _ in range(100):
            if events:
                break
            await asyncio.sleep(0.01)
        assert events[0] == ("level", "debug")
        assert (
            "log",
            "config changed cluster-wide: enable_schedule_async_deliver false → true",
        ) in events
        assert node.config.enable_schedule_async_deliver is True
        assert driver.overrides() == {"log_level": "debug", "enable_schedule_async_deliver": True}
        events.clear()
        # Back to the file's value when the entry goes; a refresh with no change does nothing.
        del node.kv[MODE_KEY]
        assert driver.refresh() == {"enable_schedule_async_deliver": False}
        assert driver.refresh() == {}
        await driver.stop()
        node.kv["cfg/log_level"] = "warning"
        node.apply()  # after stop: nothing crosses to the loop
        assert node.config.log_level == "debug"

    try:
        asyncio.run(go())
    finally:
        logger.removeHandler(handler)
        logger.setLevel(logging.NOTSET)


def test_driver_reports_an_unreadable_entry_once_and_keeps_the_file_value(
    caplog: pytest.LogCaptureFixture,
) -> None:
    node = FakeNode(file_config(ops_log_sample_rate=0.5))
    driver = rc.RuntimeConfig(node, [], lambda level: None)  # type: ignore[arg-type]
    node.kv["cfg/ops_log_sample_rate"] = "lots"
    with caplog.at_level(logging.WARNING, logger=rc.__name__):
        assert driver.refresh() == {}
        assert driver.refresh() == {}
    assert node.config.ops_log_sample_rate == 0.5
    assert len([r for r in caplog.records if "cfg/ops_log_sample_rate" in r.getMessage()]) == 1


def test_a_failing_hook_does_not_stop_the_others() -> None:
    node = FakeNode(file_config())
    seen: list[dict[str, Any]] = []

    def broken(changes: dict[str, Any]) -> None:
        raise RuntimeError("boom")

    driver = rc.RuntimeConfig(node, [broken, seen.append], lambda level: None)  # type: ignore[arg-type]
    node.kv["cfg/ops_log_enabled"] = 0
    assert driver.refresh() == {"ops_log_enabled": False}
    assert seen == [{"ops_log_enabled": False}]


def test_a_value_committed_equal_to_the_files_is_still_a_change_once() -> None:
    """An operator's PATCH that commits the value a node already had is logged and reaches
    the hooks (the ops event log records it); committing nothing new does not."""
    node = FakeNode(file_config(ops_log_sample_rate=1.0))
    seen: list[dict[str, Any]] = []
    driver = rc.RuntimeConfig(node, [seen.append], lambda level: None)  # type: ignore[arg-type]
    assert driver.refresh() == {}
    node.kv["cfg/ops_log_sample_rate"] = "1.0"
    assert driver.refresh() == {"ops_log_sample_rate": 1.0}
    assert seen == [{"ops_log_sample_rate": 1.0}]
    assert driver.refresh() == {}
    assert node.config.ops_log_sample_rate == 1.0
