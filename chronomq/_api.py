"""The HTTP routes the client uses, as request values (no I/O): one place for every path."""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from chronomq._model import CancelResult, SendResult
from chronomq._wire import path, query


@dataclass(frozen=True, slots=True)
class Req:
    """One API request: a transport's ``call(req)`` sends it."""

    method: str
    target: str
    json: Any = None
    headers: Mapping[str, str] = field(default_factory=dict)
    write: bool = False
    wait_ms: int = 0


def new_idempotency_key() -> str:
    return uuid.uuid4().hex


def produce(topic: str, messages: Sequence[Mapping[str, Any]], idempotency_key: str) -> Req:
    """A batch for one topic. The key is chosen once per batch and sent with every retry of
    it, so a batch whose first answer was lost is stored once."""
    return Req(
        "POST",
        path("v1", "topics", topic, "messages"),
        {"messages": list(messages)},
        {"Idempotency-Key": idempotency_key},
        write=True,
    )


def send_results(answer: Mapping[str, Any]) -> list[SendResult]:
    duplicate = bool(answer.get("duplicate", False))
    return [SendResult.from_json(r, duplicate) for r in answer["results"]]


def pull(
    topic: str, queue: int, offset: int, max_messages: int, wait_ms: int, prev: str | None = None
) -> Req:
    """A page from ``offset``. With ``prev``, the msg_id read at ``offset - 1``, a node whose
    log no longer holds it there answers 409 ``offset_diverged`` (the log was rewound)."""
    return Req(
        "GET",
        path("v1", "topics", topic, "queues", queue, "messages")
        + query(offset=offset, max=max_messages, wait_ms=wait_ms, prev=prev),
        wait_ms=wait_ms,
    )


def describe_topic(topic: str) -> Req:
    return Req("GET", path("v1", "topics", topic))


def group_offsets(group: str, topic: str) -> Req:
    return Req("GET", path("v1", "groups", group, "offsets") + query(topic=topic))


def commit_offset(group: str, topic: str, queue: int, offset: int) -> Req:
    return Req(
        "PUT",
        path("v1", "groups", group, "offsets"),
        {"topic": topic, "queue": queue, "offset": offset},
        write=True,
    )


def send_back(group: str, topic: str, queue: int, offset: int, delay_level: int) -> Req:
    body: dict[str, Any] = {"topic": topic, "queue": queue, "offset": offset}
    if delay_level:
        body["delay_level"] = delay_level
    return Req("POST", path("v1", "groups", group, "retry"), body, write=True)


def cancel_timer(msg_id: str) -> Req:
    return Req("DELETE", path("v1", "timers", msg_id), write=True)


def cancel_result(msg_id: str, answer: Mapping[str, Any]) -> CancelResult:
    return CancelResult.from_json(msg_id, answer)
