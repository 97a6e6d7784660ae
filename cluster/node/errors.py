"""HTTP errors: every failure becomes ``{"error", "message", "field"}`` with a 4xx/5xx status."""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from chronomq.raftlog import errors as rl


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        field: str | None = None,
        headers: dict[str, str] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.field = field
        self.headers = headers or {}
        self.extra = extra or {}

    def response(self) -> web.Response:
        body = {"error": self.code, "message": self.message, "field": self.field, **self.extra}
        return web.Response(
            status=self.status,
            body=orjson.dumps(body, option=orjson.OPT_APPEND_NEWLINE),
            content_type="application/json",
            headers=self.headers,
        )


def bad_request(message: str, field: str | None = None, code: str = "invalid_input") -> ApiError:
    return ApiError(400, code, message, field)


def from_exception(exc: BaseException, leader_url: str | None = None) -> ApiError | None:
    """Map a domain exception to an API error, or None for an unexpected one."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, rl.MessageTooLarge):
        return ApiError(413, exc.code, str(exc), exc.field)
    if isinstance(exc, rl.UnknownTopic):
        return ApiError(404, exc.code, str(exc), exc.field)
    if isinstance(exc, rl.IdempotencyKeyReused):
        return ApiError(422, exc.code, str(exc), exc.field)
    if isinstance(exc, rl.InvalidInput):
        return ApiError(400, exc.code, str(exc), exc.field)
    if isinstance(exc, rl.ConditionFailed):
        return ApiError(409, exc.code, str(exc), None)
    if isinstance(exc, rl.Overloaded):
        return ApiError(429, exc.code, str(exc), None, {"Retry-After": "1"})
    if isinstance(exc, rl.NotLeader):
        extra = {"leader": leader_url} if leader_url else {}
        return ApiError(
            503,
            "no_leader" if not leader_url else exc.code,
            str(exc),
            None,
            {"Retry-After": "1"},
            extra,
        )
    if isinstance(exc, rl.CommitOutcomeUnknown):
        return ApiError(503, exc.code, str(exc), None, {"Retry-After": "1"})
    if isinstance(exc, rl.CommitTimeout | TimeoutError):
        return ApiError(
            503,
            "commit_timeout",
            "the write's outcome is unknown; retry with the same Idempotency-Key",
            None,
            {"Retry-After": "1"},
        )
    if isinstance(exc, rl.ReplicationError):
        return ApiError(503, exc.code, str(exc), None, {"Retry-After": "1"})
    for mod_error in _caller_error_types():
        if isinstance(exc, mod_error):
            code = getattr(exc, "code", "invalid_input")
            status = getattr(exc, "http_status", 400)
            return ApiError(status, code, str(exc), getattr(exc, "field", None))
    return None


def _caller_error_types() -> tuple[type[BaseException], ...]:
    from chronomq.schedule.errors import CallerError
    from chronomq.timer.errors import TimerCallerError

    return (CallerError, TimerCallerError)
