"""Values the client hands out and the JSON they are built from (no I/O here)."""

from __future__ import annotations

import base64
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

RETRY_TOPIC_PREFIX = "%RETRY%"
"""Topic a group's sent-back messages come back through: ``%RETRY%{group}``."""
DLQ_TOPIC_PREFIX = "%DLQ%"
"""Where a message goes after ``max_reconsume_times`` send-backs: ``%DLQ%{group}``."""
_RETRY_TOPIC_PROPERTY = "RETRY_TOPIC"
_ORIGIN_MESSAGE_ID_PROPERTY = "ORIGIN_MESSAGE_ID"


def retry_topic(group: str) -> str:
    return RETRY_TOPIC_PREFIX + group


@dataclass(frozen=True, slots=True)
class SendResult:
    """Where a produced message was stored, once a majority has it.

    A delayed message is stored in the schedule or timer topic first (``topic``, ``queue`` and
    ``offset`` say where); ``deliver_ms`` is when it is due and ``delay_level`` the level used
    (``clamped`` when the level asked for was above the maximum)."""

    msg_id: str
    topic: str
    queue: int
    offset: int
    delay_level: int | None = None
    deliver_ms: int | None = None
    clamped: bool = False
    duplicate: bool = False
    """The node had already stored this batch under its idempotency key (a retried request)."""

    @classmethod
    def from_json(cls, r: Mapping[str, Any], duplicate: bool) -> SendResult:
        return cls(
            msg_id=str(r["msg_id"]),
            topic=str(r["topic"]),
            queue=int(r["queue"]),
            offset=int(r["offset"]),
            delay_level=r.get("delay_level"),
            deliver_ms=r.get("deliver_ms"),
            clamped=bool(r.get("clamped", False)),
            duplicate=duplicate,
        )


@dataclass(frozen=True, slots=True)
class CancelResult:
    """The answer to cancelling a timer: ``cancelled`` (it will never be delivered),
    ``delivered`` (too late) or ``unknown``."""

    msg_id: str
    status: str
    reason: str | None = None
    deliver_ms: int | None = None

    @classmethod
    def from_json(cls, msg_id: str, r: Mapping[str, Any]) -> CancelResult:
        return cls(
            msg_id=str(r.get("msg_id") or msg_id),
            status=str(r["status"]),
            reason=r.get("reason"),
            deliver_ms=r.get("deliver_ms"),
        )


@dataclass(frozen=True, slots=True)
class MessageData:
    """A consumed message as stored: ``topic``/``queue``/``offset`` say where it was read.

    A message sent back with ``reconsume_later()`` is read again from the group's retry topic
    ``%RETRY%{group}`` as a new record; :attr:`origin_topic` and :attr:`origin_msg_id` name the
    message it started as."""

    msg_id: str
    topic: str
    queue: int
    offset: int
    body: bytes
    keys: tuple[str, ...] = ()
    tags: str | None = None
    properties: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    born_ms: int = 0
    store_ms: int = 0
    reconsume_times: int = 0

    @property
    def text(self) -> str:
        """The body decoded as UTF-8."""
        return self.body.decode()

    @property
    def is_retry(self) -> bool:
        """Read from a retry topic: a message sent back earlier."""
        return self.topic.startswith(RETRY_TOPIC_PREFIX)

    @property
    def origin_topic(self) -> str:
        """The topic the message was first produced to (for a retried one, not the retry topic)."""
        return (
            self.properties.get(_RETRY_TOPIC_PROPERTY, self.topic) if self.is_retry else self.topic
        )

    @property
    def origin_msg_id(self) -> str:
        """The ``msg_id`` the message was first stored under (a retried copy has its own)."""
        return self.properties.get(_ORIGIN_MESSAGE_ID_PROPERTY) or self.msg_id


def message_fields(m: Mapping[str, Any]) -> dict[str, Any]:
    """The keyword arguments of :class:`MessageData` from one message of a pull answer."""
    raw = m.get("body")
    if isinstance(raw, str):
        body = raw.encode()
    else:
        b64 = m.get("body_base64")
        body = base64.b64decode(b64) if isinstance(b64, str) else b""
    tags = m.get("tags")
    return {
        "msg_id": str(m["msg_id"]),
        "topic": str(m["topic"]),
        "queue": int(m["queue"]),
        "offset": int(m["offset"]),
        "body": body,
        "keys": tuple(m.get("keys") or ()),
        "tags": tags if isinstance(tags, str) else None,
        "properties": MappingProxyType(dict(m.get("properties") or {})),
        "born_ms": int(m.get("born_ms") or 0),
        "store_ms": int(m.get("store_ms") or 0),
        "reconsume_times": int(m.get("reconsume_times") or 0),
    }


def produce_message(
    body: str | bytes,
    *,
    keys: Iterable[str] | str | None = None,
    tags: str | None = None,
    properties: Mapping[str, str] | None = None,
    queue: int | None = None,
    delay_level: int | None = None,
    delay_ms: int | None = None,
    deliver_at_ms: int | None = None,
) -> dict[str, Any]:
    """One message of a produce request. At most one of the three delay options; a bytes body
    that is not UTF-8 travels as ``body_base64``."""
    delays = [
        name
        for name, v in (
            ("delay_level", delay_level),
            ("delay_ms", delay_ms),
            ("deliver_at_ms", deliver_at_ms),
        )
        if v is not None
    ]
    if len(delays) > 1:
        raise ValueError(f"give at most one of delay_level, delay_ms, deliver_at_ms, not {delays}")
    m: dict[str, Any] = {}
    if isinstance(body, str):
        m["body"] = body
    elif isinstance(body, bytes | bytearray | memoryview):
        raw = bytes(body)
        try:
            m["body"] = raw.decode()
        except UnicodeDecodeError:
            m["body_base64"] = base64.b64encode(raw).decode()
    else:
        raise TypeError(f"body must be str or bytes, not {type(body).__name__}")
    if keys is not None:
        m["keys"] = [keys] if isinstance(keys, str) else list(keys)
    if tags is not None:
        m["tags"] = tags
    if properties:
        m["properties"] = dict(properties)
    if queue is not None:
        m["queue"] = queue
    if delay_level is not None:
        m["delay_level"] = delay_level
    if delay_ms is not None:
        m["delay_ms"] = delay_ms
    if deliver_at_ms is not None:
        m["deliver_at_ms"] = deliver_at_ms
    return m
