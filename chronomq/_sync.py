"""The synchronous client: :class:`Producer` and :class:`Consumer` for threads (Django,
Flask, scripts). No event loop: http.client underneath, a background thread that sends
batches, one background thread per queue that long-polls it."""

from __future__ import annotations

import contextlib
import logging
import os
import queue as queue_mod
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from chronomq import _api
from chronomq._batch import Batcher
from chronomq._consume import ConsumerState, FetchStart, Pulled, QueueCursor, Start
from chronomq._http_sync import SyncTransport
from chronomq._latency import open_log
from chronomq._model import CancelResult, MessageData, SendResult, message_fields, produce_message
from chronomq._policy import RequestPolicy
from chronomq.errors import ChronomqError, RequestError, ServerError, UnavailableError

log = logging.getLogger("chronomq")


class Producer:
    """Sends messages in batches: one request per topic carries what arrived within
    ``linger_ms`` (at most ``max_batch``), under one idempotency key for all its retries.

    ``urls`` lists every node (or is a comma-separated string): a node that does not answer
    is skipped, writes go to the leader once known, a ``Retry-After`` is waited out.
    :meth:`send` blocks until a majority stored the message; :meth:`send_async` returns a
    future. Thread-safe; use one per process (``close()`` it, or ``with``)."""

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
        self._t = SyncTransport(
            RequestPolicy(
                urls,
                token=token,
                ca_file=ca_file,
                deadline_s=deadline_s,
                request_timeout_s=request_timeout_s,
            )
        )
        self._batcher: Batcher[Future[SendResult]] = Batcher(
            max_batch, linger_ms / 1000, max_pending
        )
        self._cond = threading.Condition()
        self._closed = False
        self._flushing = 0
        self._in_flight = 0
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Producer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def send_async(
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
        block_s: float | None = None,
    ) -> Future[SendResult]:
        """Queue a message; the future resolves once it is stored. Blocks (at most
        ``block_s``, forever when None) while ``max_pending`` messages wait."""
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
        fut: Future[SendResult] = Future()
        with self._cond:
            if not self._cond.wait_for(lambda: self._closed or not self._batcher.full(), block_s):
                raise TimeoutError(f"{self._batcher.pending} messages are waiting to be sent")
            if self._closed:
                raise RuntimeError("the producer is closed")
            self._batcher.add(topic, message, fut, time.monotonic())
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="chronomq-producer", daemon=True
                )
                self._thread.start()
            self._cond.notify_all()
        return fut

    def send(
        self, topic: str, body: str | bytes, *, timeout_s: float | None = None, **options: Any
    ) -> SendResult:
        """Send one message and wait until it is stored; options as :meth:`send_async`
        (``keys``, ``tags``, ``properties``, ``queue``, and at most one of ``delay_level``,
        ``delay_ms``, ``deliver_at_ms``)."""
        return self.send_async(topic, body, **options).result(timeout_s)

    def flush(self, timeout_s: float | None = None) -> None:
        """Send what waits now, and wait until nothing is pending or in flight."""
        with self._cond:
            self._flushing += 1
            self._cond.notify_all()
            try:
                done = self._cond.wait_for(
                    lambda: self._batcher.pending == 0 and self._in_flight == 0, timeout_s
                )
            finally:
                self._flushing -= 1
        if not done:
            raise TimeoutError("messages still pending after the flush timeout")

    def cancel(self, msg_id: str) -> CancelResult:
        """Cancel a timer message (``delay_ms``/``deliver_at_ms``) by the ``msg_id`` its send
        returned: ``cancelled`` means it will never be delivered."""
        req = _api.cancel_timer(msg_id)
        return _api.cancel_result(msg_id, self._t.call(req))

    def close(self, timeout_s: float | None = 30.0) -> None:
        """Send what is pending (for at most ``timeout_s``), then stop."""
        with self._cond:
            if self._closed:
                return
        try:
            self.flush(timeout_s)
        finally:
            with self._cond:
                self._closed = True
                self._cond.notify_all()
            if self._thread is not None:
                self._thread.join(5)
            self._t.close()

    def _run(self) -> None:
        while True:
            with self._cond:
                while True:
                    now = time.monotonic()
                    topic, batch = self._batcher.take(now, flush=self._flushing > 0)
                    if batch:
                        self._in_flight += len(batch)
                        self._cond.notify_all()  # room for blocked senders
                        break
                    if self._closed:
                        return
                    self._cond.wait(self._batcher.wait_s(now))
            try:
                self._send_batch(topic, batch)
            finally:
                with self._cond:
                    self._in_flight -= len(batch)
                    self._cond.notify_all()

    def _send_batch(
        self, topic: str, batch: list[tuple[dict[str, Any], Future[SendResult]]]
    ) -> None:
        req = _api.produce(topic, [m for m, _ in batch], _api.new_idempotency_key())
        try:
            results = _api.send_results(self._t.call(req))
        except BaseException as exc:
            for _, fut in batch:
                fut.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
            return
        for (_, fut), r in zip(batch, results, strict=True):
            fut.set_result(r)


