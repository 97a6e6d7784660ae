from __future__ import annotations

from pathlib import Path

from chronomq.timer.cancel import CancelStatus
from tests.timer.helpers import T0, Harness


def test_cancel_before_delivery_is_never_delivered(harness: Harness) -> None:
    harness.produce("a", T0 + 1_150, T0)
    harness.produce("b", T0 + 1_150, T0)
    decision = harness.cancel("a", T0 + 500)
    assert decision.status is CancelStatus.CANCELLED
    assert decision.write_tombstone
    assert harness.wheel.get(T0 + 1_100).tomb_count == 1
    harness.run_until(T0 + 5_000)
    assert harness.delivered_keys() == ["b"]
    assert harness.suppressed == ["a"]


def test_cancel_after_delivery_says_delivered(harness: Harness) -> None:
    harness.produce("a", T0 + 150, T0)
    harness.run_until(T0 + 300)
    decision = harness.cancel("a", T0 + 300)
    assert decision.status is CancelStatus.DELIVERED
    assert not decision.write_tombstone
    assert harness.delivered_keys() == ["a"]


def test_cancel_twice_says_cancelled_both_times(harness: Harness) -> None:
    harness.produce("a", T0 + 150, T0)
    assert harness.cancel("a", T0 + 10).status is CancelStatus.CANCELLED
    second = harness.cancel("a", T0 + 20)
    assert second.status is CancelStatus.CANCELLED and not second.write_tombstone
    harness.run_until(T0 + 1_000)
    assert harness.cancel("a", T0 + 1_000).status is CancelStatus.CANCELLED  # slot read since
    assert harness.delivered_keys() == []


def test_cancel_inside_a_slot_being_read(tmp_path: Path) -> None:
    h = Harness(tmp_path, max_records=2)
    for key in ("a", "b", "c", "d"):
        h.produce(key, T0 + 150, T0)
    h.apply(h.plan(T0 + 200), T0 + 200)  # d and c handed out, cursor inside the slot
    assert h.delivered_keys() == ["d", "c"]
    assert h.cancel("c", T0 + 200).status is CancelStatus.DELIVERED
    assert h.cancel("a", T0 + 200).status is CancelStatus.CANCELLED
    h.run_until(T0 + 300)
    assert h.delivered_keys() == ["d", "c", "b"]
    h.close()


def test_cancel_of_a_message_still_rolling(harness: Harness) -> None:
    harness.produce("far", T0 + 20_000, T0)  # rolls several times
    harness.produce("other", T0 + 20_000, T0)
    assert harness.cancel("far", T0 + 100).status is CancelStatus.CANCELLED
    now = T0 - 1
    while now < T0 + 21_000:
        now += 100
        harness.run_until(now)
    assert harness.delivered_keys() == ["other"]
    assert harness.suppressed == ["far"]
    assert harness.reput >= 6  # the message and its cancel both rolled


def test_cancel_stored_before_its_rolled_target_reaches_the_slot(harness: Harness) -> None:
    harness.produce("t", T0 + 5_000, T0)  # rolls to T0+3100, reaches its slot later
    assert harness.cancel("t", T0 + 2_000).status is CancelStatus.CANCELLED
    slot = harness.wheel.get(T0 + 5_000)
    assert slot.tomb_count == 1 and slot.count == 0  # the cancel came first
    now = T0 - 1
    while now < T0 + 6_000:
        now += 100
        harness.run_until(now)
    assert harness.delivered_keys() == []
    assert harness.suppressed == ["t"]


def test_unknown_when_the_slot_is_gone_or_the_target_is_not_there(harness: Harness) -> None:
    harness.produce("a", T0 + 150, T0)
    harness.run_until(T0 + 3_500)
    # a message for the same wheel cell one lap later takes the cell over
    harness.produce("z", T0 + 150 + harness.geometry.window_ms, T0 + 3_400)
    assert harness.cancel("a", T0 + 3_500).status is CancelStatus.UNKNOWN
    harness.deliver_at["ghost"] = T0 + 3_550
    harness.produce("b", T0 + 3_550, T0 + 3_400)
    harness.produce("c", T0 + 3_550, T0 + 3_400)
    harness.planner = type(harness.planner)(harness.geometry, max_records=1)
    harness.apply(harness.plan(T0 + 3_600), T0 + 3_600)
    assert harness.cursor.started
    assert harness.cancel("ghost", T0 + 3_600).status is CancelStatus.UNKNOWN


def test_unknown_when_more_than_a_lap_old(harness: Harness) -> None:
    harness.produce("a", T0 + 150, T0)
    harness.run_until(T0 + 7_000)
    assert harness.cancel("a", T0 + 7_000).status is CancelStatus.UNKNOWN


def test_cancel_status_values_are_the_api_strings() -> None:
    assert [s.value for s in CancelStatus] == ["cancelled", "delivered", "unknown"]
