"""Pop consumption on the leader, as both protocols call it: receive (a long poll), ack
(batched into few commands), change invisible time and forward to the DLQ.

The HTTP routes (:mod:`chronomq.cluster.httpapi.api_pop`) and the gRPC endpoint
(:mod:`chronomq.cluster.rocketmq.consume`) decode their requests into the same arguments and
call these; each call is one command of :class:`chronomq.pop.PopService` (or a few, for many
handles), and pop's errors come back as :class:`~chronomq.cluster.node.errors.ApiError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Final, TypeVar

from chronomq.cluster.node import models, reserved
from chronomq.cluster.node.errors import ApiError, bad_request
from chronomq.cluster.node.pull import message_json
from chronomq.pop import (
    MAX_ITEMS_PER_COMMAND,
    AckResult,
    ChangeResult,
    ForwardResult,
    InvalidHandle,
    PopError,
    Popped,
    topic_problem,
)
from chronomq.raftlog.errors import NotLeader

T = TypeVar("T")

RECHECK_S: Final = 5.0
"""A waiting receive looks again at least this often (it is woken by a new message on its
queues and by a revive on this node; this is only a safety net)."""


# ---------------------------------------------------------------------- requests


@dataclass(frozen=True, slots=True)
class ReceiveArgs:
    topic: str
    queue: int | None
    max_messages: int
    invisible_ms: int
    wait_ms: int
    tags: tuple[str, ...] | None
    max_reconsume_times: int | None

    def body(self) -> dict[str, Any]:
        """The JSON body of the route (a follower forwards it)."""
        return {
            "topic": self.topic,
            "queue": self.queue,
            "max": self.max_messages,
            "invisible_ms": self.invisible_ms,
            "wait_ms": self.wait_ms,
            "tags": None if self.tags is None else list(self.tags),
            "max_reconsume_times": self.max_reconsume_times,
        }


def receive_args(body: models.PopRequest, max_wait_ms: int) -> ReceiveArgs:
    """The model checked types and bounds; here what depends on the topic and the node."""
    problem = topic_problem(body.topic)
    if problem is not None:
        raise bad_request(problem, "topic")
    if reserved.is_system_topic(body.topic):
        raise bad_request(f"{body.topic} is a system topic, internal to the broker", "topic")
    wait_ms = body.wait_ms or 0
    if not 0 <= wait_ms <= max_wait_ms:
        raise bad_request(f"wait_ms must be an integer 0..{max_wait_ms}", "wait_ms")
    return ReceiveArgs(
        topic=body.topic,
        queue=None if body.queue is None or body.queue == -1 else body.queue,
        max_messages=body.max or 16,
        invisible_ms=body.invisible_ms or 30_000,
        wait_ms=wait_ms,
        tags=None if body.tags is None else tuple(body.tags),
        max_reconsume_times=body.max_reconsume_times,
    )


# ---------------------------------------------------------------------- the leader's calls


def _service(broker: Any) -> Any:
    pop = broker.pop
    if pop is None:
        raise ApiError(503, "pop_unavailable", "pop consumption is not running on this node")
    return pop


def _api_error(exc: BaseException) -> ApiError | None:
    if isinstance(exc, PopError):
        status = 404 if exc.code == "unknown_topic" else 400
        return ApiError(status, exc.code, str(exc), exc.field)
    if isinstance(exc, InvalidHandle):
        return ApiError(400, "invalid_receipt_handle", str(exc) or "invalid", "receipt_handle")
    return None


@contextlib.contextmanager
def _pop_errors() -> Any:
    try:
        yield
    except (PopError, InvalidHandle) as exc:
        api = _api_error(exc)
        assert api is not None
        raise api from None


async def _settle(broker: Any, fut: Future[T]) -> T:
    """The command's answer, waited for within the commit timeout."""
    timeout_s = broker.config.commit_timeout_ms / 1000
    try:
        async with asyncio.timeout(timeout_s):
            with _pop_errors():
                return await asyncio.wrap_future(fut)
    except TimeoutError:
        fut.cancel()
        raise ApiError(
            503,
            "commit_outcome_unknown",
            "the pop command was not answered in time; what it handed out comes back after "
            "its invisible time",
            None,
            {"Retry-After": "1"},
        ) from None