@dataclass(frozen=True, slots=True)
class Message(MessageData):
    """A consumed message (see :class:`chronomq._model.MessageData` for its fields)."""

    _consumer: Consumer | None = field(default=None, repr=False, compare=False)
    _epoch: int = field(default=0, repr=False, compare=False)
    """Rewinds its queue had when it was fetched (see :class:`chronomq._consume.Rewind`)."""

    def reconsume_later(self, delay_level: int = 0) -> str:
        """Send the message back to be consumed again later, through the group's retry topic
        (delay level ``3 + reconsume_times`` unless ``delay_level`` is given), or to the
        group's DLQ after ``max_reconsume_times``: returns ``"retry"`` or ``"dlq"``. The
        message counts as finished once sent back."""
        if self._consumer is None:
            raise RuntimeError("this message does not belong to a consumer")
        return self._consumer._send_back(self, delay_level)


class Consumer:
    """Reads every queue of ``topics`` and of the group's retry topic, for group ``group``.

    ``for msg in consumer`` hands out messages as they arrive (forever, until
    :meth:`close`); :meth:`poll` waits at most a given time. A message is finished when the
    loop asks for the next one (or on commit, ``reconsume_later()`` or a clean close).
    With ``auto_commit`` (the default) finished offsets are committed every
    ``auto_commit_interval_ms`` and on close; otherwise call :meth:`commit`.

    A queue resumes from the group's committed offset; a group without one starts at
    ``start`` (``"earliest"`` or ``"latest"``). One consumer per group: several consumers of
    one group would each read every queue. After a rewind of the log (every node lost power
    under ``flush = async``) a queue is read again from the first offset whose message changed
    (see :class:`chronomq._consume.QueueCursor`).

    With ``latency_log_dir``, every message handed out is logged as consumed for
    ``chronomq report`` (:class:`chronomq.ConsumedLog`, named ``latency_log_name``); close
    drains that log.
    """

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
        self._t = SyncTransport(
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
        self._pages: queue_mod.Queue[list[Message]] = queue_mod.Queue(max_buffered_pages)
        self._page: list[Message] = []
        self._closed = threading.Event()
        self._error: BaseException | None = None
        self._threads: list[threading.Thread] = []

    @property
    def topics(self) -> list[str]:
        """The topics read, the group's retry topic included."""
        return list(self._state.topics)

    def __enter__(self) -> Consumer:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.close(finished=exc_type is None)

    def __iter__(self) -> Iterator[Message]:
        while True:
            msg = self.poll(None)
            if msg is None:
                return
            yield msg

    def poll(self, timeout_s: float | None = None) -> Message | None:
        """The next message, waiting at most ``timeout_s`` (forever when None); None on
        timeout or once closed. The message handed out before is finished."""
        state = self._state
        state.finish_in_hand()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self._closed.is_set():
            if self._error is not None:
                raise self._error
            now = time.monotonic()
            if state.refresh_due(now):
                self._refresh()
            if state.commit_due(now):
                self._auto_commit()
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
            with contextlib.suppress(queue_mod.Empty):
                self._page = self._pages.get(timeout=state.wait_s(now, cap))
        return None

    def commit(self) -> None:
        """Commit every message handed out so far (the current one included) now."""
        self._state.finish_in_hand()
        self._commit()

    def close(self, finished: bool = True, timeout_s: float = 10.0) -> None:
        """Stop reading; with ``finished`` the message in hand counts as finished. With
        auto-commit, finished offsets are committed first. Buffered messages not handed out
        are not committed: the group reads them again."""
        if self._closed.is_set():
            return
        try:
            if finished:
                self._state.finish_in_hand()
            if self._state.auto_commit_interval_s is not None:
                self._commit()
        finally:
            self._closed.set()
            self._t.close()  # cuts the long-polls short
            for th in self._threads:
                th.join(timeout_s / max(1, len(self._threads)))
            if self._latency is not None:
                self._latency.close()

    # ------------------------------------------------------------------ internals

    def _refresh(self) -> None:
        """Look for queues to read (new topics, queues, the retry topic). When the cluster
        does not answer (an outage outlasting the client's deadline, or 5xx), the application
        is not interrupted: a warning is logged and the look is tried again shortly."""
        try:
            self._look_for_queues()
        except (UnavailableError, ServerError) as exc:
            log.warning("looking for queues to read failed, retrying: %s", exc)
            self._state.refresh_failed(time.monotonic())
            return
        self._state.refreshed(time.monotonic())

    def _look_for_queues(self) -> None:
        state = self._state
        for topic in state.topics:
            try:
                described = self._t.call(_api.describe_topic(topic))
            except RequestError as exc:
                if exc.status != 404:
                    raise
                described = None
            offsets: list[dict[str, Any]] = []
            if described is not None:
                req = _api.group_offsets(self.group, topic)
                offsets = self._t.call(req)["offsets"]
            for start in state.plan(topic, described, offsets):
                self._start_fetcher(start)

    def _start_fetcher(self, start: FetchStart) -> None:
        th = threading.Thread(
            target=self._fetch,
            args=(start,),
            name=f"chronomq-fetch-{start.topic}-{start.queue}",
            daemon=True,
        )
        self._threads.append(th)
        th.start()

    def _fetch(self, start: FetchStart) -> None:
        cursor = QueueCursor(start, self._max_messages, self._fetch_wait_ms)
        while not self._closed.is_set():
            got: Pulled | None
            try:
                answer = self._t.call(cursor.request())
            except RequestError as exc:
                if exc.status == 404:  # this node has not applied the topic yet
                    self._closed.wait(0.2)
                    continue
                got = cursor.refused(exc)
                if got is None:
                    self._error = exc
                    return
            except ChronomqError as exc:
                if self._closed.is_set():
                    return
                log.warning("pull %s/%d failed, retrying: %s", start.topic, start.queue, exc)
                self._closed.wait(0.2)
                continue
            else:
                got = cursor.answered(answer)
            if got.rewind is not None:
                log.warning("%s", got.rewind.describe())
                self._state.rewound(got.rewind)
            page = [
                Message(**message_fields(m), _consumer=self, _epoch=got.epoch) for m in got.messages
            ]
            while page and not self._closed.is_set():
                try:
                    self._pages.put(page, timeout=0.5)
                    break
                except queue_mod.Full:
                    continue

    def _auto_commit(self) -> None:
        """An auto-commit: when the cluster does not answer, a warning, and the next period
        commits what is finished by then (an explicit :meth:`commit` raises instead)."""
        try:
            self._commit()
        except (UnavailableError, ServerError) as exc:
            log.warning("auto-commit failed, retrying at the next period: %s", exc)

    def _commit(self) -> None:
        state = self._state
        for (topic, queue), offset in state.to_commit().items():
            self._t.call(_api.commit_offset(self.group, topic, queue, offset))
            state.commit_done((topic, queue), offset)

    def _send_back(self, message: Message, delay_level: int) -> str:
        req = _api.send_back(self.group, message.topic, message.queue, message.offset, delay_level)
        answer = self._t.call(req)
        self._state.finish(message, message._epoch)
        self._state.refresh_soon(time.monotonic())
        return str(answer.get("target", "retry"))
