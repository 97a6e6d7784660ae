"""The offset-based pull RPCs (``PullMessage``, ``UpdateOffset``, ``GetOffset``,
``QueryOffset``: what a pull consumer uses), on our consumer-group offsets and our store.

- ``UpdateOffset`` commits the group's offset of one queue through Raft, as
  ``PUT /v1/groups/{group}/offsets`` does: on the leader, or forwarded by a follower to that
  route on the leader. Setting the same offset again is harmless, so it is retried across an
  election within the call's deadline.
- ``GetOffset`` reads the committed offset where it is written, on the leader (a follower
  forwards to ``GET /v1/groups/{group}/offsets``, as the HTTP API does): a follower's copy may
  lag the last commit, and a consumer resuming from it would see messages twice. A queue the
  group never committed an offset for answers ``OFFSET_NOT_FOUND``.
- ``QueryOffset`` is answered from this node's store, like ``GET /v1/topics/{topic}``:
  ``BEGINNING`` is the queue's minimum offset (retention moves it), ``END`` its maximum (the
  offset the next message takes), ``TIMESTAMP`` the first offset whose store time is at or
  after the timestamp (the end when every message is older), by a binary search that reads at
  most ``log2(messages) + 1`` messages. Store times grow along a queue as long as the leaders'
  clocks agree; across a clock step between leaders the answer is one offset where the times
  cross, as RocketMQ's own search gives.
- ``PullMessage`` reads this node's store, as the HTTP pull (:meth:`chronomq.cluster.node.broker.Broker.pull`)
  does on any node, and answers as the RocketMQ proxy does: ``status`` ``OK``, one ``message``
  per message, then ``next_offset``; or ``MESSAGE_NOT_FOUND`` then ``next_offset`` when nothing
  (that matches) came within the long poll; or ``ILLEGAL_OFFSET`` then ``next_offset`` (the
  queue's end) for an offset past the end. A follower that has not yet applied up to the
  offset waits within the long poll for it before answering ``ILLEGAL_OFFSET``. An offset below
  the queue's minimum (deleted by retention) reads from the minimum, as the HTTP pull does.
  ``batch_size`` (0: :data:`DEFAULT_PULL_BATCH`) is capped by ``max_pull_messages`` and the
  answer by ``max_pull_bytes``; ``long_polling_timeout`` (none: no wait) by ``max_wait_ms``
  and by the call's deadline less :data:`PULL_DEADLINE_MARGIN_S`. A TAG filter
  (``TagA || TagB``) passes over other tags by the ConsumeQueue's tags codes before reading a
  message, and looks at no more than :data:`MAX_FILTER_SCAN` messages per call (then it answers
  ``MESSAGE_NOT_FOUND`` with the offset it reached, for the next pull to go on from); SQL92
  filters answer ``UNSUPPORTED``. A pull checks the group's name but neither reads nor moves its
  offset: the consumer commits with ``UpdateOffset``.
"""

from __future__ import annotations

import asyncio
import logging
import time
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Final

import orjson
from rocketmq.grpc_protocol import definition_pb2 as pb
from rocketmq.grpc_protocol import service_pb2 as spb

from chronomq.cluster.node import reserved
from chronomq.cluster.node.errors import ApiError, bad_request
from chronomq.cluster.node.offsets import group_offset_key
from chronomq.cluster.node.pull import INLINE_READ_BYTES
from chronomq.cluster.rocketmq import codes, convert
from chronomq.cluster.rocketmq.consume import check_group, duration_ms, message_pb, tags_of
from chronomq.cluster.rocketmq.rpc import ServicerBase, make_status, rpc
from chronomq.raftlog import record
from chronomq.raftlog.consumequeue import tags_hash

log = logging.getLogger(__name__)

DEFAULT_PULL_BATCH: Final = 32
"""Messages a pull asks for when its ``batch_size`` is 0 (the HTTP pull's default)."""
MAX_FILTER_SCAN: Final = 10_000
"""Most messages one filtered pull looks at (by their ConsumeQueue units) before answering."""
SCAN_CHUNK_UNITS: Final = 512
"""ConsumeQueue units a filtered pull reads at a time."""
PULL_DEADLINE_MARGIN_S: Final = 0.2
"""Time a long poll keeps before the call's deadline to read and send its answer."""
MAX_OFFSET: Final = 2**62
"""Offsets past this are refused (the HTTP API's bound)."""

