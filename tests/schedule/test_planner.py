"""The delivery loop's scan decision and the offset correction rule."""

from __future__ import annotations

import pytest

from chronomq.raftlog.clock import FakeClock
from chronomq.schedule.errors import ScheduleInternalError
from chronomq.schedule.planner import (
    OffsetFix,
    ScheduleEntry,
    StopReason,
    correct_offset,
    plan_scan,
)

T0_MS = 1_700_000_000_000


def entries(start_offset: int, deliver_ms: list[int]) -> list[ScheduleEntry]:
    return [
        ScheduleEntry(
            queue_offset=start_offset + i,
            commitlog_offset=10_000 + 200 * (start_offset + i),
            size_bytes=200,
            deliver_ms=deliver,
        )
        for i, deliver in enumerate(deliver_ms)
    ]


def test_nothing_due_yet() -> None:
    queue = entries(5, [T0_MS + 1_000, T0_MS + 2_000])
    plan = plan_scan(5, queue, T0_MS)
    assert plan.due == ()
    assert plan.next_offset == 5
    assert plan.stop is StopReason.NOT_DUE
    assert plan.next_due_ms == T0_MS + 1_000
    assert plan.wait_ms(T0_MS) == 1_000


def test_due_at_exactly_deliver_time_never_before() -> None:
    """Never early: due iff ``deliver_ms <= now_ms`` (seed 000, ``countdown > 0`` waits)."""
    queue = entries(0, [T0_MS])
    assert plan_scan(0, queue, T0_MS - 1).due == ()
    assert plan_scan(0, queue, T0_MS).due == tuple(queue)


def test_fifo_stops_at_first_entry_not_due() -> None:
    """Seed 001: if the first undelivered entry is not due, nothing behind it is checked."""
    queue = entries(0, [T0_MS - 50, T0_MS, T0_MS + 10, T0_MS - 100, T0_MS - 100])
    plan = plan_scan(0, queue, T0_MS)
    assert [e.queue_offset for e in plan.due] == [0, 1]
    assert plan.next_offset == 2
    assert plan.stop is StopReason.NOT_DUE
    assert plan.next_due_ms == T0_MS + 10
    assert plan.wait_ms(T0_MS) == 10


def test_all_due_reaches_the_end() -> None:
    queue = entries(7, [T0_MS - 3, T0_MS - 2, T0_MS - 1])
    plan = plan_scan(7, queue, T0_MS)
    assert len(plan.due) == 3
    assert plan.next_offset == 10
    assert plan.stop is StopReason.END
    assert plan.next_due_ms is None
    assert plan.wait_ms(T0_MS) is None


def test_empty_queue() -> None:
    plan = plan_scan(3, [], T0_MS)
    assert (plan.due, plan.next_offset, plan.stop, plan.next_due_ms) == (
        (),
        3,
        StopReason.END,
        None,
    )


def test_limit_bounds_a_batch_and_says_more_may_be_due() -> None:
    queue = entries(0, [T0_MS - 5] * 5 + [T0_MS + 500])
    plan = plan_scan(0, queue, T0_MS, limit=2)
    assert [e.queue_offset for e in plan.due] == [0, 1]
    assert plan.next_offset == 2
    assert plan.stop is StopReason.LIMIT
    assert plan.wait_ms(T0_MS) == 0

    tail = plan_scan(2, queue[2:], T0_MS, limit=3)
    assert [e.queue_offset for e in tail.due] == [2, 3, 4]
    assert tail.stop is StopReason.LIMIT
    assert tail.next_due_ms == T0_MS + 500


def test_limit_reached_at_the_end_of_the_entries_given() -> None:
    queue = entries(0, [T0_MS - 5] * 2)
    plan = plan_scan(0, queue, T0_MS, limit=2)
    assert plan.stop is StopReason.LIMIT
    assert plan.next_offset == 2
    assert plan.wait_ms(T0_MS) == 0


