from __future__ import annotations

import random

import pytest

from chronomq.timer.errors import SlotCongested, TooManyTombstones
from chronomq.timer.flow import (
    RateMeter,
    check_cancel_room,
    check_congestion,
    rejection_probability,
)
from chronomq.timer.wheel import Slot

LIMIT = 100


def slot(count: int, tombs: int = 0) -> Slot:
    return Slot(1_700_000_000_100, 0, 80 if count else -1, count, -1, tombs)


def test_below_the_limit_never_rejects() -> None:
    for count in range(LIMIT):
        assert rejection_probability(count, LIMIT) == 0.0
        check_congestion(slot(count), LIMIT, draw=0.0)


def test_a_full_slot_starts_rejecting_and_rejects_all_from_twice_the_limit() -> None:
    assert rejection_probability(LIMIT, LIMIT) == pytest.approx(1 / LIMIT)
    assert rejection_probability(2 * LIMIT - 1, LIMIT) == 1.0
    assert rejection_probability(10 * LIMIT, LIMIT) == 1.0
    with pytest.raises(SlotCongested):
        check_congestion(slot(2 * LIMIT), LIMIT, draw=0.999)


def test_rejection_never_falls_as_the_slot_fills() -> None:
    previous = 0.0
    for count in range(3 * LIMIT):
        p = rejection_probability(count, LIMIT)
        assert p >= previous
        previous = p


def test_for_one_draw_a_fuller_slot_rejects_whenever_an_emptier_one_does() -> None:
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    for _ in range(2_000):
        draw = rng.random()
        low, high = sorted(rng.randrange(3 * LIMIT) for _ in range(2))
        rejected = []
        for count in (low, high):
            try:
                check_congestion(slot(count), LIMIT, draw)
                rejected.append(False)
            except SlotCongested:
                rejected.append(True)
        assert rejected[1] or not rejected[0], f"seed={seed} draw={draw} counts={low},{high}"


def test_rejection_rate_grows_with_congestion() -> None:
    rng = random.Random(7)

    def rate(count: int) -> float:
        rejected = 0
        for _ in range(4_000):
            try:
                check_congestion(slot(count), LIMIT, rng.random())
            except SlotCongested:
                rejected += 1
        return rejected / 4_000

    rates = [rate(c) for c in (LIMIT - 1, LIMIT + 10, LIMIT + 50, LIMIT + 90, 2 * LIMIT)]
    assert rates == sorted(rates)
    assert rates[0] == 0.0 and rates[-1] == 1.0


def test_congestion_error_says_which_slot_and_why() -> None:
    with pytest.raises(SlotCongested) as info:
        check_congestion(slot(250), LIMIT, draw=0.5, field="deliver_at_ms")
    err = info.value
    assert (err.slot_ms, err.count, err.limit) == (1_700_000_000_100, 250, LIMIT)
    assert err.http_status == 429
    assert "1700000000100" in err.message and "timer_congest_num_each_slot=100" in err.message
    assert err.to_dict()["error"] == "timer_slot_congested"
    assert err.to_dict()["field"] == "deliver_at_ms"


def test_cancel_room() -> None:
    check_cancel_room(slot(0, tombs=9), 10)
    with pytest.raises(TooManyTombstones) as info:
        check_cancel_room(slot(0, tombs=10), 10)
    assert info.value.http_status == 429


def test_rate_meter_over_a_sliding_window() -> None:
    meter = RateMeter(window_ms=10_000, buckets=10)
    t = 1_700_000_000_000
    for i in range(100):
        meter.add(t + i * 100)  # 10 per second for 10 s
    assert meter.total == 100
    assert meter.rate_per_s(t + 9_999) == pytest.approx(10.0)
    assert meter.rate_per_s(t + 15_000) == pytest.approx(4.0)  # the first 5 s fell out
    assert meter.rate_per_s(t + 60_000) == 0.0
    meter.add(t + 5, 50)  # a clock that stepped back counts as the latest time seen
    assert meter.rate_per_s(t + 60_000) == pytest.approx(5.0)
    assert meter.total == 150
    with pytest.raises(ValueError):
        RateMeter(window_ms=1_000, buckets=3)