Code = pb.Code
Policy = pb.QueryOffsetPolicy


@dataclass(frozen=True, slots=True)
class PullArgs:
    """A checked ``PullMessageRequest``."""

    group: str
    topic: str
    queue: int
    offset: int
    batch: int
    wait_ms: int
    tags: tuple[str, ...] | None


@dataclass(frozen=True, slots=True)
class Pulled:
    """What a pull found (JSON messages as :func:`chronomq.cluster.node.pull.message_json` gives them), where
    the next pull starts, and whether the offset asked for was past the queue's end."""

    messages: tuple[dict[str, Any], ...]
    next_offset: int
    past_end: bool = False


def queue_of(mq: pb.MessageQueue) -> tuple[str, int]:
    """The request's topic and queue id; an :class:`ApiError` names what is wrong."""
    topic = mq.topic.name
    record.validate_topic(topic, "topic")
    if reserved.is_system_topic(topic):
        raise ApiError(400, "illegal_topic", f"{topic} is a system topic", "topic")
    queue = int(mq.id)
    if queue < 0:
        raise bad_request("message_queue.id must name a queue (0 or more)", "message_queue.id")
    return topic, queue


def check_offset(offset: int) -> int:
    if not 0 <= offset <= MAX_OFFSET:
        raise ApiError(400, "illegal_offset", f"offset must be 0 to {MAX_OFFSET}", "offset")
    return offset


def pull_args(
    request: spb.PullMessageRequest,
    max_pull_messages: int,
    max_wait_ms: int,
    remaining_s: float | None,
) -> PullArgs:
    """The request as a pull; an :class:`ApiError` names what is wrong."""
    group = check_group(request.group.name)
    topic, queue = queue_of(request.message_queue)
    reserved.check_group_read(topic, group, "message_queue.topic")
    offset = check_offset(int(request.offset))
    batch = int(request.batch_size)
    if batch < 0:
        raise bad_request("batch_size must not be negative", "batch_size")
    poll_ms = duration_ms(request.long_polling_timeout)
    if poll_ms < 0:
        raise ApiError(
            400, "illegal_polling_time", "long_polling_timeout is negative", "long_polling_timeout"
        )
    wait_ms = min(poll_ms, max_wait_ms)
    if remaining_s is not None:
        wait_ms = min(wait_ms, max(0, int((remaining_s - PULL_DEADLINE_MARGIN_S) * 1000)))
    return PullArgs(
        group=group,
        topic=topic,
        queue=queue,
        offset=offset,
        batch=min(batch or DEFAULT_PULL_BATCH, max_pull_messages),
        wait_ms=wait_ms,
        tags=tags_of(request.filter_expression),
    )


async def first_at_or_after(
    lo: int, hi: int, timestamp_ms: int, store_ms_at: Callable[[int], Awaitable[int]]
) -> int:
    """The first offset in ``[lo, hi)`` whose store time (``store_ms_at(offset)``) is at or
    after ``timestamp_ms``, else ``hi``, for store times that do not decrease: a binary search,
    so at most ``log2(hi - lo) + 1`` probes."""
    while lo < hi:
        mid = (lo + hi) // 2
        if await store_ms_at(mid) >= timestamp_ms:
            hi = mid
        else:
            lo = mid + 1
    return lo


def _offsets_path(group: str) -> str:
    return f"/v1/groups/{urllib.parse.quote(group, safe='')}/offsets"


