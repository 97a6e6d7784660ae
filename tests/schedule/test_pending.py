"""The async-delivery pending queue of one level (seed 000, sections 3.2 and 4.2)."""

from __future__ import annotations

import random

import pytest

from chronomq.raftlog.clock import FakeClock
from chronomq.schedule.errors import ConfigError, ScheduleInternalError
from chronomq.schedule.pending import (
    MAX_PENDING_LIMIT_KEY,
    MAX_RESEND_NUM_TO_BLOCKED_KEY,
    AddResult,
    PendingConfig,
    PendingQueue,
    ProcessStatus,
    resend_backoff_ms,
)
from chronomq.schedule.planner import ScheduleEntry

T0_MS = 1_700_000_000_000
LEVEL = 4


def entry(queue_offset: int) -> ScheduleEntry:
    return ScheduleEntry(
        queue_offset=queue_offset,
        commitlog_offset=1_000 * queue_offset,
        size_bytes=256,
        deliver_ms=T0_MS,
    )


def queue_with(count: int, start: int = 0, **config: int) -> PendingQueue:
    pending = PendingQueue(LEVEL, start, PendingConfig(**config))
    for offset in range(start, start + count):
        assert pending.try_add(entry(offset)) is AddResult.ADDED
    return pending


def test_success_path_advances_offset_to_last_plus_one() -> None:
    """Seed 000 ``HandlePutResultTask``: SUCCESS -> updateOffset(nextOffset), remove."""
    pending = queue_with(3, start=10)
    assert pending.safe_offset == 10
    assert pending.next_offset == 13
    for offset in (10, 11, 12):
        assert pending.on_success(offset) is ProcessStatus.SUCCESS
    settled = pending.settle(T0_MS)
    assert settled.safe_offset == 13
    assert settled.advanced
    assert settled.delivered == 3
    assert settled.resends == ()
    assert settled.skipped == ()
    assert not settled.blocked
    assert len(pending) == 0


def test_settle_is_in_order_when_later_entries_finish_first() -> None:
    """Seed 000: the status loop peeks the head; RUNNING at the head stops it."""
    pending = queue_with(4)
    pending.on_success(3)
    pending.on_success(1)
    settled = pending.settle(T0_MS)
    assert settled.safe_offset == 0
    assert not settled.advanced
    assert settled.delivered == 0

    pending.on_success(0)
    settled = pending.settle(T0_MS)
    assert settled.safe_offset == 2
    assert settled.delivered == 2
    assert pending.status_of(2) is ProcessStatus.RUNNING

    pending.on_success(2)
    assert pending.settle(T0_MS).safe_offset == 4


def test_empty_settle_keeps_offset() -> None:
    pending = PendingQueue(LEVEL, 7)
    settled = pending.settle(T0_MS)
    assert (settled.safe_offset, settled.advanced, settled.next_resend_ms) == (7, False, None)


@pytest.mark.parametrize(
    ("resends_made", "wait_ms"),
    [(0, 0), (1, 100), (2, 200), (5, 500), (599, 59_900), (600, 60_000), (10_000, 60_000)],
)
def test_resend_backoff_values(resends_made: int, wait_ms: int) -> None:
    """Seed 000 ``resend``: ``Math.min(this.resendCount++ * 100, 60 * 1000)``."""
    assert resend_backoff_ms(resends_made, PendingConfig()) == wait_ms


def test_exception_is_resent_with_growing_backoff() -> None:
    clock = FakeClock(T0_MS)
    pending = queue_with(1)

    assert pending.on_failure(0, 1, clock.now_ms(), "timeout") is ProcessStatus.EXCEPTION
    first = pending.settle(clock.now_ms())
    assert len(first.resends) == 1
    resend = first.resends[0]
    assert (resend.attempt, resend.failures, resend.backoff_ms) == (2, 1, 0)
    assert resend.last_error == "timeout"
    assert resend.entry == entry(0)
    assert pending.status_of(0) is ProcessStatus.RUNNING

    pending.on_failure(0, 2, clock.now_ms(), "not leader")
    waiting = pending.settle(clock.now_ms())
    assert waiting.resends == ()
    assert waiting.next_resend_ms == clock.now_ms() + 100
    clock.advance(99)
    assert pending.settle(clock.now_ms()).resends == ()
    clock.advance(1)
    second = pending.settle(clock.now_ms())
    assert [(r.attempt, r.backoff_ms) for r in second.resends] == [(3, 100)]

    pending.on_failure(0, 3, clock.now_ms(), "timeout")
    assert pending.settle(clock.now_ms()).next_resend_ms == clock.now_ms() + 200