def test_limit_must_be_positive() -> None:
    with pytest.raises(ValueError):
        plan_scan(0, [], T0_MS, limit=0)


def test_scan_with_a_fake_clock_delivers_each_entry_on_time() -> None:
    clock = FakeClock(T0_MS)
    queue = entries(0, [T0_MS + 1_000, T0_MS + 1_000, T0_MS + 2_500])
    offset = 0
    delivered_at: dict[int, int] = {}
    for _ in range(10):
        plan = plan_scan(offset, queue[offset:], clock.now_ms())
        for entry in plan.due:
            delivered_at[entry.queue_offset] = clock.now_ms()
        offset = plan.next_offset
        wait_ms = plan.wait_ms(clock.now_ms())
        if wait_ms is None:
            break
        clock.advance(wait_ms)
    assert delivered_at == {0: T0_MS + 1_000, 1: T0_MS + 1_000, 2: T0_MS + 2_500}


def test_entries_must_start_at_offset_and_be_contiguous() -> None:
    with pytest.raises(ScheduleInternalError, match="expected queue offset 4, got 5"):
        plan_scan(4, entries(5, [T0_MS]), T0_MS)
    gap = entries(0, [T0_MS, T0_MS])
    gap[1] = ScheduleEntry(queue_offset=3, commitlog_offset=0, size_bytes=1, deliver_ms=T0_MS)
    with pytest.raises(ScheduleInternalError, match="contiguous"):
        plan_scan(0, gap, T0_MS)


def test_skew_correction_is_off_by_default() -> None:
    far_future = T0_MS + 3_600_000
    plan = plan_scan(0, entries(0, [far_future]), T0_MS)
    assert plan.due == ()
    assert plan.skew_corrected == 0


def test_skew_correction_delivers_entries_stamped_by_a_clock_ahead() -> None:
    """Seed 000 ``correctDeliverTimestamp``: a deliver time beyond now + the level's delay."""
    level_delay_ms = 1_000
    queue = entries(0, [T0_MS + 3_600_000, T0_MS + 1_000, T0_MS + 1_001])
    plan = plan_scan(0, queue, T0_MS, max_delay_ms=level_delay_ms)
    assert [e.queue_offset for e in plan.due] == [0]
    assert plan.skew_corrected == 1
    assert plan.next_due_ms == T0_MS + 1_000


def test_offset_inside_bounds_is_kept() -> None:
    for offset in (10, 15, 20):
        fix = correct_offset(3, offset, 10, 20)
        assert fix.offset == offset
        assert fix.fix is OffsetFix.NONE
        assert not fix.corrected


def test_offset_below_min_moves_to_min() -> None:
    """Seed 000 ``executeOnTimeup``: ``resetOffset = cq.getMinOffsetInQueue()``."""
    fix = correct_offset(3, 4, 10, 20)
    assert (fix.requested, fix.offset, fix.fix) == (4, 10, OffsetFix.BELOW_MIN)
    assert fix.corrected
    assert fix.describe() == (
        "schedule level 3 offset 4 is below the queue minimum 10; corrected to 10"
    )


def test_offset_above_max_moves_to_max() -> None:
    """Seed 000 ``executeOnTimeup``: ``resetOffset = cq.getMaxOffsetInQueue()``."""
    fix = correct_offset(2, 99, 0, 20)
    assert (fix.requested, fix.offset, fix.fix) == (99, 20, OffsetFix.ABOVE_MAX)
    assert "above the queue maximum 20; corrected to 20" in fix.describe()


def test_empty_queue_bounds() -> None:
    assert correct_offset(1, 0, 0, 0).offset == 0
    assert correct_offset(1, 5, 0, 0).offset == 0


def test_inconsistent_bounds_are_internal_errors() -> None:
    with pytest.raises(ScheduleInternalError):
        correct_offset(1, 0, 10, 5)
    with pytest.raises(ScheduleInternalError):
        correct_offset(1, 0, -1, 5)
