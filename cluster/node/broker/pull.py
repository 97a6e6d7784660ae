"""Pull: a page of a queue, bounded in bytes, read off the event loop when it is large, with a
long poll that waits for the queue to grow; the check that the log still holds what the consumer
read last (``prev``); a topic's queues and their offsets.
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson

from chronomq.cluster.node.broker.base import BrokerBase
from chronomq.cluster.node.errors import ApiError
from chronomq.cluster.node.pull import INLINE_READ_BYTES, PullPage, plan_units, read_page


class Pulling(BrokerBase):
    """The broker's pulls, long polls and topic descriptions (see the module)."""

    async def pull(
        self,
        topic: str,
        queue: int,
        offset: int,
        max_messages: int,
        wait_ms: int,
        gone: asyncio.Future[None] | None = None,
        prev: str | None = None,
        *,
        fenced: bool = False,
    ) -> tuple[PullPage, int]:
        """A page of at most ``max_pull_bytes`` (at least one message) and the queue's end.

        With ``wait_ms`` it waits for a message on this queue, until the deadline or until
        ``gone`` (the client's connection is lost) resolves. With ``prev`` (the msg_id the
        consumer read at ``offset - 1``) it first checks that the log still holds that message
        there (see :meth:`check_prev`); when this node could not tell then, it checks again
        before answering with messages, which it holds only once it holds ``offset - 1``.

        On a follower the answer holds every write acknowledged before the call: a topic it
        does not know or an offset at its queue's end is first checked against the leader's
        commit index (:meth:`ensure_queue`, :meth:`fence_read`; ``fenced``: the caller did).
        """
        store = self.raftlog.store
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_ms / 1000
        await self.ensure_queue(topic, queue, deadline, gone)
        if not fenced:
            await self.fence_read(topic, queue, offset)
        unsure = prev is not None and not await self.check_prev(topic, queue, offset, prev)

        async def checked(page: PullPage) -> PullPage:
            if unsure and prev is not None and page.messages:
                await self.check_prev(topic, queue, offset, prev)
            return page

        while True:
            left = deadline - loop.time()
            if left <= 0 or (gone is not None and gone.done()):
                page = await self._read_page(topic, queue, offset, max_messages)
                return await checked(page), store.max_offset(topic, queue)
            woken = self.waiters.register(topic, queue, store.max_offset(topic, queue))
            try:
                page = await self._read_page(topic, queue, offset, max_messages)
                if page.messages:
                    return await checked(page), store.max_offset(topic, queue)
                await asyncio.wait(
                    [woken] if gone is None else [woken, gone],
                    timeout=left,
                    return_when=asyncio.FIRST_COMPLETED,
                )
            finally:
                self.waiters.release(topic, queue)
            if gone is not None and gone.done():
                return PullPage((), max(offset, 0)), store.max_offset(topic, queue)

    def _has_queue(self, topic: str, queue: int) -> bool:
        n = self.raftlog.store.queue_count(topic)
        return n is not None and queue < n

    async def ensure_queue(
        self,
        topic: str,
        queue: int,
        deadline: float = 0.0,
        gone: asyncio.Future[None] | None = None,
    ) -> None:
        """404 naming ``topic`` or ``queue`` unless the topic has that queue, as
        :meth:`check_queue`, but a follower first learns whether a write acknowledged before
        now created it (:class:`~chronomq.cluster.node.readfence.ReadFence`), and a long poll
        (``deadline``, the event loop's time) waits for it to appear until then."""
        if self._has_queue(topic, queue):
            return
        if not self.raftlog.is_leader:
            await self.read_fence.wait()
        loop = asyncio.get_running_loop()
        while not self._has_queue(topic, queue):
            left = deadline - loop.time()
            if left <= 0 or (gone is not None and gone.done()):
                break
            # Woken when a message lands in the queue (its end moves past 0).
            woken = self.waiters.register(topic, queue, 0)
            try:
                if self._has_queue(topic, queue):
                    break
                await asyncio.wait(
                    [woken] if gone is None else [woken, gone],
                    timeout=left,
                    return_when=asyncio.FIRST_COMPLETED,
                )
            finally:
                self.waiters.release(topic, queue)
        self.check_queue(topic, queue)

    async def ensure_topic(self, topic: str) -> None:
        """On a follower that does not know ``topic``: wait until it holds every write
        acknowledged before now, so that a 404 after it is true."""
        if self.raftlog.store.queue_count(topic) is None and not self.raftlog.is_leader:
            await self.read_fence.wait()

    async def fence_read(self, topic: str, queue: int, offset: int) -> None:
        """On a follower asked for ``offset`` at or past its queue's end: wait until it holds
        every write acknowledged before now (the write may have put a message there)."""
        if not self.raftlog.is_leader and offset >= self.raftlog.store.max_offset(topic, queue):
            await self.read_fence.wait()

    async def check_prev(self, topic: str, queue: int, offset: int, prev: str) -> bool:
        """409 ``offset_diverged`` when the message at ``offset - 1`` is not ``prev``; False
        when this node cannot tell (yet), True when it holds ``prev`` there or nothing needs
        comparing.

        A log loses its newest entries only when every node loses power at once under
        ``flush = async``; the offsets they held are then written again by other messages, and
        a consumer past them would skip those without noticing. The message is compared where
        this node holds it; where it does not, only a caught-up leader can tell that the log
        is shorter than the consumer read (a follower may not have applied it yet), and
        otherwise the pull goes on and :meth:`pull` asks again before it answers with
        messages. Below the queue's minimum (retention) there is nothing to compare."""
        at = offset - 1
        store = self.raftlog.store
        if at < 0 or at < store.min_offset(topic, queue):
            return True
        end = store.max_offset(topic, queue)
        if at < end:
            page = await self._read_page_from(topic, queue, at, 1)
            held = orjson.loads(page.messages[0])["msg_id"] if page.messages else None
            if held == prev:
                return True
            why = f"the message at offset {at} is {held}, not {prev}"
        elif self.raftlog.leads_caught_up():
            why = f"the queue ends at offset {end}: the message at offset {at} is gone"
        else:
            return False
        raise ApiError(
            409,
            "offset_diverged",
            f"{topic}/{queue}: {why}; the log lost its newest entries (every node lost power "
            "under flush = async) and the offsets were written again. Read again from the "
            "first offset whose message differs from what you read (max_offset is where the "
            "queue ends now).",
            "prev",
            extra={"max_offset": end, "min_offset": store.min_offset(topic, queue)},
        )

    async def _read_page(self, topic: str, queue: int, offset: int, max_messages: int) -> PullPage:
        """A page from ``offset``, or from the queue's minimum when retention deleted what
        lies below it (as RocketMQ answers a pull below the minimum)."""
        for _attempt in range(3):
            start = max(offset, self.raftlog.store.min_offset(topic, queue))
            try:
                return await self._read_page_from(topic, queue, start, max_messages)
            except IndexError:
                if start >= self.raftlog.store.min_offset(topic, queue):
                    raise
                # Retention deleted the segment between the two reads: from the new minimum.
        raise IndexError(f"{topic}/{queue} keeps losing its head to retention")

    async def _read_page_from(
        self, topic: str, queue: int, offset: int, max_messages: int
    ) -> PullPage:
        store = self.raftlog.store
        units = plan_units(
            store.read_units(topic, queue, offset, max_messages), self.config.max_pull_bytes
        )
        if sum(u.size for u in units) <= INLINE_READ_BYTES or self._pull_pool is None:
            return read_page(store.commitlog, units, offset, self.config.max_pull_bytes)
        self.offloaded_pulls += 1
        return await asyncio.get_running_loop().run_in_executor(
            self._pull_pool,
            read_page,
            store.commitlog,
            units,
            offset,
            self.config.max_pull_bytes,
        )

    def describe_topic(self, topic: str) -> dict[str, Any]:
        store = self.raftlog.store
        n = self.queue_count(topic)
        return {
            "topic": topic,
            "queues": [
                {
                    "queue": q,
                    "min_offset": store.min_offset(topic, q),
                    "max_offset": store.max_offset(topic, q),
                }
                for q in range(n)
            ],
        }
