"""The TimerLog's copy in the CommitLog (:mod:`chronomq.timer.logtopic`): every replica writes the same
records, and a TimerLog lost or behind is rebuilt from the node's own CommitLog, byte for byte,
without asking a peer. Real files, an in-process Raft group, a fake clock."""

from __future__ import annotations

import dataclasses
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from chronomq.raftlog import record
from chronomq.raftlog.consumequeue import CqUnit
from chronomq.timer import logtopic
from chronomq.timer.errors import TimerCorruptionError, TimerStateError
from chronomq.timer.files import TimerFiles
from chronomq.timer.timerlog import RECORD_SIZE, TimerLog, TimerRecord, encode_record, read_records
from tests.timer.fakes import Group
from tests.timer.test_service import (
    cancel,
    check_delivered,
    check_replicas_equal,
    config,
    restart,
    traffic,
)

#: 50 records and a 40-byte unused tail per segment: bodies must split at segment ends.
SEGMENT_BYTES = 50 * RECORD_SIZE + 40


def no_fetch(start: int, end: int, sink: Callable[[bytes], None]) -> None:
    raise AssertionError(f"a peer was asked for TimerLog [{start}, {end})")


@pytest.fixture
def group(tmp_path: Path) -> Any:
    cfg = dataclasses.replace(
        config(timer_roll_window_slots=10), timer_log_segment_bytes=SEGMENT_BYTES
    )
    g = Group(tmp_path / "g", cfg)
    g.elect(0)
    g.step_leader()
    g.commit()
    yield g
    g.close()


def busy(g: Group, seed: int) -> dict[str, int]:
    """Timers (some rolled: the window is one second), cancels and deliveries: enq, cancel
    and span commands. Returns what is due when, the cancelled left out."""
    rng = random.Random(seed)
    due: dict[str, int] = {}
    now = g.clock.now_ms()
    for _ in range(150):
        t = now + rng.randint(0, 6_000)
        due[g.produce("t", t)] = t
    g.commit()
    for msg_id in rng.sample(sorted(due), 10):
        if cancel(g, msg_id)["status"] == "cancelled":
            del due[msg_id]
    traffic(g, rng, due, 1_500)
    return due


def timerlog_bytes(g: Group, i: int) -> bytes:
    log = g.services[i].machine.files.log
    data, _ = read_records(log.directory, log.segment_bytes, 0, log.end_pos, 10**7)
    return data


def topic_bodies(g: Group, i: int) -> list[tuple[int, bytes]]:
    store = g.logs[i].store
    out = []
    for msg in store.read_messages(logtopic.TOPIC, logtopic.QUEUE, 0, 10**6):
        assert msg.tags_code == int(msg.properties[logtopic.TIMER_LOG_POS])
        out.append((msg.tags_code, msg.body))
    return out


def test_every_timerlog_record_is_in_the_commitlog_alike_on_every_replica(group: Group) -> None:
    busy(group, 1)
    check_replicas_equal(group)  # equal CommitLog digests: the new records included
    bodies = topic_bodies(group, 0)
    assert bodies == topic_bodies(group, 1) == topic_bodies(group, 2)
    assert b"".join(body for _, body in bodies) == timerlog_bytes(group, 0)
    for first, body in bodies:  # never across a segment's end, never over the bound
        assert len(body) // RECORD_SIZE <= logtopic.MAX_RECORDS_PER_MESSAGE
        last = first + len(body) - RECORD_SIZE
        assert first // SEGMENT_BYTES == last // SEGMENT_BYTES
    counters = group.service.machine.committed().counters
    assert counters["tombstones"] > 0 and counters["rolled"] > 0


def test_a_lost_timerlog_is_rebuilt_from_the_commitlog_alone(group: Group, tmp_path: Path) -> None:
    busy(group, 2)
    machine = group.services[1].machine
    want = timerlog_bytes(group, 1)
    files = machine.files
    slots = sorted({rec.slot_ms for _, rec in files.log.scan(0)})
    want_slots = [files.wheel.get(ms) for ms in slots]
    target = machine.state.log_end
    files.close()
    shutil.rmtree(tmp_path / "g" / "r1" / "timer")
    store = group.logs[1].store
    again = TimerFiles(tmp_path / "g" / "r1" / "timer", machine.config)
    report = again.align(
        target, None, lambda log, end: logtopic.rebuild_from_store(store, log, end)
    )
    try:
        assert report.local_records == len(want) // RECORD_SIZE and report.fetched_records == 0
        data, _ = read_records(again.log.directory, SEGMENT_BYTES, 0, again.log.end_pos, 10**7)
        assert data == want
        assert [again.wheel.get(ms) for ms in slots] == want_slots
    finally:
        again.close()
        machine.files = TimerFiles(tmp_path / "g" / "r1" / "timer", machine.config)


def test_a_replica_without_timer_files_restarts_from_a_snapshot_and_delivers(
    group: Group,
) -> None:
    due = busy(group, 3)
    snapshot = group.logs[2].store.snapshot({"s": None})
    snap_index = group.index
    due_more: dict[str, int] = {}
    traffic(group, random.Random(4), due_more, 500)
    group.logs[2].store.close()
    shutil.rmtree(group.root / "r2" / "timer")
    restart(group, 2, snapshot, snap_index, fetch_from=None)
    group.services[2].machine.fetch = no_fetch
    align = group.services[2].machine.files.last_align
    assert align is not None and align.local_records > 0 and align.fetched_records == 0
    check_replicas_equal(group)
    group.run(group.clock.now_ms() + 7_000)
    check_delivered(group, {**due, **due_more}, replica=2)
    check_replicas_equal(group)


