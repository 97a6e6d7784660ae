"""Errors of the timer service, grouped by whose fault they are.

- :class:`TimerCallerError`: the request or the configuration is wrong (an HTTP 4xx, or a
  config key rejected at start). Each carries a stable ``code``, the ``field`` at fault (a
  request field or a config key, or ``None``) and the HTTP status to answer with.
- :class:`TimerCorruptionError`: bytes on disk are not what we wrote (bad checksum, bad magic,
  a chain pointing somewhere it must not). Never the caller's fault; an operator must look.
- :class:`TimerStateError`: the code using these objects broke a rule (a closed file, a
  position that was never handed out, a wheel lap going backwards): a bug, not bad input.
"""

from __future__ import annotations

from pathlib import Path


class TimerError(Exception):
    """Base of every error raised by ``timer``."""


class TimerCallerError(TimerError, ValueError):
    """Bad input from a client or a bad configuration value."""

    code: str = "timer_bad_request"
    http_status: int = 400

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field

    def to_dict(self) -> dict[str, str | None]:
        """The error body of the HTTP API: ``{"error", "message", "field"}``."""
        return {"error": self.code, "message": self.message, "field": self.field}


class InvalidTimerConfig(TimerCallerError):
    """A timer configuration value is out of range; ``field`` names the key."""

    code = "invalid_config"


class TimerConfigMismatch(InvalidTimerConfig):
    """Files on disk were written with a different configuration than the one given."""

    code = "timer_config_mismatch"


class InvalidDeliverTime(TimerCallerError):
    """A deliver time that can never be valid (negative, not an integer)."""

    code = "invalid_deliver_time"


class DelayTooLong(TimerCallerError):
    """The deliver time lies further ahead than ``timer_max_delay_s`` allows."""

    code = "timer_delay_too_long"


class SlotCongested(TimerCallerError):
    """The wheel slot the message falls into is too full; retry later or pick another time."""

    code = "timer_slot_congested"
    http_status = 429

    def __init__(self, message: str, *, slot_ms: int, count: int, limit: int, field: str | None):
        super().__init__(message, field=field)
        self.slot_ms = slot_ms
        self.count = count
        self.limit = limit


class TooManyTombstones(TimerCallerError):
    """The slot of the message to cancel already holds the most cancels it may hold."""

    code = "timer_too_many_cancels"
    http_status = 429

    def __init__(self, message: str, *, slot_ms: int, count: int, limit: int) -> None:
        super().__init__(message, field=None)
        self.slot_ms = slot_ms
        self.count = count
        self.limit = limit


class TimerCorruptionError(TimerError):
    """Data read from disk is damaged or inconsistent."""

    def __init__(self, message: str, *, path: Path | None = None, pos: int | None = None):
        where = []
        if path is not None:
            where.append(str(path))
        if pos is not None:
            where.append(f"position {pos}")
        super().__init__(f"{message} ({', '.join(where)})" if where else message)
        self.path = path
        self.pos = pos


class ChecksumMismatch(TimerCorruptionError):
    """A record's CRC32 does not match its bytes: a torn or damaged write."""


class BadMagic(TimerCorruptionError):
    """A record does not start with the magic of its kind, or has an unknown version."""


class ChainBroken(TimerCorruptionError):
    """A slot chain points to a record that is missing or belongs to another chain."""


class TimerStateError(TimerError, RuntimeError):
    """A rule of these objects was broken by the code using them."""


class StaleCursor(TimerStateError):
    """A dequeue was planned from a cursor the committed state has moved past (its slot's
    wheel cell already holds a later lap): plan again from the committed cursor."""