def test_block_after_three_failures_then_unblock_on_success() -> None:
    """Seed 000 ``asyncDeliver``: a message resent too often blocks its level until it goes
    through ("重试 3 次失败后，阻塞当前延迟等级对应的线程，直到重新投递成功")."""
    clock = FakeClock(T0_MS)
    pending = queue_with(2)

    for attempt in (1, 2):
        pending.on_failure(0, attempt, clock.now_ms(), "timeout")
        assert not pending.blocked
        clock.advance(1_000)
        assert [r.attempt for r in pending.settle(clock.now_ms()).resends] == [attempt + 1]
    assert pending.try_add(entry(2)) is AddResult.ADDED

    pending.on_failure(0, 3, clock.now_ms(), "timeout")
    assert pending.blocked
    assert pending.try_add(entry(3)) is AddResult.BLOCKED
    assert pending.next_offset == 3
    info = pending.blocking_entry()
    assert info is not None
    assert (info.entry.queue_offset, info.failures, info.last_error) == (0, 3, "timeout")

    clock.advance(1_000)
    settled = pending.settle(clock.now_ms())
    assert settled.blocked
    assert [r.attempt for r in settled.resends] == [4]
    assert pending.try_add(entry(3)) is AddResult.BLOCKED  # still in flight

    pending.on_success(0)
    assert not pending.blocked
    assert pending.blocking_entry() is None
    assert pending.try_add(entry(3)) is AddResult.ADDED
    pending.on_success(1)
    settled = pending.settle(clock.now_ms())
    assert not settled.blocked
    assert settled.safe_offset == 2

    stats = pending.stats()
    assert (stats.failures_total, stats.resends_total, stats.delivered_total) == (3, 3, 2)


def test_block_threshold_follows_config() -> None:
    pending = queue_with(1, max_resend_num_to_blocked=1)
    pending.on_failure(0, 1, T0_MS, "timeout")
    assert pending.blocked
    assert pending.try_add(entry(1)) is AddResult.BLOCKED


def test_a_failing_entry_behind_the_head_also_blocks() -> None:
    pending = queue_with(3, max_resend_num_to_blocked=1)
    pending.on_failure(2, 1, T0_MS, "timeout")
    assert pending.blocked
    info = pending.blocking_entry()
    assert info is not None and info.entry.queue_offset == 2


def test_every_failed_entry_past_its_backoff_is_resent_in_order() -> None:
    pending = queue_with(4)
    pending.on_failure(3, 1, T0_MS, "a")
    pending.on_failure(1, 1, T0_MS, "b")
    settled = pending.settle(T0_MS)
    assert [r.entry.queue_offset for r in settled.resends] == [1, 3]
    assert settled.safe_offset == 0


def test_stale_reports_are_ignored() -> None:
    pending = queue_with(1)
    pending.on_failure(0, 1, T0_MS, "timeout")
    pending.settle(T0_MS)  # resend, attempt 2 running
    assert pending.on_failure(0, 1, T0_MS, "late duplicate") is ProcessStatus.RUNNING
    assert pending.on_missing(0, 1, T0_MS) is ProcessStatus.RUNNING
    assert pending.stats().failures_total == 1


def test_late_success_of_an_earlier_attempt_counts() -> None:
    """A command reported failed (e.g. timed out) may still commit; it is then delivered."""
    pending = queue_with(1)
    pending.on_failure(0, 1, T0_MS, "timeout")
    assert pending.on_success(0) is ProcessStatus.SUCCESS
    settled = pending.settle(T0_MS)
    assert settled.resends == ()
    assert settled.safe_offset == 1


