from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from chronomq.timer.cursor import ReadCursor
from chronomq.timer.dequeue import DequeuePlanner, DequeueSpan, ItemAction
from chronomq.timer.errors import ChainBroken, TimerStateError
from chronomq.timer.timerlog import NO_POS, RecordFlags, TimerRecord
from chronomq.timer.wheel import Slot
from tests.timer.helpers import T0, Harness


def test_a_slot_is_never_read_before_its_last_millisecond(harness: Harness) -> None:
    harness.produce("a", T0 + 150, T0)
    assert harness.plan(T0 + 198).items == ()
    batch = harness.plan(T0 + 199)
    assert [harness.keys[i.record.cl_offset] for i in batch.items] == ["a"]
    assert batch.deliveries == ((0, 100),)
    harness.apply(batch, T0 + 199)
    assert harness.delivered_keys() == ["a"]
    assert harness.cursor == ReadCursor.at(T0 + 200)
    assert all(d.at_ms >= d.deliver_ms for d in harness.delivered)


def test_empty_slots_only_move_the_cursor(harness: Harness) -> None:
    batch = harness.plan(T0 + 1_000)
    assert batch.items == ()
    assert batch.cursor == ReadCursor.at(T0 + 1_000)  # slot T0+1000 is not due yet
    assert not batch.is_noop
    assert harness.plan(T0 + 1_000, cursor=batch.cursor).is_noop


def test_scan_of_empty_slots_is_bounded(tmp_path: Path) -> None:
    h = Harness(tmp_path, max_slots=10)
    batch = h.plan(T0 + 60_000)
    assert batch.slots_scanned == 10
    assert batch.cursor == ReadCursor.at(T0 + 1_000)
    h.close()


def test_big_slot_is_delivered_in_chunks_with_the_cursor_inside_it(tmp_path: Path) -> None:
    h = Harness(tmp_path, max_records=128, segment_bytes=64 * 1024)
    n = 1_000
    for i in range(n):
        h.produce(f"m{i}", T0 + 100 + i % 100, T0)
    h.produce("next", T0 + 200, T0)
    now = T0 + 300
    cursors = []
    while True:
        batch = h.plan(now)
        if batch.is_noop:
            break
        assert len(batch.items) <= 128
        h.apply(batch, now)
        cursors.append(h.cursor)
    keys = h.delivered_keys()
    assert keys[:n] == [f"m{i}" for i in reversed(range(n))]  # chain order: newest first
    assert keys[n:] == ["next"]
    assert len(cursors) == 8  # 7 full batches, then the last 104 records and "next"
    inside = cursors[0]
    assert inside.slot_ms == T0 + 100 and inside.started
    assert inside.stop_pos == NO_POS
    assert h.keys[h.log.read(inside.head_pos).cl_offset] == f"m{n - 1}"
    assert h.keys[h.log.read(inside.next_pos).cl_offset] == f"m{n - 129}"  # next to read
    assert cursors[-1] == ReadCursor.at(T0 + 300)
    h.close()


def test_several_slots_in_one_batch_in_slot_order(harness: Harness) -> None:
    for key, at in [("c", T0 + 350), ("a", T0 + 120), ("b", T0 + 130), ("d", T0 + 399)]:
        harness.produce(key, at, T0)
    harness.run_until(T0 + 400)
    assert harness.delivered_keys() == ["b", "a", "d", "c"]  # newest first within a slot
    assert harness.cursor == ReadCursor.at(T0 + 400)


def test_records_added_while_a_slot_is_read_get_another_round(tmp_path: Path) -> None:
    h = Harness(tmp_path, max_records=2)
    for i in range(3):
        h.produce(f"a{i}", T0 + 150, T0)
    h.apply(h.plan(T0 + 200), T0 + 200)  # a2, a1; cursor inside the slot
    assert h.cursor.started and h.cursor.next_pos == 0
    h.produce("late0", T0 + 150, T0 + 120)  # committed late, its slot still unread
    h.produce("late1", T0 + 150, T0 + 120)
    h.run_until(T0 + 200)
    assert h.delivered_keys() == ["a2", "a1", "a0", "late1", "late0"]
    h.close()


def test_replay_of_a_span_from_another_cursor_is_stale(harness: Harness) -> None:
    harness.produce("a", T0 + 150, T0)
    batch = harness.plan(T0 + 200)
    harness.apply(batch, T0 + 200)
    again = harness.apply(batch, T0 + 200)  # the same command applied twice
    assert again.stale and again.items == ()
    assert harness.delivered_keys() == ["a"]


def test_message_committed_after_planning_into_a_finished_slot_is_delivered_late(
    harness: Harness,
) -> None:
    harness.produce("a", T0 + 150, T0)
    batch = harness.plan(T0 + 250)  # finishes slot T0+100, cursor to T0+200
    harness.produce("b", T0 + 160, T0 + 90)  # applied before the delivery command
    result = harness.apply(batch, T0 + 250)
    assert [(harness.keys[i.record.cl_offset], i.late) for i in result.items] == [
        ("a", False),
        ("b", True),
    ]
    harness.run_until(T0 + 1_000)
    assert harness.delivered_keys() == ["a", "b"]


