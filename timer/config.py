"""Settings of the timer service, named as the broker's configuration keys.

Field names are the keys (RocketMQ's names in snake_case where RocketMQ has one), so a node
can build this from its TOML/environment settings with ``TimerConfig(**timer_keys)``. A value
out of range raises :class:`~chronomq.timer.errors.InvalidTimerConfig` whose ``field`` is the key.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from chronomq.timer.errors import InvalidTimerConfig
from chronomq.timer.slots import SlotGeometry
from chronomq.timer.timerlog import RECORD_SIZE

DAY_SEC = 86_400
#: Wheel cells by default: two days at 100 ms (110 MB of sparse file).
DEFAULT_WHEEL_SLOTS = 1_728_000


DEFAULT_TIMER_LOG_SEGMENT_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class TimerConfig:
    #: Slot length; deliveries are at most this late plus processing (10..1000).
    timer_precision_ms: int = 100
    #: Cells in the wheel; one lap covers ``slots * precision`` (2 days at 100 ms).
    timer_wheel_slots: int = 1_728_000
    #: Messages due further than this many slots ahead roll (1 day at 100 ms).
    timer_roll_window_slots: int = 864_000
    #: Longest delay accepted at produce time (365 days).
    timer_max_delay_s: int = 365 * DAY_SEC
    #: A slot holding this many messages starts rejecting more (see :mod:`chronomq.timer.flow`).
    timer_congest_num_each_slot: int = 1_000_000
    #: Most cancels one slot may hold.
    timer_max_tombstones_each_slot: int = 100_000
    #: Size of a TimerLog segment file.
    timer_log_segment_bytes: int = DEFAULT_TIMER_LOG_SEGMENT_BYTES
    #: Most records handed out by one dequeue batch (one delivery command).
    timer_dequeue_batch_max: int = 512
    #: Most slots one dequeue batch may walk (bounds the work when catching up).
    timer_dequeue_scan_slots_max: int = 1_000
    #: Stop putting new timer messages into the wheel (runtime switch).
    timer_stop_enqueue: bool = False
    #: Stop delivering (runtime switch).
    timer_stop_dequeue: bool = False

    def __post_init__(self) -> None:
        for key in ("timer_precision_ms", "timer_wheel_slots", "timer_roll_window_slots"):
            _check_range(key, getattr(self, key), 1, 2**31 - 1)
        _ = self.geometry  # checks how precision, slot count and roll window fit together
        _check_range("timer_max_delay_s", self.timer_max_delay_s, 1, 10 * 365 * DAY_SEC)
        _check_range("timer_congest_num_each_slot", self.timer_congest_num_each_slot, 1, 2**31 - 1)
        _check_range(
            "timer_max_tombstones_each_slot", self.timer_max_tombstones_each_slot, 1, 10_000_000
        )
        _check_range("timer_log_segment_bytes", self.timer_log_segment_bytes, RECORD_SIZE, 2**30)
        _check_range("timer_dequeue_batch_max", self.timer_dequeue_batch_max, 1, 100_000)
        _check_range(
            "timer_dequeue_scan_slots_max",
            self.timer_dequeue_scan_slots_max,
            1,
            self.timer_wheel_slots,
        )
        for key in ("timer_stop_enqueue", "timer_stop_dequeue"):
            if not isinstance(getattr(self, key), bool):
                raise InvalidTimerConfig(f"{key} must be true or false", field=key)

    @property
    def geometry(self) -> SlotGeometry:
        return SlotGeometry(
            precision_ms=self.timer_precision_ms,
            slot_count=self.timer_wheel_slots,
            roll_window_slots=self.timer_roll_window_slots,
        )

    @property
    def max_delay_ms(self) -> int:
        return self.timer_max_delay_s * 1000


def _check_range(key: str, value: int, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise InvalidTimerConfig(
            f"{key} must be an integer within {low}..{high}, got {value!r}", field=key
        )


def timer_config_from(values: Mapping[str, Any]) -> TimerConfig:
    """The :class:`TimerConfig` of a node from its ``timer_*`` keys.

    The wheel holds ``max(2 days at 100 ms, 2 x roll window)`` slots, so a read cursor lagging
    behind ``now`` still has an unread lap in front of it for everything inside the window.
    """
    roll = int(values["timer_roll_window_slots"])
    slots = max(DEFAULT_WHEEL_SLOTS, 2 * roll)
    return TimerConfig(
        timer_precision_ms=int(values["timer_precision_ms"]),
        timer_wheel_slots=min(slots, 50_000_000),
        timer_roll_window_slots=roll,
        timer_max_delay_s=int(values["timer_max_delay_s"]),
        timer_congest_num_each_slot=min(int(values["timer_congest_num_each_slot"]), 2**31 - 1),
        timer_stop_enqueue=bool(values["timer_stop_enqueue"]),
        timer_stop_dequeue=bool(values["timer_stop_dequeue"]),
        timer_log_segment_bytes=int(
            values.get("timer_log_segment_bytes", DEFAULT_TIMER_LOG_SEGMENT_BYTES)
        ),
    )