def test_reports_after_settling_are_ignored() -> None:
    pending = queue_with(1)
    pending.on_success(0)
    pending.settle(T0_MS)
    assert pending.on_success(0) is None
    assert pending.on_failure(0, 1, T0_MS, "x") is None
    assert pending.status_of(0) is None


def test_report_for_an_entry_never_added_is_an_internal_error() -> None:
    pending = queue_with(1)
    with pytest.raises(ScheduleInternalError, match="no delivery was added at offset 1"):
        pending.on_success(1)


def test_missing_message_is_skipped_after_six_tries() -> None:
    """Seed 000 ``resend``: not found in the CommitLog -> ``need2Skip() ? SKIP : EXCEPTION``."""
    clock = FakeClock(T0_MS)
    pending = queue_with(2)
    pending.on_success(1)
    for attempt in range(1, 6):
        assert pending.on_missing(0, attempt, clock.now_ms()) is ProcessStatus.EXCEPTION
        clock.advance(60_000)
        assert [r.attempt for r in pending.settle(clock.now_ms()).resends] == [attempt + 1]
    assert pending.blocked  # a missing message also counts as a failure

    assert pending.on_missing(0, 6, clock.now_ms()) is ProcessStatus.SKIP
    assert not pending.blocked
    settled = pending.settle(clock.now_ms())
    assert settled.safe_offset == 2
    assert settled.delivered == 1
    assert len(settled.skipped) == 1
    skipped = settled.skipped[0]
    assert skipped.entry == entry(0)
    assert "missing from the CommitLog" in skipped.reason
    assert "after 6 tries" in skipped.reason
    assert pending.stats().skips_total == 1


def test_full_queue_pushes_back_until_settled() -> None:
    """Seed 000 ``asyncDeliver`` flow control: the loop backs off and rescans."""
    pending = queue_with(3, max_pending_limit=3)
    assert pending.try_add(entry(3)) is AddResult.FULL
    assert pending.next_offset == 3  # the loop rescans from here
    assert len(pending) == 3

    pending.on_success(1)
    pending.settle(T0_MS)
    assert pending.try_add(entry(3)) is AddResult.FULL  # head still running

    pending.on_success(0)
    pending.settle(T0_MS)
    assert pending.try_add(entry(3)) is AddResult.ADDED
    assert pending.try_add(entry(4)) is AddResult.ADDED
    assert pending.try_add(entry(5)) is AddResult.FULL


def test_blocked_wins_over_full() -> None:
    pending = queue_with(1, max_pending_limit=1, max_resend_num_to_blocked=1)
    pending.on_failure(0, 1, T0_MS, "timeout")
    assert pending.try_add(entry(1)) is AddResult.BLOCKED


def test_entries_must_be_added_in_queue_order() -> None:
    pending = queue_with(2)
    with pytest.raises(ScheduleInternalError, match="expected offset 2, got 4"):
        pending.try_add(entry(4))
    with pytest.raises(ScheduleInternalError):
        pending.try_add(entry(1))


def test_skip_and_already_delivered_entries_settle_in_order() -> None:
    pending = PendingQueue(LEVEL, 0)
    assert pending.try_add_delivered(entry(0)) is AddResult.ADDED
    assert pending.try_add(entry(1)) is AddResult.ADDED
    assert pending.try_add_skip(entry(2), "no REAL_TOPIC") is AddResult.ADDED
    settled = pending.settle(T0_MS)
    assert settled.safe_offset == 1
    assert settled.delivered == 1

    pending.on_success(1)
    settled = pending.settle(T0_MS)
    assert settled.safe_offset == 3
    assert [s.reason for s in settled.skipped] == ["no REAL_TOPIC"]