def _check_group(group: str, handle_group: str, field: str) -> None:
    if group != handle_group:
        raise bad_request(f"this receipt handle belongs to group {handle_group!r}", field)


def _leader(broker: Any) -> None:
    if not broker.raftlog.is_leader:
        raise NotLeader("this node stopped leading")


async def receive(
    broker: Any,
    group: str,
    args: ReceiveArgs,
    gone: asyncio.Future[None] | None = None,
) -> list[Popped]:
    """On the leader: hand out up to ``args.max_messages``, waiting up to ``args.wait_ms`` for
    something visible. An empty list when nothing came in time (or the client left)."""
    pop = _service(broker)
    store = broker.raftlog.store
    loop = asyncio.get_running_loop()
    deadline = loop.time() + args.wait_ms / 1000
    missing_ok = bool(broker.config.auto_create_topic) and not reserved.is_system_topic(args.topic)
    while True:
        _leader(broker)
        queues = store.queue_count(args.topic)
        exists = queues is not None
        if queues is not None and args.queue is not None and args.queue >= queues:
            raise bad_request(f"topic {args.topic} has queues 0..{queues - 1}", "queue")
        if exists and pop.visible(group, args.topic, args.queue):
            with _pop_errors():
                fut = pop.receive(
                    group,
                    args.topic,
                    args.max_messages,
                    args.invisible_ms,
                    queue=args.queue,
                    tags=args.tags,
                    max_reconsume_times=args.max_reconsume_times,
                )
            popped: list[Popped] = await _settle(broker, fut)
            if popped:
                return popped
        elif not exists and not missing_ok:
            raise ApiError(404, "unknown_topic", f"topic {args.topic} does not exist", "topic")
        # A topic that does not exist yet (auto_create_topic) is created by its first
        # produce: wait for it as for a message.
        left = deadline - loop.time()
        if left <= 0 or (gone is not None and gone.done()):
            return []
        await _wait_for_messages(broker, group, args, min(left, RECHECK_S), gone)


