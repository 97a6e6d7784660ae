"""The node's ops logs: what each hook writes, with a fake Raft machine and a fake clock."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from chronomq import ConsumedLog
from chronomq.cluster.config.nodeconfig import load
from chronomq.cluster.logs.nodelogs import NodeLogs, install_metrics, log_dir
from chronomq.cluster.logs.schema import (
    EventRecord,
    EventType,
    LatencyRecord,
    MessageKind,
    RecordType,
    ReplicationRecord,
    Stage,
    consumed_line,
    decode,
)
from chronomq.cluster.logs.writer import keep_sample
from chronomq.raftlog import command as cmdcodec
from chronomq.raftlog.clock import FakeClock
from chronomq.raftlog.record import msg_id_hex
from chronomq.raftlog.store import ApplyResult, Placed

T0 = 1_700_000_000_000


class FakeMachine:
    def __init__(self) -> None:
        self.leader = False
        self.raftCurrentTerm = 3
        self.raftCommitIndex = 0

    def _isLeader(self) -> bool:
        return self.leader


class FakeRaftLog:
    def __init__(self) -> None:
        self.clock = FakeClock(T0)
        self.machine = FakeMachine()
        self.listeners: list[Callable[[ApplyResult], None]] = []

    def add_apply_listener(self, listener: Callable[[ApplyResult], None]) -> None:
        self.listeners.append(listener)

    def apply(self, index: int, messages: int = 2, propose_ms: int = T0 - 5) -> None:
        result = ApplyResult(index, cmdcodec.Kind.APPEND, propose_ms, (), 100 * messages, messages)
        for listener in self.listeners:
            listener(result)


def config(tmp_path: Path, **overrides: Any) -> Any:
    return load(
        overrides={"node_id": 1, "data_dir": str(tmp_path / "data"), **overrides}, environ={}
    )


def read(directory: Path, record_type: RecordType) -> list[Any]:
    out = []
    for path in sorted(directory.glob(f"{record_type}-*.jsonl")):
        out += [decode(line, record_type) for line in path.read_bytes().splitlines()]
    return out


@pytest.fixture
def raft() -> FakeRaftLog:
    return FakeRaftLog()


def test_logs_live_under_data_dir_unless_ops_log_dir_says(tmp_path: Path) -> None:
    assert log_dir(config(tmp_path)) == tmp_path / "data" / "ops"
    assert log_dir(config(tmp_path, ops_log_dir=str(tmp_path / "all"))) == tmp_path / "all"


def test_one_replication_line_per_apply_with_leader_times_on_the_leader(
    tmp_path: Path, raft: FakeRaftLog
) -> None:
    logs = NodeLogs(config(tmp_path), raft)  # type: ignore[arg-type]
    raft.apply(7)
    raft.clock.advance(3)
    raft.machine.leader = True
    raft.machine.raftCurrentTerm = 4
    raft.apply(8, messages=0, propose_ms=T0 + 1)
    logs.close()
    got = read(tmp_path / "data" / "ops" / "n1", RecordType.REPLICATION)
    assert got == [
        ReplicationRecord(7, 3, 200, 2, "n1", apply_ms=T0),
        ReplicationRecord(8, 4, 0, 0, "n1", apply_ms=T0 + 3, propose_ms=T0 + 1, commit_ms=T0 + 3),
    ]


def test_a_restart_does_not_log_the_journal_replay_again(tmp_path: Path, raft: FakeRaftLog) -> None:
    raft.machine.raftCommitIndex = 40  # what the journal says was committed before the restart
    logs = NodeLogs(config(tmp_path), raft)  # type: ignore[arg-type]
    for index in (39, 40, 41):
        raft.apply(index)
    logs.close()
    got = read(tmp_path / "data" / "ops" / "n1", RecordType.REPLICATION)
    assert [r.index for r in got] == [41]


def placed(n: int) -> list[Placed]:
    return [Placed(bytes([i]) * 16, "SCHEDULE_TOPIC_XXXX", 0, i, 0, 100) for i in range(n)]


def test_stored_and_delivered_lines_for_every_kind(tmp_path: Path, raft: FakeRaftLog) -> None:
    logs = NodeLogs(config(tmp_path), raft)  # type: ignore[arg-type]
    p = placed(3)
    extras = [{}, {"delay_level": 2, "deliver_ms": T0 + 5_000}, {"deliver_ms": T0 + 250}]
    logs.stored("orders", p, extras, T0)
    ids = [msg_id_hex(x.msg_id) for x in p]
    logs.delivered_level(2, [(ids[1], "orders", T0, T0 + 5_000)], T0 + 5_004)
    logs.delivered_timer([(ids[2], "orders", T0, T0 + 250)], T0 + 260)
    logs.delivered_timer([], T0 + 270)
    logs.close()
    n1 = "n1"
    assert read(tmp_path / "data" / "ops" / n1, RecordType.LATENCY) == [
        LatencyRecord(ids[0], "orders", MessageKind.PLAIN, Stage.STORED, n1, store_ms=T0),
        LatencyRecord(
            ids[1], "orders", MessageKind.LEVEL, Stage.STORED, n1, 2, T0, due_ms=T0 + 5_000
        ),
        LatencyRecord(ids[2], "orders", MessageKind.TIMER, Stage.STORED, n1, None, T0, T0 + 250),
        LatencyRecord(
            ids[1], "orders", MessageKind.LEVEL, Stage.DELIVERED, n1, 2, T0, T0 + 5_000, T0 + 5_004
        ),
        LatencyRecord(
            ids[2], "orders", MessageKind.TIMER, Stage.DELIVERED, n1, None, T0, T0 + 250, T0 + 260
        ),
    ]


def test_events_node_life_leader_changes_services_and_bad_input(
    tmp_path: Path, raft: FakeRaftLog
) -> None:
    logs = NodeLogs(config(tmp_path), raft)  # type: ignore[arg-type]
    logs.leader_changed(2, None, 5, None)
    logs.leader_changed("10.0.0.9:9000", 2, 6, 412.5)
    logs.event("service_start", service="schedule", term=6, mode="sync")
    logs.event("no_such_event", service="x")  # refused, never raised to a service
    logs.event(EventType.DRILL_FAULT, fault="kill", target={1, 2}, at=Path("/x"))
    logs.close()
    events = read(tmp_path / "data" / "ops" / "n1", RecordType.EVENTS)
    assert [(e.type.value, dict(e.detail)) for e in events] == [
        ("service_start", {"service": "node"}),
        ("leader_change", {"leader": "n2", "previous": None, "term": 5, "election_ms": None}),
        (
            "leader_change",
            {"leader": "10.0.0.9:9000", "previous": "n2", "term": 6, "election_ms": 412.5},
        ),
        ("service_start", {"service": "schedule", "term": 6, "mode": "sync"}),
        ("drill_fault", {"fault": "kill", "target": "{1, 2}", "at": "/x"}),
        ("service_stop", {"service": "node"}),
    ]
    assert all(isinstance(e, EventRecord) and e.node == "n1" and e.ts_ms == T0 for e in events)


def test_switched_off_at_start_and_on_again_at_runtime(tmp_path: Path, raft: FakeRaftLog) -> None:
    logs = NodeLogs(config(tmp_path, ops_log_enabled=False), raft)  # type: ignore[arg-type]
    raft.apply(1)
    logs.stored("orders", placed(1), [{}], T0)
    logs.on_config_change({"ops_log_enabled": True})
    raft.apply(2)
    logs.on_config_change({"ops_log_enabled": False, "log_level": "debug"})
    raft.apply(3)
    logs.close()
    directory = tmp_path / "data" / "ops" / "n1"
    assert [r.index for r in read(directory, RecordType.REPLICATION)] == [2]
    assert read(directory, RecordType.LATENCY) == []
    changes = [dict(e.detail) for e in read(directory, RecordType.EVENTS)]
    # Both switches are on the timeline: on is logged once on, off just before going off.
    assert changes == [
        {"changes": {"ops_log_enabled": True}},
        {"changes": {"ops_log_enabled": False, "log_level": "debug"}},
    ]


def test_sampling_keeps_the_same_messages_on_every_node_and_stage(
    tmp_path: Path, raft: FakeRaftLog
) -> None:
    rate = 0.25
    shared = str(tmp_path / "ops")
    leader = NodeLogs(config(tmp_path, ops_log_dir=shared), raft)  # type: ignore[arg-type]
    leader.on_config_change({"ops_log_sample_rate": rate})
    p = [Placed(i.to_bytes(16, "big"), "SCHEDULE_TOPIC_XXXX", 0, i, 0, 1) for i in range(2_000)]
    ids = [msg_id_hex(x.msg_id) for x in p]
    leader.stored("orders", p, [{"delay_level": 1, "deliver_ms": T0 + 1_000}] * len(p), T0)
    leader.delivered_level(1, [(i, "orders", T0, T0 + 1_000) for i in ids], T0 + 1_001)
    leader.close()
    consumer = ConsumedLog(shared, "c0", sample_rate=rate)
    consumer.consumed(
        "orders", [{"msg_id": i, "properties": {"REAL_TOPIC": "orders"}} for i in ids]
    )
    consumer.close()
    want = {i for i in ids if keep_sample(i, rate)}
    assert 300 < len(want) < 700
    by_stage: dict[Stage, set[str]] = {}
    for node in ("n1", "c0"):
        for r in read(Path(shared) / node, RecordType.LATENCY):
            by_stage.setdefault(r.stage, set()).add(r.msg_id)
    assert by_stage == {Stage.STORED: want, Stage.DELIVERED: want, Stage.CONSUMED: want}
    assert leader.stats().sampled_out == 2 * (len(ids) - len(want))


def test_consumed_lines_say_what_the_client_knows() -> None:
    plain = {"msg_id": "A" * 32, "store_ms": T0, "properties": {}}
    level = {"msg_id": "B" * 32, "store_ms": T0 + 9, "properties": {"REAL_TOPIC": "orders"}}
    timer = {"msg_id": "C" * 32, "store_ms": T0 + 9, "properties": {"TIMER_OUT_MS": str(T0 + 5)}}
    got = [decode(consumed_line(m, "orders", T0 + 20, "c0")) for m in (plain, level, timer)]
    plain_kind, timer_kind, consumed = MessageKind.PLAIN, MessageKind.TIMER, Stage.CONSUMED
    assert got == [
        LatencyRecord(
            "A" * 32, "orders", plain_kind, consumed, "c0", None, T0, None, None, T0 + 20
        ),
        LatencyRecord("B" * 32, "orders", plain_kind, consumed, "c0", consumed_ms=T0 + 20),
        LatencyRecord(
            "C" * 32, "orders", timer_kind, consumed, "c0", due_ms=T0 + 5, consumed_ms=T0 + 20
        ),
    ]


def test_metrics_show_what_the_writer_did(tmp_path: Path, raft: FakeRaftLog) -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry()
    logs = NodeLogs(config(tmp_path), raft)  # type: ignore[arg-type]
    install_metrics(registry, logs)
    raft.apply(1)
    logs.close()
    text = generate_latest(registry).decode()
    assert 'chronomq_ops_log_records_total{outcome="written"} 3.0' in text  # start, apply, stop
    assert 'chronomq_ops_log_records_total{outcome="dropped"} 0.0' in text
    assert "chronomq_ops_log_buffered 0.0" in text and "chronomq_ops_log_enabled 1.0" in text
