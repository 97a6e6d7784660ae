"""Pulls: pages bounded in bytes, read off the event loop, and long-poll waiters per queue.

A page holds messages until the next would take the JSON answer past ``max_pull_bytes``, and
always at least one. Each message is encoded once, where it is read: a page whose records add
up to more than :data:`INLINE_READ_BYTES` is read and encoded on the pull executor (a few
threads), so a pull of large bodies does not hold the event loop while the disk answers.

:class:`QueueWaiters` keeps one future per (topic, queue) that long-polls wait on; an applied
command wakes the queues it wrote to, not every waiter.
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import orjson

from chronomq.raftlog import record
from chronomq.raftlog.consumequeue import CqUnit

#: A page whose records are larger than this is read on the pull executor, not on the loop.
INLINE_READ_BYTES = 64 * 1024
#: Threads reading large pages; more pulls than this wait their turn (each holds a connection,
#: and connections are capped).
READ_THREADS = 4
#: ``{"messages":[`` ... ``],"next_offset":N,"max_offset":M}`` around the messages.
_ENVELOPE_BYTES = 64


def message_json(m: record.Message) -> dict[str, Any]:
    props = dict(m.properties)
    keys = props.pop(record.PROPERTY_KEYS, "")
    tags = props.pop(record.PROPERTY_TAGS, None)
    out: dict[str, Any] = {
        "msg_id": m.msg_id_hex,
        "topic": m.topic,
        "queue": m.queue_id,
        "offset": m.queue_offset,
        "keys": keys.split(" ") if keys else [],
        "tags": tags,
        "properties": props,
        "born_ms": m.born_ms,
        "store_ms": m.store_ms,
        "reconsume_times": m.reconsume_times,
    }
    try:
        out["body"] = m.body.decode()
    except UnicodeDecodeError:
        out["body"] = None
        out["body_base64"] = base64.b64encode(m.body).decode()
    return out


class _Reader(Protocol):
    def read_message(self, at: int, size: int | None = None) -> record.Message: ...


@dataclass(frozen=True, slots=True)
class PullPage:
    """Messages already encoded as JSON objects, and where the next pull starts."""

    messages: tuple[bytes, ...]
    next_offset: int

    @property
    def size_bytes(self) -> int:
        return sum(len(m) for m in self.messages) + len(self.messages)

    def answer(self, max_offset: int) -> bytes:
        """The JSON answer: ``{"messages": [...], "next_offset", "max_offset"}``."""
        return b"".join(
            (
                b'{"messages":[',
                b",".join(self.messages),
                b'],"next_offset":%d,"max_offset":%d}\n' % (self.next_offset, max_offset),
            )
        )


def plan_units(units: Iterable[CqUnit], max_bytes: int) -> list[CqUnit]:
    """The units worth reading for a page of at most ``max_bytes``: while their records fit,
    plus one (its JSON may be smaller than its record), and always at least one."""
    out: list[CqUnit] = []
    total = _ENVELOPE_BYTES
    for u in units:
        out.append(u)
        total += u.size
        if total > max_bytes:
            break
    return out


def read_page(reader: _Reader, units: list[CqUnit], offset: int, max_bytes: int) -> PullPage:
    """Read and encode ``units`` until the answer would pass ``max_bytes`` (at least one).

    Blocking (disk reads): run it on the pull executor for large pages.
    """
    encoded: list[bytes] = []
    total = _ENVELOPE_BYTES
    next_offset = max(offset, 0)
    for u in units:
        data = orjson.dumps(message_json(reader.read_message(u.commitlog_offset, u.size)))
        total += len(data) + 1
        if encoded and total > max_bytes:
            break
        encoded.append(data)
        next_offset = u.queue_offset + 1
    return PullPage(tuple(encoded), next_offset)


class QueueWaiters:
    """Long-poll waiters by (topic, queue). Lives on the event loop; :meth:`applied` may be
    called from any thread."""

    def __init__(self, max_offset: Callable[[str, int], int]) -> None:
        """``max_offset(topic, queue)``: the queue's end, for commands that do not say which
        queues they wrote."""
        self._max_offset = max_offset
        self._loop: asyncio.AbstractEventLoop | None = None
        self._futures: dict[tuple[str, int], asyncio.Future[None]] = {}
        self._counts: dict[tuple[str, int], int] = {}
        self._marks: dict[tuple[str, int], int] = {}
        self.waiting = 0  # read from the Raft thread: only a hint whether to cross to the loop
        self.wakes = 0

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    @property
    def queues(self) -> int:
        return len(self._counts)

    def register(self, topic: str, queue: int, max_offset: int) -> asyncio.Future[None]:
        """The future the next message on (topic, queue) resolves; pair with :meth:`release`.
        Register *before* reading, so a message applied after the read still wakes it;
        ``max_offset`` is the queue's end as the caller saw it (see :meth:`wake_grown`)."""
        key = (topic, queue)
        fut = self._futures.get(key)
        if fut is None or fut.done():
            assert self._loop is not None, "QueueWaiters.bind() first"
            fut = self._futures[key] = self._loop.create_future()
            self._marks[key] = max_offset
        self._counts[key] = self._counts.get(key, 0) + 1
        self.waiting += 1
        return fut

    def release(self, topic: str, queue: int) -> None:
        key = (topic, queue)
        left = self._counts.get(key, 0) - 1
        self.waiting -= 1
        if left > 0:
            self._counts[key] = left
            return
        self._counts.pop(key, None)
        self._marks.pop(key, None)
        fut = self._futures.pop(key, None)
        if fut is not None and not fut.done():
            fut.cancel()

    def applied(self, keys: Iterable[tuple[str, int]]) -> None:
        """From any thread: messages were written to these queues."""
        loop = self._loop
        if loop is None or not self.waiting:
            return
        wanted = frozenset(keys)
        if wanted:
            loop.call_soon_threadsafe(self.wake, wanted)

    def grown(self) -> None:
        """From any thread: messages were written, to queues not named (an extension command's
        deliveries); :meth:`wake_grown` finds which on the loop."""
        loop = self._loop
        if loop is not None and self.waiting:
            loop.call_soon_threadsafe(self._check_grown)

    def _check_grown(self) -> None:
        """On the loop: wake the waited queues whose end moved past what their waiters saw."""
        self.wake([k for k, mark in self._marks.items() if self._max_offset(*k) > mark])

    def wake(self, keys: Iterable[tuple[str, int]]) -> None:
        """On the loop: wake the waiters of these queues."""
        for key in keys:
            fut = self._futures.pop(key, None)
            self._marks.pop(key, None)
            if fut is not None and not fut.done():
                self.wakes += 1
                fut.set_result(None)
