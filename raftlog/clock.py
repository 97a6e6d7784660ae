"""Clocks in milliseconds.

Cores take ``now_ms`` as an argument; drivers read it from a :class:`Clock`. Tests drive a
:class:`FakeClock`, which, like trio's ``MockClock``, refuses to go backwards.
"""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def now_ms(self) -> int:
        """Wall-clock time in milliseconds since the Unix epoch."""
        ...

    def monotonic_ms(self) -> float:
        """A clock that never goes backwards, for measuring intervals."""
        ...


class SystemClock:
    """The real clocks of this machine."""

    def now_ms(self) -> int:
        return time.time_ns() // 1_000_000

    def monotonic_ms(self) -> float:
        return time.monotonic_ns() / 1_000_000


class ClockWentBackwards(ValueError):
    """A test tried to move a :class:`FakeClock` into the past."""


class FakeClock:
    """A clock that moves only when told to, and only forwards."""

    __slots__ = ("_now_ms",)

    def __init__(self, start_ms: int = 1_700_000_000_000) -> None:
        if start_ms < 0:
            raise ValueError(f"start_ms must be >= 0, got {start_ms}")
        self._now_ms = start_ms

    def now_ms(self) -> int:
        return self._now_ms

    def monotonic_ms(self) -> float:
        return float(self._now_ms)

    def advance(self, delta_ms: int) -> int:
        if delta_ms < 0:
            raise ClockWentBackwards(f"cannot advance by {delta_ms} ms")
        self._now_ms += delta_ms
        return self._now_ms

    def set(self, now_ms: int) -> None:
        if now_ms < self._now_ms:
            raise ClockWentBackwards(f"cannot go from {self._now_ms} back to {now_ms}")
        self._now_ms = now_ms


class SkewedClock(SystemClock):
    """The system clock moved by an offset read from a file: the drill's clock-skew fault.

    The file holds an integer number of milliseconds (``-3000``, ``+2500``); it is re-read at
    most every ``reread_ms``, and a missing or unreadable file means no skew. Only the wall
    clock moves (store times, due checks); Raft's timers keep the monotonic clock. Enabled by
    the environment variable ``CHRONOMQ_CLOCK_SKEW_FILE``. (libfaketime, the usual tool, hangs
    Python's threading waits on Debian 12 through its pthread_cond_timedwait interposer.)
    """

    def __init__(self, path: str, reread_ms: float = 200.0) -> None:
        self._path = path
        self._reread_ms = reread_ms
        self._offset_ms = 0
        self._read_at = -reread_ms

    def offset_ms(self) -> int:
        now = self.monotonic_ms()
        if now - self._read_at >= self._reread_ms:
            self._read_at = now
            try:
                with open(self._path) as f:
                    self._offset_ms = int(f.read().strip() or 0)
            except (OSError, ValueError):
                self._offset_ms = 0
        return self._offset_ms

    def now_ms(self) -> int:
        return super().now_ms() + self.offset_ms()
