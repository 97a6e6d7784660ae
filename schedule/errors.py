"""Errors raised by the schedule cores, split by whose fault they are.

- :class:`CallerError`: the request was wrong (a negative delay level, an empty group). The HTTP
  layer answers 400 with ``{"error": code, "message": ..., "field": field}``.
- :class:`ConfigError`: the node's configuration is wrong. The node refuses to start, and the
  message names the key.
- :class:`ScheduleInternalError`: an invariant of the broker broke (a stored message lacks its
  real topic, a driver reported on an entry it never added). Never the client's fault: 5xx and a
  log line.
"""

from __future__ import annotations


class ScheduleError(Exception):
    """Base of every error raised by :mod:`chronomq.schedule`."""


class CallerError(ScheduleError):
    """Bad input from a client; maps to HTTP 400."""

    code: str = "bad_request"

    def __init__(self, message: str, *, field: str | None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field

    def as_error_body(self) -> dict[str, str | None]:
        """The JSON error body the HTTP API answers with."""
        return {"error": self.code, "message": self.message, "field": self.field}


class InvalidDelayLevel(CallerError):
    """A delay level that is negative or not an integer."""

    code = "invalid_delay_level"


class InvalidRetryRequest(CallerError):
    """A consumer retry request that cannot be honoured (bad group, count or topic)."""

    code = "invalid_retry"


class ConfigError(ScheduleError):
    """A configuration value is unusable; the message starts with the key's name."""

    def __init__(self, key: str, problem: str) -> None:
        super().__init__(f"{key}: {problem}")
        self.key = key
        self.problem = problem


class ScheduleInternalError(ScheduleError):
    """A broken invariant inside the broker (corrupt data or a driver bug)."""


class CorruptScheduleMessage(ScheduleInternalError):
    """A message in the schedule topic lacks what is needed to deliver it."""
