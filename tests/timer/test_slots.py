from __future__ import annotations

import pytest

from chronomq.timer.config import TimerConfig
from chronomq.timer.errors import InvalidTimerConfig
from chronomq.timer.slots import SlotGeometry

G = SlotGeometry(precision_ms=100, slot_count=10, roll_window_slots=4)


def test_slot_time_floors_to_the_precision() -> None:
    assert G.slot_ms(1_000) == 1_000
    assert G.slot_ms(1_099) == 1_000
    assert G.slot_ms(1_100) == 1_100
    assert G.slot_ms(0) == 0
    assert G.slot_ms(-1) == -100


def test_index_wraps_after_slot_count() -> None:
    assert G.window_ms == 1_000
    assert G.index(0) == 0
    assert G.index(900) == 9
    assert G.index(999) == 9
    assert G.index(1_000) == 0  # one lap later, same cell
    assert G.index(1_099) == 0
    assert G.index(12_345) == 3
    assert G.index(-100) == 9


def test_a_slot_is_due_only_at_its_last_millisecond() -> None:
    assert G.slot_last_ms(1_000) == 1_099
    assert not G.is_due(1_000, 1_098)
    assert G.is_due(1_000, 1_099)
    assert G.is_due(1_000, 5_000)
    assert G.next_slot_ms(1_000) == 1_100
    assert G.next_slot_ms(1_050) == 1_100


def test_roll_window_counts_slots_from_now() -> None:
    now = 1_050  # slot 1_000; window of 4 slots: 1_000 .. 1_399
    assert G.roll_window_ms == 400
    assert G.in_roll_window(1_000, now)
    assert G.in_roll_window(1_399, now)
    assert not G.in_roll_window(1_400, now)
    assert G.in_roll_window(0, now)  # the past is inside


def test_lap_covers_one_window_from_the_cursor() -> None:
    assert G.in_lap(2_000, 2_000)
    assert G.in_lap(2_999, 2_000)
    assert not G.in_lap(3_000, 2_000)  # would overwrite the cursor's own cell
    assert not G.in_lap(1_900, 2_000)
    assert G.index(3_000) == G.index(2_000)


def test_roll_slot_is_the_last_of_the_roll_window_within_the_lap() -> None:
    assert G.roll_slot_ms(now_ms=1_050, cursor_slot_ms=1_000) == 1_300
    # cursor far behind now: clamped to the last unread slot of the lap
    assert G.roll_slot_ms(now_ms=50_050, cursor_slot_ms=1_000) == 1_900
    # now behind the cursor (another leader's clock): never before the cursor
    assert G.roll_slot_ms(now_ms=0, cursor_slot_ms=1_000) == 1_000


def test_slots_between() -> None:
    assert G.slots_between(1_000, 1_000) == 1
    assert G.slots_between(1_000, 1_900) == 10
    assert G.slots_between(1_000, 900) == 0


@pytest.mark.parametrize("precision", [10, 100, 1000])
def test_precision_bounds_accepted(precision: int) -> None:
    assert (
        SlotGeometry(precision_ms=precision, slot_count=8, roll_window_slots=2).precision_ms
        == precision
    )


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"precision_ms": 9}, "timer_precision_ms"),
        ({"precision_ms": 1001}, "timer_precision_ms"),
        ({"slot_count": 3}, "timer_wheel_slots"),
        ({"slot_count": 8, "roll_window_slots": 9}, "timer_roll_window_slots"),
        ({"slot_count": 8, "roll_window_slots": 1}, "timer_roll_window_slots"),
    ],
)
def test_bad_geometry_names_the_key(kwargs: dict[str, int], field: str) -> None:
    with pytest.raises(InvalidTimerConfig) as info:
        SlotGeometry(**kwargs)
    assert info.value.field == field
    assert field in str(info.value)


def test_config_defaults_and_keys() -> None:
    config = TimerConfig()
    assert config.timer_precision_ms == 100
    assert config.max_delay_ms == 365 * 86_400_000
    assert config.geometry.window_ms == 2 * 86_400_000
    assert config.geometry.roll_window_ms == 86_400_000
    with pytest.raises(InvalidTimerConfig) as info:
        TimerConfig(timer_congest_num_each_slot=0)
    assert info.value.field == "timer_congest_num_each_slot"
    assert info.value.to_dict()["error"] == "invalid_config"
    with pytest.raises(InvalidTimerConfig) as info:
        TimerConfig(timer_precision_ms=5)
    assert info.value.field == "timer_precision_ms"
    with pytest.raises(InvalidTimerConfig) as info:
        TimerConfig(timer_stop_dequeue="yes")  # type: ignore[arg-type]
    assert info.value.field == "timer_stop_dequeue"
