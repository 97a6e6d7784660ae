"""Slot arithmetic of the timer wheel: which slot a time falls in, where it sits, when it is due.

Time is cut into slots of ``precision_ms``. A slot is named by its *slot time*, the first
millisecond it covers (``floor(t / precision) * precision``), and holds every deliver time in
``[slot_ms, slot_ms + precision_ms)``. The wheel has ``slot_count`` cells, so slot ``s`` lives in
cell ``(s / precision) mod slot_count`` and that cell is reused one *lap* later, at
``s + window_ms`` with ``window_ms = slot_count * precision_ms``.

Rules the rest of the timer relies on:

- A slot is *due* once its last millisecond has come: ``slot_ms + precision_ms - 1 <= now_ms``.
  Reading it earlier could hand out a message before its deliver time.
- Slots the read cursor has not passed, ``[cursor, cursor + window_ms)``, occupy distinct cells;
  a slot at or beyond ``cursor + window_ms`` would overwrite an unread one and must roll instead.
- The roll window, ``roll_window_slots`` slots from the slot of ``now``, bounds how far ahead a
  message may be put into the wheel; further out it rolls (see :mod:`chronomq.timer.enqueue`).

Everything here is integer arithmetic on milliseconds: no clock is read.
"""

from __future__ import annotations

from dataclasses import dataclass

from chronomq.timer.errors import InvalidTimerConfig

MIN_PRECISION_MS = 10
MAX_PRECISION_MS = 1000
MIN_SLOT_COUNT = 4
MAX_SLOT_COUNT = 50_000_000


@dataclass(frozen=True, slots=True)
class SlotGeometry:
    """The shape of a wheel: slot length, cell count and roll window (both in slots)."""

    precision_ms: int = 100
    slot_count: int = 1_728_000
    roll_window_slots: int = 864_000

    def __post_init__(self) -> None:
        if not MIN_PRECISION_MS <= self.precision_ms <= MAX_PRECISION_MS:
            raise InvalidTimerConfig(
                f"timer_precision_ms must be within {MIN_PRECISION_MS}..{MAX_PRECISION_MS}, "
                f"got {self.precision_ms}",
                field="timer_precision_ms",
            )
        if not MIN_SLOT_COUNT <= self.slot_count <= MAX_SLOT_COUNT:
            raise InvalidTimerConfig(
                f"timer_wheel_slots must be within {MIN_SLOT_COUNT}..{MAX_SLOT_COUNT}, "
                f"got {self.slot_count}",
                field="timer_wheel_slots",
            )
        if not 2 <= self.roll_window_slots <= self.slot_count:
            raise InvalidTimerConfig(
                f"timer_roll_window_slots must be within 2..timer_wheel_slots "
                f"({self.slot_count}), got {self.roll_window_slots}",
                field="timer_roll_window_slots",
            )

    @property
    def window_ms(self) -> int:
        """Time covered by one lap of the wheel."""
        return self.slot_count * self.precision_ms

    @property
    def roll_window_ms(self) -> int:
        """How far ahead of ``now``'s slot a message may go into the wheel without rolling."""
        return self.roll_window_slots * self.precision_ms

    def slot_ms(self, time_ms: int) -> int:
        """The slot time of ``time_ms``: floored to the precision (also for negative times)."""
        return time_ms - time_ms % self.precision_ms

    def index(self, time_ms: int) -> int:
        """The wheel cell of the slot holding ``time_ms``."""
        return (time_ms // self.precision_ms) % self.slot_count

    def next_slot_ms(self, slot_ms: int) -> int:
        return self.slot_ms(slot_ms) + self.precision_ms

    def slot_last_ms(self, slot_ms: int) -> int:
        """The last millisecond a slot covers; the slot is due from then on."""
        return self.slot_ms(slot_ms) + self.precision_ms - 1

    def is_due(self, slot_ms: int, now_ms: int) -> bool:
        """True once every deliver time in the slot is at or before ``now_ms``."""
        return self.slot_last_ms(slot_ms) <= now_ms

    def in_roll_window(self, deliver_ms: int, now_ms: int) -> bool:
        """Whether ``deliver_ms`` falls less than ``roll_window_slots`` slots after now's slot."""
        return self.slot_ms(deliver_ms) < self.slot_ms(now_ms) + self.roll_window_ms

    def in_lap(self, slot_ms: int, cursor_slot_ms: int) -> bool:
        """Whether ``slot_ms`` is one of the unread slots ``[cursor, cursor + window)``.

        Those are the slots the wheel can hold at once without one overwriting another.
        """
        base = self.slot_ms(cursor_slot_ms)
        return base <= self.slot_ms(slot_ms) < base + self.window_ms

    def roll_slot_ms(self, now_ms: int, cursor_slot_ms: int) -> int:
        """Where a message that must roll waits: the last slot of the roll window from now,
        brought back inside the unread lap when the read cursor lags far behind ``now``."""
        base = self.slot_ms(cursor_slot_ms)
        wanted = self.slot_ms(now_ms) + (self.roll_window_slots - 1) * self.precision_ms
        return max(base, min(wanted, base + self.window_ms - self.precision_ms))

    def slots_between(self, first_slot_ms: int, last_slot_ms: int) -> int:
        """Number of slots from ``first`` to ``last`` inclusive (0 when last < first)."""
        span = self.slot_ms(last_slot_ms) - self.slot_ms(first_slot_ms)
        return span // self.precision_ms + 1 if span >= 0 else 0
