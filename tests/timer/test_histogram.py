"""The wheel's due histogram (timer.histogram) over an in-memory wheel, with times as arguments."""

from __future__ import annotations

import pytest

from chronomq.timer.histogram import MAX_OVERDUE_SLOTS, due_histogram
from chronomq.timer.slots import SlotGeometry
from chronomq.timer.wheel import Slot

GEOMETRY = SlotGeometry(precision_ms=100, slot_count=100_000, roll_window_slots=50_000)


class FakeWheel:
    """Slots by slot time; a cell holding another lap reads as empty, as the real wheel does."""

    def __init__(self, slots: dict[int, tuple[int, int]]) -> None:
        self.slots = slots
        self.reads = 0

    def get(self, time_ms: int) -> Slot:
        self.reads += 1
        slot_ms = GEOMETRY.slot_ms(time_ms)
        count, tombs = self.slots.get(slot_ms, (0, 0))
        return Slot(slot_ms, 0 if count else -1, 0 if count else -1, count, -1, tombs)


def test_messages_fall_in_the_bucket_of_their_slot() -> None:
    now = 1_000_050  # inside slot 1_000_000
    wheel = FakeWheel({1_000_000: (2, 0), 1_059_900: (1, 1), 1_060_000: (5, 0), 1_180_000: (9, 0)})
    hist = due_histogram(
        wheel, GEOMETRY, now_ms=now, span_ms=180_000, buckets=3, cursor_slot_ms=1_000_000
    )
    assert hist.from_ms == 1_000_000 and hist.to_ms == 1_180_000 and hist.bucket_ms == 60_000
    assert [(b.messages, b.cancels) for b in hist.buckets] == [(3, 1), (5, 0), (0, 0)]
    assert hist.total == 8  # the slot at to_ms is outside
    assert hist.overdue_messages == 0 and hist.overdue_from_ms is None
    assert wheel.reads == 1800


def test_slots_the_cursor_has_not_passed_are_overdue() -> None:
    wheel = FakeWheel({990_000: (4, 0), 999_900: (1, 0), 1_000_000: (7, 0)})
    hist = due_histogram(
        wheel, GEOMETRY, now_ms=1_000_000, span_ms=60_000, buckets=1, cursor_slot_ms=990_000
    )
    assert hist.overdue_messages == 5 and hist.overdue_from_ms == 990_000
    assert hist.overdue_complete and hist.total == 7
    body = hist.as_json()
    assert body["overdue"] == {"messages": 5, "from_ms": 990_000, "complete": True}
    assert body["buckets"] == [{"start_ms": 1_000_000, "messages": 7, "cancels": 0}]


def test_a_cursor_far_behind_reads_only_the_newest_overdue_slots() -> None:
    now = 100_000_000
    wheel = FakeWheel({0: (3, 0), now - 100: (2, 0)})
    hist = due_histogram(wheel, GEOMETRY, now_ms=now, span_ms=1000, buckets=1, cursor_slot_ms=0)
    assert hist.overdue_messages == 2 and not hist.overdue_complete
    assert hist.overdue_from_ms == now - MAX_OVERDUE_SLOTS * 100


def test_buckets_are_whole_slots_and_bad_shapes_are_refused() -> None:
    hist = due_histogram(
        FakeWheel({}), GEOMETRY, now_ms=0, span_ms=1000, buckets=3, cursor_slot_ms=None
    )
    assert hist.bucket_ms == 400  # 334 ms rounded up to whole 100 ms slots
    with pytest.raises(ValueError):
        due_histogram(FakeWheel({}), GEOMETRY, now_ms=0, span_ms=10, buckets=0, cursor_slot_ms=0)
    with pytest.raises(ValueError):
        due_histogram(FakeWheel({}), GEOMETRY, now_ms=0, span_ms=10**9, buckets=1, cursor_slot_ms=0)