def test_stats_for_metrics() -> None:
    pending = queue_with(4)
    pending.on_success(0)
    pending.on_failure(2, 1, T0_MS, "timeout")
    pending.settle(T0_MS + 10_000)  # pops 0, resends 2
    pending.on_failure(3, 1, T0_MS + 10_000, "timeout")
    stats = pending.stats()
    assert stats.level == LEVEL
    assert (stats.pending, stats.running, stats.failed) == (3, 2, 1)
    assert (stats.safe_offset, stats.next_offset) == (1, 4)
    assert (stats.added_total, stats.delivered_total) == (4, 1)
    assert (stats.failures_total, stats.resends_total, stats.skips_total) == (2, 1, 0)
    assert not stats.blocked


def test_config_errors_name_their_key() -> None:
    with pytest.raises(ConfigError) as caught:
        PendingConfig(max_pending_limit=0)
    assert caught.value.key == MAX_PENDING_LIMIT_KEY
    assert str(caught.value).startswith("schedule_async_deliver_max_pending_limit: ")
    with pytest.raises(ConfigError) as caught:
        PendingConfig(max_resend_num_to_blocked=0)
    assert caught.value.key == MAX_RESEND_NUM_TO_BLOCKED_KEY


def test_defaults_follow_rocketmq() -> None:
    config = PendingConfig()
    assert config.max_pending_limit == 2000
    assert config.max_resend_num_to_blocked == 3
    assert config.max_missing_tries == 6


@pytest.mark.parametrize("seed", range(200))
def test_random_completion_orders_never_pass_an_unsettled_entry(seed: int) -> None:
    """Whatever order completions arrive in, the safe offset is exactly the first offset not
    yet delivered or skipped, and every entry is delivered or skipped exactly once."""
    rng = random.Random(seed)
    clock = FakeClock(T0_MS)
    total = rng.randint(1, 60)
    pending = PendingQueue(
        LEVEL, 0, PendingConfig(max_pending_limit=rng.randint(1, 20), max_missing_tries=3)
    )
    attempt_of: dict[int, int] = {}
    finished: dict[int, ProcessStatus] = {}
    popped: list[int] = []
    next_to_add = 0
    for _step in range(5_000):
        if pending.safe_offset == total:
            break
        while next_to_add < total and rng.random() < 0.5:
            result = pending.try_add(entry(next_to_add))
            if result is not AddResult.ADDED:
                break
            attempt_of[next_to_add] = 1
            next_to_add += 1
        running = [
            o for o, a in attempt_of.items() if pending.status_of(o) is ProcessStatus.RUNNING
        ]
        if running:
            offset = rng.choice(running)
            roll = rng.random()
            if roll < 0.6:
                pending.on_success(offset)
                finished[offset] = ProcessStatus.SUCCESS
            elif roll < 0.85:
                pending.on_failure(offset, attempt_of[offset], clock.now_ms(), "boom")
            elif pending.on_missing(offset, attempt_of[offset], clock.now_ms()) is (
                ProcessStatus.SKIP
            ):
                finished[offset] = ProcessStatus.SKIP
        clock.advance(rng.randint(0, 300))
        settled = pending.settle(clock.now_ms())
        for resend in settled.resends:
            assert resend.attempt == attempt_of[resend.entry.queue_offset] + 1, f"seed={seed}"
            attempt_of[resend.entry.queue_offset] = resend.attempt
        first_popped = settled.safe_offset - settled.delivered - len(settled.skipped)
        popped.extend(range(first_popped, settled.safe_offset))
        for skipped in settled.skipped:
            assert skipped.entry.queue_offset in popped, f"seed={seed}"
            assert finished[skipped.entry.queue_offset] is ProcessStatus.SKIP, f"seed={seed}"
        first_open = next((o for o in range(total) if o not in finished), total)
        assert settled.safe_offset == min(first_open, next_to_add), f"seed={seed}"
    assert pending.safe_offset == total, f"seed={seed}: stuck at {pending.safe_offset}"
    assert popped == list(range(total)), f"seed={seed}"
    assert all(pending.status_of(o) is None for o in range(total)), f"seed={seed}"
