"""The asyncio client: :class:`Producer` and :class:`Consumer` for code that runs on an event
loop (aiohttp, FastAPI, asyncio workers). Same behaviour as :mod:`chronomq`'s synchronous
classes: batches with a linger time, failover, ``Retry-After``, one task per queue read.

    async with chronomq.aio.Producer(urls) as producer:
        await producer.send("orders", "order 42 created", delay_ms=30_000)
    async with chronomq.aio.Consumer(urls, "billing", "orders") as consumer:
        async for msg in consumer:
            ...

:class:`Client` is the request-level client: every route of the HTTP API (the admin ones too)
as one awaited call, for tools and scripts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from chronomq import _api
from chronomq._batch import Batcher
from chronomq._client import Client
from chronomq._consume import ConsumerState, FetchStart, Pulled, QueueCursor, Start
from chronomq._http_aio import AioTransport
from chronomq._latency import ConsumedLog, open_log
from chronomq._model import CancelResult, MessageData, SendResult, message_fields, produce_message
from chronomq._policy import RequestPolicy
from chronomq.errors import ChronomqError, RequestError, ServerError, UnavailableError

__all__ = ["Client", "ConsumedLog", "Consumer", "Message", "Producer"]

log = logging.getLogger("chronomq")


class Producer:
    """Sends messages in batches (see :class:`chronomq.Producer`); ``await send(...)`` returns
    once a majority stored the message. Use within one event loop; ``async with`` or
    ``await close()``."""

    def __init__(
        self,
        urls: str | Sequence[str],
        *,
        linger_ms: float = 5,
        max_batch: int = 100,
        max_pending: int = 10_000,
        token: str | None = None,
        ca_file: str | None = None,
        deadline_s: float = 30.0,
        request_timeout_s: float = 15.0,
    ) -> None:
        self._t = AioTransport(
            RequestPolicy(
                urls,
                token=token,
                ca_file=ca_file,
                deadline_s=deadline_s,
                request_timeout_s=request_timeout_s,
            )
        )
        self._batcher: Batcher[asyncio.Future[SendResult]] = Batcher(
            max_batch, linger_ms / 1000, max_pending
        )
        self._changed: asyncio.Condition | None = None
        self._closed = False
        self._flushing = 0
        self._in_flight = 0
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Producer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _cond(self) -> asyncio.Condition:
        if self._changed is None:
            self._changed = asyncio.Condition()
        return self._changed

    async def send(
        self,
        topic: str,
        body: str | bytes,
        *,
        keys: Iterable[str] | str | None = None,
        tags: str | None = None,
        properties: Mapping[str, str] | None = None,
        queue: int | None = None,
        delay_level: int | None = None,
        delay_ms: int | None = None,
        deliver_at_ms: int | None = None,
    ) -> SendResult:
        """Send one message and return where it was stored (at most one of ``delay_level``,
        ``delay_ms``, ``deliver_at_ms``). Waits while ``max_pending`` messages wait."""
        message = produce_message(
            body,
            keys=keys,
            tags=tags,
            properties=properties,
            queue=queue,
            delay_level=delay_level,
            delay_ms=delay_ms,
            deliver_at_ms=deliver_at_ms,
        )
        fut: asyncio.Future[SendResult] = asyncio.get_running_loop().create_future()
        cond = self._cond()
        async with cond:
            await cond.wait_for(lambda: self._closed or not self._batcher.full())
            if self._closed:
                raise RuntimeError("the producer is closed")
            self._batcher.add(topic, message, fut, time.monotonic())
            if self._task is None:
                self._task = asyncio.create_task(self._run(), name="chronomq-producer")
            cond.notify_all()
        return await fut

    async def flush(self) -> None:
        """Send what waits now, and wait until nothing is pending or in flight."""
        cond = self._cond()
        async with cond:
            self._flushing += 1
            cond.notify_all()
            try:
                await cond.wait_for(lambda: self._batcher.pending == 0 and self._in_flight == 0)
            finally:
                self._flushing -= 1

    async def cancel(self, msg_id: str) -> CancelResult:
        """Cancel a timer message by the ``msg_id`` its send returned."""
        req = _api.cancel_timer(msg_id)
        return _api.cancel_result(msg_id, await self._t.call(req))

    async def close(self) -> None:
        """Send what is pending, then stop."""
        if self._closed:
            return
        try:
            await self.flush()
        finally:
            cond = self._cond()
            async with cond:
                self._closed = True
                cond.notify_all()
            if self._task is not None:
                await self._task
            await self._t.close()

    async def _run(self) -> None:
        cond = self._cond()
        while True:
            async with cond:
                while True:
                    now = time.monotonic()
                    topic, batch = self._batcher.take(now, flush=self._flushing > 0)
                    if batch:
                        self._in_flight += len(batch)
                        cond.notify_all()
                        break
                    if self._closed:
                        return
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(cond.wait(), self._batcher.wait_s(now))
            try:
                await self._send_batch(topic, batch)
            finally:
                async with cond:
                    self._in_flight -= len(batch)
                    cond.notify_all()

    async def _send_batch(
        self, topic: str, batch: list[tuple[dict[str, Any], asyncio.Future[SendResult]]]
    ) -> None:
        req = _api.produce(topic, [m for m, _ in batch], _api.new_idempotency_key())
        try:
            results = _api.send_results(await self._t.call(req))
        except Exception as exc:
            for _, fut in batch:
                if not fut.done():
                    fut.set_exception(exc)
            return
        for (_, fut), r in zip(batch, results, strict=True):
            if not fut.done():
                fut.set_result(r)


@dataclass(frozen=True, slots=True)
class Message(MessageData):
    """A consumed message (see :class:`chronomq._model.MessageData` for its fields)."""

    _consumer: Consumer | None = field(default=None, repr=False, compare=False)
    _epoch: int = field(default=0, repr=False, compare=False)
    """Rewinds its queue had when it was fetched (see :class:`chronomq._consume.Rewind`)."""

    async def reconsume_later(self, delay_level: int = 0) -> str:
        """Send the message back through the group's retry topic (or to its DLQ after
        ``max_reconsume_times``): ``"retry"`` or ``"dlq"``. It counts as finished."""
        if self._consumer is None:
            raise RuntimeError("this message does not belong to a consumer")
        return await self._consumer._send_back(self, delay_level)


class Consumer:
    """Reads every queue of ``topics`` and of the group's retry topic (see
    :class:`chronomq.Consumer`): ``async for msg in consumer``, or ``await poll(timeout_s)``."""

    def __init__(
        self,
        urls: str | Sequence[str],
        group: str,
        topics: str | Sequence[str],
        *,
        auto_commit: bool = True,
        auto_commit_interval_ms: int = 1000,
        start: Start = "earliest",
        max_messages: int = 32,
        fetch_wait_ms: int = 5000,
        refresh_interval_ms: int = 5000,
        max_buffered_pages: int = 16,
        latency_log_dir: str | os.PathLike[str] | None = None,
        latency_log_name: str | None = None,
        token: str | None = None,
        ca_file: str | None = None,
        deadline_s: float = 30.0,
        request_timeout_s: float = 15.0,
    ) -> None:
        self._t = AioTransport(
            RequestPolicy(
                urls,
                token=token,
                ca_file=ca_file,
                deadline_s=deadline_s,
                request_timeout_s=request_timeout_s,
            )
        )
        self.group = group
        self._latency = open_log(latency_log_dir, latency_log_name)
        self._state = ConsumerState(
            group,
            [topics] if isinstance(topics, str) else list(topics),
            start=start,
            auto_commit_interval_s=auto_commit_interval_ms / 1000 if auto_commit else None,
            refresh_interval_s=refresh_interval_ms / 1000,
            now=time.monotonic(),
        )
        self._max_messages = max_messages
        self._fetch_wait_ms = fetch_wait_ms
        self._max_buffered_pages = max_buffered_pages
        self._pages: asyncio.Queue[list[Message]] | None = None
        self._page: list[Message] = []
        self._closed = False
        self._error: BaseException | None = None
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def topics(self) -> list[str]:
        return list(self._state.topics)

    async def __aenter__(self) -> Consumer:
        return self

    async def __aexit__(self, exc_type: object, *exc: object) -> None:
        await self.close(finished=exc_type is None)

    async def __aiter__(self) -> AsyncIterator[Message]:
        while True:
            msg = await self.poll(None)
            if msg is None:
                return
            yield msg

    async def poll(self, timeout_s: float | None = None) -> Message | None:
        """The next message, waiting at most ``timeout_s`` (forever when None); None on
        timeout or once closed. The message handed out before is finished."""
        state = self._state
        state.finish_in_hand()
        if self._pages is None:
            self._pages = asyncio.Queue(self._max_buffered_pages)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self._closed:
            if self._error is not None:
                raise self._error
            now = time.monotonic()
            if state.refresh_due(now):
                await self._refresh()
            if state.commit_due(now):
                await self._auto_commit()
                state.auto_committed(now)
            while self._page:
                msg = self._page.pop(0)
                if state.hand_out(msg, msg._epoch):
                    if self._latency is not None:
                        self._latency.handed_out(msg)
                    return msg
            cap = 0.5 if deadline is None else min(0.5, deadline - now)
            if cap <= 0:
                return None
            with contextlib.suppress(TimeoutError):
                self._page = await asyncio.wait_for(self._pages.get(), state.wait_s(now, cap))
        return None

    async def commit(self) -> None:
        """Commit every message handed out so far (the current one included) now."""
        self._state.finish_in_hand()
        await self._commit()

    async def close(self, finished: bool = True) -> None:
        """Stop reading; with ``finished`` the message in hand counts as finished. With
        auto-commit, finished offsets are committed first."""
        if self._closed:
            return
        try:
            if finished:
                self._state.finish_in_hand()
            if self._state.auto_commit_interval_s is not None:
                await self._commit()
        finally:
            self._closed = True
            for task in self._tasks:
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            await self._t.close()
            if self._latency is not None:
                await asyncio.to_thread(self._latency.close)

    async def _refresh(self) -> None:
        """Look for queues to read (new topics, queues, the retry topic). When the cluster
        does not answer (an outage outlasting the client's deadline, or 5xx), the application
        is not interrupted: a warning is logged and the look is tried again shortly."""
        try:
            await self._look_for_queues()
        except (UnavailableError, ServerError) as exc:
            log.warning("looking for queues to read failed, retrying: %s", exc)
            self._state.refresh_failed(time.monotonic())
            return
        self._state.refreshed(time.monotonic())

    async def _look_for_queues(self) -> None:
        state = self._state
        for topic in state.topics:
            try:
                described = await self._t.call(_api.describe_topic(topic))
            except RequestError as exc:
                if exc.status != 404:
                    raise
                described = None
            offsets: list[dict[str, Any]] = []
            if described is not None:
                req = _api.group_offsets(self.group, topic)
                offsets = (await self._t.call(req))["offsets"]
            for start in state.plan(topic, described, offsets):
                self._tasks.append(
                    asyncio.create_task(
                        self._fetch(start), name=f"chronomq-fetch-{start.topic}-{start.queue}"
                    )
                )

    async def _fetch(self, start: FetchStart) -> None:
        assert self._pages is not None
        cursor = QueueCursor(start, self._max_messages, self._fetch_wait_ms)
        while not self._closed:
            got: Pulled | None
            try:
                answer = await self._t.call(cursor.request())
            except RequestError as exc:
                if exc.status == 404:  # this node has not applied the topic yet
                    await asyncio.sleep(0.2)
                    continue
                got = cursor.refused(exc)
                if got is None:
                    self._error = exc
                    return
            except ChronomqError as exc:
                log.warning("pull %s/%d failed, retrying: %s", start.topic, start.queue, exc)
                await asyncio.sleep(0.2)
                continue
            else:
                got = cursor.answered(answer)
            if got.rewind is not None:
                log.warning("%s", got.rewind.describe())
                self._state.rewound(got.rewind)
            page = [
                Message(**message_fields(m), _consumer=self, _epoch=got.epoch) for m in got.messages
            ]
            if page:
                await self._pages.put(page)

    async def _auto_commit(self) -> None:
        """An auto-commit: when the cluster does not answer, a warning, and the next period
        commits what is finished by then (an explicit :meth:`commit` raises instead)."""
        try:
            await self._commit()
        except (UnavailableError, ServerError) as exc:
            log.warning("auto-commit failed, retrying at the next period: %s", exc)

    async def _commit(self) -> None:
        state = self._state
        for (topic, queue), offset in state.to_commit().items():
            await self._t.call(_api.commit_offset(self.group, topic, queue, offset))
            state.commit_done((topic, queue), offset)

    async def _send_back(self, message: Message, delay_level: int) -> str:
        req = _api.send_back(self.group, message.topic, message.queue, message.offset, delay_level)
        answer = await self._t.call(req)
        self._state.finish(message, message._epoch)
        self._state.refresh_soon(time.monotonic())
        return str(answer.get("target", "retry"))