def test_what_the_commitlog_lacks_is_fetched_from_a_peer(
    group: Group, monkeypatch: pytest.MonkeyPatch
) -> None:
    busy(group, 5)
    snapshot = group.logs[0].store.snapshot({"s": None})
    snap_index = group.index
    group.logs[2].store.close()
    shutil.rmtree(group.root / "r2" / "timer")
    # As if retention had removed the segments holding the copies.
    monkeypatch.setattr(
        logtopic,
        "rebuild_from_store",
        lambda store, log, end: logtopic.LocalCopy(0, "segments removed"),
    )
    restart(group, 2, snapshot, snap_index, fetch_from=0)
    align = group.services[2].machine.files.last_align
    assert align is not None and align.local_records == 0 and align.fetched_records > 0
    check_replicas_equal(group)


def test_no_copy_and_no_peer_is_an_error_that_says_so(tmp_path: Path) -> None:
    files = TimerFiles(tmp_path / "timer", config())
    try:
        with pytest.raises(TimerStateError, match="CommitLog does not hold"):
            files.align(800, None, lambda log, end: logtopic.LocalCopy(0, "none"))
    finally:
        files.close()


# ---------------------------------------------------------------------- codec and gaps


def rec(i: int) -> TimerRecord:
    from chronomq.timer.timerlog import RecordFlags

    return TimerRecord(
        prev_pos=-1,
        flags=RecordFlags.NONE,
        write_ms=1_000 + i,
        deliver_ms=2_000 + i,
        slot_ms=2_000,
        cl_offset=100 * i,
        cl_size=100,
    )


def test_bodies_are_bounded_and_split_where_positions_jump() -> None:
    appended = [(i * RECORD_SIZE, encode_record(rec(i))) for i in range(600)]
    appended.append((10_000 * RECORD_SIZE, encode_record(rec(600))))
    pieces = logtopic.chunks(appended)
    assert [(first, len(body) // RECORD_SIZE) for first, body in pieces] == [
        (0, 256),
        (256 * RECORD_SIZE, 256),
        (512 * RECORD_SIZE, 88),
        (10_000 * RECORD_SIZE, 1),
    ]
    derived = logtopic.derived_records(appended, store_ms=5)
    msg = record.decode(derived[1].data)
    assert msg.topic == logtopic.TOPIC and msg.store_ms == msg.born_ms == 5
    assert msg.properties == {"TIMER_LOG_POS": str(256 * RECORD_SIZE), "TIMER_LOG_COUNT": "256"}
    assert msg.tags_code == 256 * RECORD_SIZE and msg.msg_id[:4] == b"TLOG"
    assert logtopic.derived_records(appended, store_ms=5) == derived  # deterministic


class ListStore:
    """The few reads :func:`logtopic.rebuild_from_store` makes, over a list of records."""

    def __init__(self, records: list[bytes]) -> None:
        self.records = records

    def max_offset(self, topic: str, queue_id: int) -> int:
        return len(self.records)

    def read_units(self, topic: str, queue_id: int, offset: int, max_units: int) -> list[CqUnit]:
        return [
            CqUnit(i, i, len(self.records[i]), record.tags_code_at(self.records[i], 0))
            for i in range(offset, min(len(self.records), offset + max_units))
        ]

    def read_record(self, at: int, size: int) -> bytes:
        return self.records[at]


def test_a_gap_in_positions_is_corruption_naming_the_timerlog(tmp_path: Path) -> None:
    appended = [(i * RECORD_SIZE, encode_record(rec(i))) for i in range(10)]
    pieces = [
        bytes(d.data)
        for part in (appended[:4], appended[4:6], appended[6:])
        for d in logtopic.derived_records(part, store_ms=1)
    ]
    del pieces[1]  # records 4 and 5 are missing
    log = TimerLog.open(tmp_path / "timerlog", segment_bytes=1 << 20)
    try:
        with pytest.raises(TimerCorruptionError, match="a gap") as err:
            logtopic.rebuild_from_store(ListStore(pieces), log, 10 * RECORD_SIZE)  # type: ignore[arg-type]
        assert err.value.path == tmp_path / "timerlog"
        assert str(tmp_path / "timerlog") in str(err.value)
        assert log.end_pos == 4 * RECORD_SIZE  # what came before the gap is kept
    finally:
        log.close()


def test_the_copy_resumes_inside_a_piece_and_stops_at_the_target(tmp_path: Path) -> None:
    appended = [(i * RECORD_SIZE, encode_record(rec(i))) for i in range(10)]
    pieces = [bytes(d.data) for d in logtopic.derived_records(appended, store_ms=1)]
    log = TimerLog.open(tmp_path / "timerlog", segment_bytes=1 << 20)
    try:
        for i in range(3):
            log.append(rec(i))
        copy = logtopic.rebuild_from_store(ListStore(pieces), log, 7 * RECORD_SIZE)  # type: ignore[arg-type]
        assert copy.records == 4 and copy.stopped is None and log.end_pos == 7 * RECORD_SIZE
        assert [r for _, r in log.scan(0)] == [rec(i) for i in range(7)]
    finally:
        log.close()


def test_an_append_to_the_copy_topic_is_refused_at_apply() -> None:
    from chronomq.raftlog.applycheck import RecordFacts

    facts = RecordFacts(logtopic.TOPIC, 0, 0, 0, {"TIMER_LOG_POS": "0"}, 0)
    assert logtopic.apply_rule(facts, lambda topic: 1) is not None
