"""What the client raises.

Whose fault it is decides the class: :class:`RequestError` is the caller's (a 4xx answer: a
bad field, an unknown topic, a limit), retrying the same request will not help;
:class:`ServerError` and :class:`UnavailableError` are the cluster's (a 5xx answer that stayed
after the retries, or no node answering before the deadline).
"""

from __future__ import annotations

from typing import Any


class ChronomqError(Exception):
    """Base class of every error the client raises."""


class ApiError(ChronomqError):
    """A node answered with an error: ``{"error", "message", "field"}`` and its status."""

    def __init__(self, status: int, body: Any) -> None:
        self.status = status
        self.body = body
        fields = body if isinstance(body, dict) else {}
        code = fields.get("error")
        message = fields.get("message")
        field = fields.get("field")
        self.code: str = code if isinstance(code, str) else "error"
        self.message: str = message if isinstance(message, str) else str(body)
        self.field: str | None = field if isinstance(field, str) else None
        where = f" (field {self.field})" if self.field else ""
        super().__init__(f"HTTP {status} {self.code}: {self.message}{where}")


class RequestError(ApiError):
    """A 4xx answer: the request is at fault (bad input, unknown topic, a limit reached)."""


class ServerError(ApiError):
    """A 5xx (or 429) answer that was still given when the retries ran out."""


class UnavailableError(ChronomqError):
    """No node gave an answer before the deadline (connection refused, reset, timed out)."""


def api_error(status: int, body: Any) -> ApiError:
    """The exception for an error answer: :class:`RequestError` for 4xx but 429."""
    if 400 <= status < 500 and status != 429:
        return RequestError(status, body)
    return ServerError(status, body)
