from __future__ import annotations

import random

import pytest

from chronomq.timer.config import TimerConfig
from chronomq.timer.enqueue import (
    EnqueueAction,
    EnqueuePlan,
    check_deliver_time,
    plan_enqueue,
    resolve_deliver_ms,
)
from chronomq.timer.errors import DelayTooLong, InvalidDeliverTime
from chronomq.timer.timerlog import RecordFlags
from tests.timer.helpers import GEOMETRY, T0, Harness

G = GEOMETRY  # 100 ms slots, 64 slots per lap (6.4 s), roll window 32 slots (3.2 s)
DAY_MS = 86_400_000


def plan(
    deliver_ms: int, now_ms: int = T0, cursor_ms: int = T0, tombstone: bool = False
) -> EnqueuePlan:
    return plan_enqueue(
        deliver_ms=deliver_ms,
        now_ms=now_ms,
        cursor_slot_ms=cursor_ms,
        geometry=G,
        tombstone=tombstone,
    )


def test_inside_the_roll_window_goes_into_its_slot() -> None:
    p = plan(T0 + 3_199)
    assert p.action is EnqueueAction.INTO_WHEEL
    assert p.slot_ms == T0 + 3_100
    assert p.flags is RecordFlags.NONE


def test_just_beyond_the_roll_window_rolls_to_the_last_slot_of_the_window() -> None:
    p = plan(T0 + 3_200)
    assert p.action is EnqueueAction.ROLL
    assert p.slot_ms == T0 + 3_100
    assert p.flags == RecordFlags.ROLLED
    assert p.deliver_ms == T0 + 3_200
    # the window counts whole slots from now's slot
    assert plan(T0 + 3_250, now_ms=T0 + 99).action is EnqueueAction.ROLL
    assert plan(T0 + 3_250, now_ms=T0 + 100).action is EnqueueAction.INTO_WHEEL


def test_already_due_but_unread_slot_goes_into_the_wheel() -> None:
    p = plan(T0 + 150, now_ms=T0 + 500, cursor_ms=T0)
    assert p.action is EnqueueAction.INTO_WHEEL
    assert p.slot_ms == T0 + 100


def test_slot_already_read_is_due_now() -> None:
    p = plan(T0 + 150, now_ms=T0 + 500, cursor_ms=T0 + 200)
    assert p.action is EnqueueAction.DUE_NOW
    assert p.slot_ms is None
    assert plan(0, cursor_ms=T0).action is EnqueueAction.DUE_NOW


def test_lagging_cursor_rolls_what_would_overwrite_an_unread_slot() -> None:
    cursor = T0 - 5_000  # lap of unread slots: [T0 - 5000, T0 + 1400)
    p = plan(T0 + 2_000, now_ms=T0, cursor_ms=cursor)
    assert p.action is EnqueueAction.ROLL
    assert p.slot_ms == T0 + 1_300  # the last slot of the unread lap
    assert plan(T0 + 1_399, now_ms=T0, cursor_ms=cursor).action is EnqueueAction.INTO_WHEEL


def test_cancel_keeps_its_tombstone_flag_when_rolling() -> None:
    assert plan(T0 + 100, tombstone=True).flags == RecordFlags.TOMBSTONE
    assert plan(T0 + 9_000, tombstone=True).flags == RecordFlags.TOMBSTONE | RecordFlags.ROLLED


def test_365_days_is_accepted_and_rolls_until_its_slot() -> None:
    config = TimerConfig()
    g = config.geometry
    deliver = T0 + 365 * DAY_MS - 77
    assert check_deliver_time(deliver, T0, config) == 365 * DAY_MS - 77
    now, cursor, rolls = T0, T0, 0
    while True:
        p = plan_enqueue(deliver_ms=deliver, now_ms=now, cursor_slot_ms=cursor, geometry=g)
        if p.action is EnqueueAction.INTO_WHEEL:
            break
        assert p.action is EnqueueAction.ROLL
        assert p.slot_ms is not None
        assert now < p.slot_ms < g.slot_ms(deliver)
        # the dequeue reaches the roll slot and puts the message back: enqueued again then
        now = cursor = p.slot_ms
        rolls += 1
    assert p.slot_ms == g.slot_ms(deliver)
    assert 365 <= rolls <= 367


def test_max_delay_boundary() -> None:
    config = TimerConfig()
    assert check_deliver_time(T0 + 365 * DAY_MS, T0, config) == 365 * DAY_MS
    with pytest.raises(DelayTooLong) as info:
        check_deliver_time(T0 + 365 * DAY_MS + 1, T0, config, field="delay_ms")
    assert info.value.field == "delay_ms"
    assert info.value.http_status == 400
    assert "timer_max_delay_s=31536000" in info.value.message
    assert info.value.to_dict() == {
        "error": "timer_delay_too_long",
        "message": info.value.message,
        "field": "delay_ms",
    }
    assert check_deliver_time(T0 - 10, T0, config) == 0  # the past: due at once
    with pytest.raises(InvalidDeliverTime):
        check_deliver_time(-1, T0, config)


def test_resolve_deliver_ms() -> None:
    assert resolve_deliver_ms(T0, deliver_at_ms=5) == 5
    assert resolve_deliver_ms(T0, delay_ms=250) == T0 + 250
    assert resolve_deliver_ms(T0, delay_sec=3) == T0 + 3_000
    with pytest.raises(InvalidDeliverTime):
        resolve_deliver_ms(T0)
    with pytest.raises(InvalidDeliverTime) as info:
        resolve_deliver_ms(T0, delay_ms=1, delay_sec=1)
    assert info.value.field == "delay_ms"
    with pytest.raises(InvalidDeliverTime) as info:
        resolve_deliver_ms(T0, delay_sec=-1)
    assert info.value.field == "delay_sec"


def test_plan_invariants_on_random_inputs() -> None:
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    for _ in range(20_000):
        cursor = G.slot_ms(T0 + rng.randint(-20_000, 1_000))
        now = T0 + rng.randint(-1_000, 1_000)
        deliver = now + rng.randint(-30_000, 60_000)
        p = plan(deliver, now_ms=now, cursor_ms=cursor)
        slot = G.slot_ms(deliver)
        context = f"seed={seed} cursor={cursor} now={now} deliver={deliver} -> {p}"
        if p.action is EnqueueAction.DUE_NOW:
            assert slot < cursor, context
            continue
        assert p.slot_ms is not None
        assert G.in_lap(p.slot_ms, cursor), context
        if p.action is EnqueueAction.INTO_WHEEL:
            assert p.slot_ms == slot and G.in_roll_window(deliver, now), context
        else:
            assert cursor <= p.slot_ms < slot, context


def test_enqueue_chains_records_into_the_wheel(harness: Harness) -> None:
    a = harness.produce("a", T0 + 250, T0)
    b = harness.produce("b", T0 + 299, T0)
    c = harness.produce("c", T0 + 9_999, T0)
    assert (a.pos, b.pos, c.pos) == (0, 80, 160)
    slot = harness.wheel.get(T0 + 200)
    assert (slot.first_pos, slot.last_pos, slot.count) == (0, 80, 2)
    assert harness.log.read(80).prev_pos == 0
    assert c.plan.action is EnqueueAction.ROLL
    assert harness.wheel.get(T0 + 3_100).last_pos == 160