def test_cancel_committed_after_planning_still_wins(harness: Harness) -> None:
    harness.produce("a", T0 + 150, T0)
    harness.produce("b", T0 + 150, T0)
    batch = harness.plan(T0 + 200)
    assert {i.action for i in batch.items} == {ItemAction.DELIVER}
    assert harness.cancel("a", T0 + 199).status.value == "cancelled"
    result = harness.apply(batch, T0 + 200)
    assert [(harness.keys[i.record.cl_offset], i.action) for i in result.items] == [
        ("b", ItemAction.DELIVER),
        ("a", ItemAction.SUPPRESS),
    ]
    assert harness.delivered_keys() == ["b"]
    assert harness.suppressed == ["a"]


def test_batch_with_a_reput_ends_at_that_slot(harness: Harness) -> None:
    rolled = harness.produce("far", T0 + 5_000, T0)  # beyond the 3.2 s roll window
    assert rolled.plan.slot_ms == T0 + 3_100
    harness.produce("after", T0 + 3_250, T0 + 100)
    batch = harness.plan(T0 + 4_000)
    assert [i.action for i in batch.items] == [ItemAction.REPUT]
    assert batch.cursor == ReadCursor.at(T0 + 3_200)
    harness.apply(batch, T0 + 4_000)
    assert harness.reput == 1
    harness.run_until(T0 + 6_000)
    assert harness.delivered_keys() == ["after", "far"]
    assert all(d.at_ms >= d.deliver_ms for d in harness.delivered)


def test_long_delay_rolls_and_arrives_on_time(harness: Harness) -> None:
    deliver = T0 + 60_000  # almost 10 laps of the 6.4 s wheel
    harness.produce("x", deliver, T0)
    now = T0 - 1
    while not harness.delivered:
        now += 100  # the last millisecond of each slot
        harness.run_until(now)
    assert harness.delivered[0].at_ms == deliver - deliver % 100 + 99
    assert harness.reput >= 18


def test_span_as_integers_round_trips() -> None:
    span = DequeueSpan(ReadCursor(1000, 800, NO_POS, 160), ReadCursor.at(1100), 960)
    assert len(span.as_tuple()) == 9
    assert DequeueSpan.from_tuple(list(span.as_tuple())) == span
    with pytest.raises(TimerStateError):
        DequeueSpan.from_tuple([1, 2, 3])


@dataclass
class FakeLog:
    records: dict[int, TimerRecord]
    end_pos: int = 10_000

    def read(self, pos: int) -> TimerRecord:
        return self.records[pos]

    def iter_chain(
        self, last_pos: int, *, stop_pos: int = NO_POS
    ) -> Iterator[tuple[int, TimerRecord]]:
        pos = last_pos
        while pos != stop_pos:
            yield pos, self.records[pos]
            pos = self.records[pos].prev_pos


@dataclass
class FakeWheel:
    slots: dict[int, Slot]

    def get(self, time_ms: int) -> Slot:
        return self.slots.get(time_ms - time_ms % 100, Slot(time_ms - time_ms % 100))


def _rec(slot_ms: int, prev: int) -> TimerRecord:
    return TimerRecord(prev, RecordFlags.NONE, 0, slot_ms + 1, slot_ms, 1, 1, 0, 7)


def test_chain_holding_a_record_of_another_slot_is_corruption() -> None:
    planner = DequeuePlanner(Harness.geometry)
    log = FakeLog({0: _rec(T0, NO_POS), 80: _rec(T0 + 100, 0)})
    wheel = FakeWheel({T0: Slot(T0, 0, 80, 2)})
    with pytest.raises(ChainBroken):
        planner.plan(ReadCursor.at(T0), T0 + 1_000, wheel, log)


def test_chain_that_does_not_go_backwards_is_corruption() -> None:
    planner = DequeuePlanner(Harness.geometry)
    log = FakeLog({0: _rec(T0, 80), 80: _rec(T0, 0)})
    wheel = FakeWheel({T0: Slot(T0, 0, 80, 2)})
    with pytest.raises(ChainBroken):
        planner.plan(ReadCursor.at(T0), T0 + 1_000, wheel, log)


def test_span_that_does_not_replay_is_corruption(harness: Harness) -> None:
    harness.produce("a", T0 + 150, T0)
    batch = harness.plan(T0 + 200)
    bogus = DequeueSpan(batch.span.from_cursor, ReadCursor(T0 + 100, 80, NO_POS, 0), 80)
    with pytest.raises(ChainBroken):
        harness.planner.replay(bogus, harness.cursor, harness.wheel, harness.log)