class OffsetRpcs(ServicerBase):
    """The offset RPCs of the servicer."""

    # ------------------------------------------------------------------ group offsets

    @rpc(spb.UpdateOffsetResponse)
    async def UpdateOffset(self, request: Any, context: Any) -> Any:
        group = check_group(request.group.name)
        topic, queue = queue_of(request.message_queue)
        offset = check_offset(int(request.offset))
        broker = self.broker

        async def local() -> dict[str, Any]:
            broker.check_queue(topic, queue)
            await broker.commit_offset(group, topic, queue, offset)
            return {}

        async def remote(leader: str, timeout_s: float) -> dict[str, Any]:
            body = orjson.dumps({"topic": topic, "queue": queue, "offset": offset})
            return await self._forward("PUT", leader, _offsets_path(group), timeout_s, body)

        await self._on_leader(local, remote, self._budget_s(context), True)
        return spb.UpdateOffsetResponse(status=make_status())

    @rpc(spb.GetOffsetResponse)
    async def GetOffset(self, request: Any, context: Any) -> Any:
        group = check_group(request.group.name)
        topic, queue = queue_of(request.message_queue)
        kv = self.broker.raftlog.store.kv

        async def local() -> dict[str, Any]:
            value = kv.get(group_offset_key(group, topic, queue))
            found = [] if value is None else [{"topic": topic, "queue": queue, "offset": value}]
            return {"group": group, "offsets": found}

        async def remote(leader: str, timeout_s: float) -> dict[str, Any]:
            path = f"{_offsets_path(group)}?topic={urllib.parse.quote(topic, safe='')}"
            return await self._forward("GET", leader, path, timeout_s)

        answer = await self._on_leader(local, remote, self._budget_s(context), True)
        for o in answer.get("offsets") or []:
            if isinstance(o, dict) and o.get("topic") == topic and o.get("queue") == queue:
                return spb.GetOffsetResponse(status=make_status(), offset=int(o["offset"]))
        raise ApiError(
            404,
            "offset_not_found",
            f"group {group} has no committed offset for {topic} queue {queue}",
            "message_queue",
        )

    # ------------------------------------------------------------------ queue offsets

    @rpc(spb.QueryOffsetResponse)
    async def QueryOffset(self, request: Any, context: Any) -> Any:
        topic, queue = queue_of(request.message_queue)
        # A follower answers only once it holds every write acknowledged before the call.
        await self.broker.ensure_queue(topic, queue)
        if not self.broker.raftlog.is_leader:
            await self.broker.read_fence.wait()
        store = self.broker.raftlog.store
        policy = request.query_offset_policy
        if policy == Policy.BEGINNING:
            offset = store.min_offset(topic, queue)
        elif policy == Policy.END:
            offset = store.max_offset(topic, queue)
        elif policy == Policy.TIMESTAMP:
            if not request.HasField("timestamp"):
                raise bad_request("the TIMESTAMP policy needs a timestamp", "timestamp")
            at_ms = convert.timestamp_ms(request.timestamp, "timestamp")
            offset = await self._offset_at(topic, queue, at_ms)
        else:
            raise bad_request(f"unknown query_offset_policy {policy}", "query_offset_policy")
        return spb.QueryOffsetResponse(status=make_status(), offset=offset)

    async def _offset_at(self, topic: str, queue: int, timestamp_ms: int) -> int:
        """The first offset of the queue stored at or after ``timestamp_ms`` (its end if none)."""
        store = self.broker.raftlog.store

        async def store_ms_at(offset: int) -> int:
            units = store.read_units(topic, queue, offset, 1)
            if not units:
                return -1
            u = units[0]
            try:
                if u.size <= INLINE_READ_BYTES:
                    m = store.commitlog.read_message(u.commitlog_offset, u.size)
                else:
                    m = await asyncio.to_thread(
                        store.commitlog.read_message, u.commitlog_offset, u.size
                    )
            except IndexError:
                return -1  # deleted by retention since: older than any timestamp asked for
            return m.store_ms

        found = await first_at_or_after(
            store.min_offset(topic, queue),
            store.max_offset(topic, queue),
            timestamp_ms,
            store_ms_at,
        )
        return max(found, store.min_offset(topic, queue))

    # ------------------------------------------------------------------ pull

    async def PullMessage(self, request: Any, context: Any) -> AsyncIterator[Any]:
        t0 = time.perf_counter()
        name = "PullMessage"
        try:
            gone = self.broker.removed_error()
            if gone is not None:
                raise gone
            remaining = context.time_remaining() if context is not None else None
            args = pull_args(
                request,
                int(self._config.max_pull_messages),
                int(self._config.max_wait_ms),
                remaining,
            )
            pulled = await self._pull(args)
            out = [message_pb(m) for m in pulled.messages]
        except asyncio.CancelledError:
            self.metrics.observe(name, "CANCELLED", time.perf_counter() - t0)
            raise
        except Exception as exc:
            failure = codes.from_exception_or_none(exc)
            if failure is None:
                log.exception("unexpected error in %s", name)
                failure = codes.internal()
            self.metrics.observe(name, failure.name, time.perf_counter() - t0)
            yield spb.PullMessageResponse(status=make_status(failure))
            return
        if out:
            status = make_status()
        elif pulled.past_end:
            status = pb.Status(
                code=Code.ILLEGAL_OFFSET,
                message=codes.describe(
                    "illegal_offset",
                    f"offset {args.offset} is past the queue's end {pulled.next_offset}",
                    "offset",
                ),
            )
        else:
            status = pb.Status(code=Code.MESSAGE_NOT_FOUND, message="no new message")
        self.metrics.pulled.inc(len(out))
        self.metrics.observe(name, Code.Name(status.code), time.perf_counter() - t0)
        yield spb.PullMessageResponse(status=status)
        for m in out:
            yield spb.PullMessageResponse(message=m)
        yield spb.PullMessageResponse(next_offset=pulled.next_offset)

    async def _pull(self, args: PullArgs) -> Pulled:
        """Pages of the queue from ``args.offset`` until one holds a message the filter
        accepts, the long poll ends or the filter has looked at :data:`MAX_FILTER_SCAN`."""
        broker = self.broker
        store = broker.raftlog.store
        topic, queue = args.topic, args.queue
        wanted = None if args.tags is None else frozenset(tags_hash(t) for t in args.tags)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + args.wait_ms / 1000
        # On a follower: a topic or an offset it does not hold yet is checked against the
        # leader's commit index first (a long poll also waits for the topic to appear).
        await broker.ensure_queue(topic, queue, deadline)
        await broker.fence_read(topic, queue, args.offset)
        offset = args.offset
        budget = MAX_FILTER_SCAN
        while True:
            end = store.max_offset(topic, queue)
            left_ms = max(0, int((deadline - loop.time()) * 1000))
            if offset > end and (broker.raftlog.is_leader or left_ms == 0):
                return Pulled((), end, past_end=True)
            if wanted is not None and offset < end:
                offset, budget = self._skip_other_tags(topic, queue, offset, end, wanted, budget)
                if budget <= 0 and offset < end:
                    return Pulled((), offset)
            page, _end = await broker.pull(topic, queue, offset, args.batch, left_ms, fenced=True)
            messages = [orjson.loads(b) for b in page.messages]
            if args.tags is not None:
                matched = [m for m in messages if m.get("tags") in args.tags]
            else:
                matched = messages
            offset = page.next_offset  # past what was read, or from the queue's minimum
            if matched:
                return Pulled(tuple(matched), offset)
            budget -= len(messages)
            if budget <= 0 or loop.time() >= deadline:
                end = store.max_offset(topic, queue)
                return Pulled((), end, past_end=True) if offset > end else Pulled((), offset)

    def _skip_other_tags(
        self, topic: str, queue: int, offset: int, end: int, wanted: frozenset[int], budget: int
    ) -> tuple[int, int]:
        """The first offset from ``offset`` whose ConsumeQueue tags code is ``wanted``, or
        where the scan stopped (the queue's ``end``, or ``budget`` units looked at); and the
        budget left. A hash match is checked against the message's tag once it is read."""
        store = self.broker.raftlog.store
        offset = max(offset, store.min_offset(topic, queue))
        while offset < end and budget > 0:
            units = store.read_units(topic, queue, offset, min(SCAN_CHUNK_UNITS, budget))
            if not units:
                break
            for u in units:
                if u.tags_code in wanted:
                    return u.queue_offset, budget
                budget -= 1
            offset = units[-1].queue_offset + 1
        return offset, budget
