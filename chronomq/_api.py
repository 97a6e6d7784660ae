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
    node: str | None = None
    """Send every attempt to this node URL (one node's own view); any node when None."""
    attempts: int | None = None
    """At most this many attempts (see :class:`chronomq._wire.Attempts`); None: until the
    deadline."""
    timeout_s: float | None = None
    """How long one attempt may take; None: the client's ``request_timeout_s`` (plus
    ``wait_ms``)."""


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
    topic: str,
    queue: int,
    offset: int,
    max_messages: int,
    wait_ms: int,
    prev: str | None = None,
    node: str | None = None,
) -> Req:
    """A page from ``offset``. With ``prev``, the msg_id read at ``offset - 1``, a node whose
    log no longer holds it there answers 409 ``offset_diverged`` (the log was rewound)."""
    return Req(
        "GET",
        path("v1", "topics", topic, "queues", queue, "messages")
        + query(offset=offset, max=max_messages, wait_ms=wait_ms, prev=prev),
        wait_ms=wait_ms,
        node=node,
    )


def describe_topic(topic: str) -> Req:
    return Req("GET", path("v1", "topics", topic))


def list_topics() -> Req:
    return Req("GET", "/v1/topics")


def create_topic(topic: str, queues: int) -> Req:
    return Req("PUT", path("v1", "topics", topic), {"queues": queues}, write=True)


def group_offsets(group: str, topic: str | None, node: str | None = None) -> Req:
    """The group's committed offsets (of every topic when ``topic`` is None)."""
    target = path("v1", "groups", group, "offsets") + query(topic=topic or None)
    return Req("GET", target, node=node)


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


# ---------------------------------------------------------------------- admin


def schedule_status(node: str | None = None) -> Req:
    """The schedule service's levels, mode and pause switch (``node``'s view)."""
    return Req("GET", "/v1/admin/schedule", node=node)


def set_schedule(mode: str | None, paused: bool | None) -> Req:
    body = {k: v for k, v in (("mode", mode), ("paused", paused)) if v is not None}
    return Req("PATCH", "/v1/admin/schedule", body, write=True)


def timer_status(node: str | None = None) -> Req:
    return Req("GET", "/v1/admin/timer", node=node)


def timer_switches(stop_enqueue: bool | None, stop_dequeue: bool | None) -> Req:
    pairs = (("stop_enqueue", stop_enqueue), ("stop_dequeue", stop_dequeue))
    return Req(
        "POST", "/v1/admin/timer/switches", {k: v for k, v in pairs if v is not None}, write=True
    )


def cluster_view(node: str | None = None) -> Req:
    return Req("GET", "/v1/admin/cluster", node=node)


def node_status(node: str | None = None) -> Req:
    return Req("GET", "/v1/admin/node", node=node)


def config() -> Req:
    return Req("GET", "/v1/admin/config")


def patch_config(changes: Mapping[str, Any]) -> Req:
    return Req("PATCH", "/v1/admin/config", dict(changes), write=True)


def transfer_leadership(to: int | None, timeout_ms: int | None) -> Req:
    body: dict[str, Any] = {"to": to} if to is not None else {}
    if timeout_ms is not None:
        body["timeout_ms"] = timeout_ms
    return Req("POST", "/v1/admin/leadership/transfer", body, write=True)