async def _wait_for_messages(
    broker: Any,
    group: str,
    args: ReceiveArgs,
    timeout_s: float,
    gone: asyncio.Future[None] | None,
) -> None:
    store = broker.raftlog.store
    n = store.queue_count(args.topic) or 0
    queues = range(n) if args.queue is None else [args.queue]
    keys = [(args.topic, q) for q in queues if q < n]
    futures = [broker.waiters.register(t, q, store.max_offset(t, q)) for t, q in keys]
    try:
        revived = broker.pop.revived_future()
        if keys and broker.pop.visible(group, args.topic, args.queue):
            return
        waits: list[asyncio.Future[Any]] = [*futures, revived]
        if gone is not None:
            waits.append(gone)
        await asyncio.wait(waits, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t, q in keys:
            broker.waiters.release(t, q)


def popped_json(p: Popped) -> dict[str, Any]:
    out = message_json(p.message)
    out["receipt_handle"] = p.receipt_handle
    out["delivery_attempt"] = p.delivery_attempt
    out["invisible_until_ms"] = p.invisible_until_ms
    return out


async def ack(broker: Any, group: str, handles: Sequence[str]) -> list[AckResult]:
    """On the leader: ack every handle. Acks of concurrent requests share commands of up to
    MAX_ITEMS_PER_COMMAND handles (:class:`AckBatcher`), as produce requests share batches."""
    pop = _service(broker)
    with _pop_errors():
        for i, h in enumerate(handles):
            _check_group(group, pop.decode(h).group, f"receipt_handles[{i}]")
    _leader(broker)
    batcher = _BATCHERS.get(pop)
    if batcher is None:
        batcher = _BATCHERS[pop] = AckBatcher(broker, pop)
    chunks = [
        batcher.ack(handles[start : start + MAX_ITEMS_PER_COMMAND])
        for start in range(0, len(handles), MAX_ITEMS_PER_COMMAND)
    ]
    out: list[AckResult] = []
    for part in await asyncio.gather(*chunks):
        out.extend(part)
    return out


MAX_ACK_COMMANDS: Final = 4
"""Ack commands in flight at once on a leader; acks arriving meanwhile wait and share the next."""


class AckBatcher:
    """Group commit for acks (event loop only): handles of concurrent ack calls go to Raft
    together, at most :data:`MAX_ITEMS_PER_COMMAND` per command and :data:`MAX_ACK_COMMANDS`
    commands in flight. Every handle was verified before it was queued, so one caller's bad
    handle cannot fail another's command."""

    def __init__(self, broker: Any, pop: Any) -> None:
        self.broker = broker
        self.pop = pop
        self.waiting: list[tuple[Sequence[str], asyncio.Future[list[AckResult]]]] = []
        self.running = 0
        self.commands = 0

    async def ack(self, handles: Sequence[str]) -> list[AckResult]:
        """Ack at most MAX_ITEMS_PER_COMMAND handles."""
        fut: asyncio.Future[list[AckResult]] = asyncio.get_running_loop().create_future()
        self.waiting.append((handles, fut))
        if self.running < MAX_ACK_COMMANDS:
            self.running += 1
            asyncio.get_running_loop().create_task(self._drain())
        return await fut

    def _take(self) -> list[tuple[Sequence[str], asyncio.Future[list[AckResult]]]]:
        batch: list[tuple[Sequence[str], asyncio.Future[list[AckResult]]]] = []
        n = 0
        while self.waiting and n + len(self.waiting[0][0]) <= MAX_ITEMS_PER_COMMAND:
            item = self.waiting.pop(0)
            if item[1].done():  # the caller went away
                continue
            batch.append(item)
            n += len(item[0])
        return batch

    async def _drain(self) -> None:
        try:
            while self.waiting:
                batch = self._take()
                if not batch:
                    continue
                try:
                    _leader(self.broker)
                    with _pop_errors():
                        fut = self.pop.ack([h for handles, _ in batch for h in handles])
                    self.commands += 1
                    results: list[AckResult] = await _settle(self.broker, fut)
                except Exception as exc:
                    for _, waiter in batch:
                        if not waiter.done():
                            waiter.set_exception(exc)
                    continue
                at = 0
                for handles, waiter in batch:
                    if not waiter.done():
                        waiter.set_result(results[at : at + len(handles)])
                    at += len(handles)
        finally:
            self.running -= 1


_BATCHERS: weakref.WeakKeyDictionary[Any, AckBatcher] = weakref.WeakKeyDictionary()


async def change_invisible(
    broker: Any,
    group: str,
    handle: str,
    invisible_ms: int,
    max_reconsume_times: int | None = None,
) -> ChangeResult:
    pop = _service(broker)
    _leader(broker)
    with _pop_errors():
        _check_group(group, pop.decode(handle).group, "receipt_handle")
        fut = pop.change_invisible(handle, invisible_ms, max_reconsume_times=max_reconsume_times)
    result: ChangeResult = await _settle(broker, fut)
    return result


async def change_invisible_many(
    broker: Any, handles: Sequence[str], invisible_ms: int
) -> list[ChangeResult]:
    """On the leader: give each handle ``invisible_ms`` more, in commands of up to
    MAX_ITEMS_PER_COMMAND (the node's own renewals of auto_renew receives: every handle is one
    this cluster signed, and each keeps its own group)."""
    pop = _service(broker)
    _leader(broker)
    futures = []
    with _pop_errors():
        for start in range(0, len(handles), MAX_ITEMS_PER_COMMAND):
            chunk = handles[start : start + MAX_ITEMS_PER_COMMAND]
            futures.append(pop.change_invisible_many(chunk, invisible_ms))
    out: list[ChangeResult] = []
    for part in await asyncio.gather(*(_settle(broker, f) for f in futures)):
        out.extend(part)
    return out


async def forward_to_dlq(broker: Any, group: str, handle: str) -> ForwardResult:
    pop = _service(broker)
    _leader(broker)
    with _pop_errors():
        _check_group(group, pop.decode(handle).group, "receipt_handle")
        fut = pop.forward_to_dlq(handle)
    result: ForwardResult = await _settle(broker, fut)
    return result


def change_json(r: ChangeResult) -> dict[str, Any]:
    return {
        "status": r.status.value,
        "receipt_handle": r.receipt_handle,
        "invisible_until_ms": r.invisible_until_ms,
    }
