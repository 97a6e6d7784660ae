"""The Python client (async, on aiohttp).

* Leader discovery: writes go to the last known leader; a 503 naming the leader, or the
  ``X-Chronomq-Leader`` header of a forwarded answer, moves the client there.
* Retries with exponential back-off and an overall deadline; every produce carries an
  ``Idempotency-Key`` so a retried request is stored once.
* :class:`BatchingProducer` groups single sends into batches; :class:`Consumer` pulls with
  long-polling and commits its offsets to the cluster, and can log when each message was
  consumed (:class:`ConsumedLog`) for ``chronomq report``.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import random
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
import orjson
import yarl

from chronomq._wire import path as _path
from chronomq._wire import query as _query
from chronomq.cluster.logs.schema import consumed_line

if TYPE_CHECKING:
    from chronomq.cluster.logs.writer import LogWriter, WriterStats

RETRYABLE = {429, 502, 503, 504}


MAX_RETRY_AFTER_S = 5.0


def _error_code(body: Any) -> str | None:
    code = body.get("error") if isinstance(body, dict) else None
    return code if isinstance(code, str) else None


def _retry_after_s(value: str | None) -> float:
    """A Retry-After header in seconds (the delay form only), at most MAX_RETRY_AFTER_S."""
    if not value:
        return 0.0
    try:
        return min(max(float(value), 0.0), MAX_RETRY_AFTER_S)
    except ValueError:
        return 0.0


_log_names = itertools.count()


class ClientError(Exception):
    def __init__(self, status: int, body: Any) -> None:
        self.status = status
        self.body = body
        msg = body.get("message") if isinstance(body, dict) else str(body)
        code = body.get("error") if isinstance(body, dict) else "error"
        super().__init__(f"HTTP {status} {code}: {msg}")


class Client:
    def __init__(
        self,
        urls: Sequence[str],
        *,
        token: str | None = None,
        ca_file: str | None = None,
        deadline_s: float = 30.0,
        request_timeout_s: float = 15.0,
    ) -> None:
        """``token``: the cluster's auth_token, sent as ``Authorization: Bearer``.
        ``ca_file``: PEM certificates that https node URLs are checked against instead of the
        system's store (e.g. the cluster's self-signed certificate)."""
        if not urls:
            raise ValueError("at least one node URL is needed")
        self.urls = [u.rstrip("/") for u in urls]
        self._leader: str | None = None
        self._token = token
        self._ca_file = ca_file
        self.deadline_s = deadline_s
        self._timeout = aiohttp.ClientTimeout(total=request_timeout_s)
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Client:
        headers = {"Authorization": f"Bearer {self._token}"} if self._token else None
        connector = None
        if self._ca_file:
            from chronomq.cluster.node.tls import client_context

            connector = aiohttp.TCPConnector(ssl=client_context(self._ca_file))
        self._session = aiohttp.ClientSession(
            headers=headers, timeout=self._timeout, connector=connector
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    # ------------------------------------------------------------------ transport

    async def request(
        self,
        method: str,
        path: str,
        *,
        json_body: Any = None,
        headers: dict[str, str] | None = None,
        url: str | None = None,
        write: bool = False,
        deadline_s: float | None = None,
    ) -> Any:
        """Send a request, retrying retryable failures until the deadline."""
        assert self._session is not None, "use 'async with Client(...)'"
        deadline = time.monotonic() + (deadline_s if deadline_s is not None else self.deadline_s)
        attempt = 0
        last_error: Exception | None = None
        data = orjson.dumps(json_body) if json_body is not None else None
        hdrs = {"Content-Type": "application/json", **(headers or {})}
        while True:
            retry_after_s = 0.0
            base = url or (
                self._leader if write and self._leader else self.urls[attempt % len(self.urls)]
            )
            try:
                # ``path`` is sent as written: dynamic segments are percent-encoded by the
                # methods below (_path); a plain string would let yarl decode ``%de`` in
                # ``%RETRY%default`` into another topic.
                url_ = yarl.URL(base + path, encoded=True)
                async with self._session.request(method, url_, data=data, headers=hdrs) as r:
                    raw = await r.read()
                    body = orjson.loads(raw) if raw else None
                    leader = r.headers.get("X-Chronomq-Leader")
                    if write and r.status < 400:
                        self._leader = leader or base
                    if r.status < 400:
                        return body
                    if isinstance(body, dict) and body.get("leader"):
                        self._leader = body["leader"]
                    elif write and self._leader == base:
                        # The node we took for the leader cannot serve writes now (lost its
                        # quorum, or is on the minority side of a partition): ask the others.
                        self._leader = None
                    removed = r.status == 410 and _error_code(body) == "removed_from_cluster"
                    if removed and self._leader == base:
                        self._leader = None  # a node removed from the cluster: ask another
                    if r.status not in RETRYABLE and not removed:
                        raise ClientError(r.status, body)
                    last_error = ClientError(r.status, body)
                    retry_after_s = _retry_after_s(r.headers.get("Retry-After"))
            except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError) as exc:
                last_error = exc
                if write and self._leader == base:
                    self._leader = None
            attempt += 1
            backoff = min(0.025 * 2**attempt, 0.25) * (0.5 + random.random())
            if retry_after_s:
                # The node said when to come back (429 overloaded, 503 with Retry-After): a
                # write retried sooner only adds to its load. The same key goes again.
                backoff = max(backoff, retry_after_s * (0.5 + random.random() / 2))
            if time.monotonic() + backoff > deadline:
                if isinstance(last_error, ClientError):
                    raise last_error
                raise ConnectionError(f"{method} {path} failed until the deadline: {last_error}")
            await asyncio.sleep(backoff)

    # ------------------------------------------------------------------ API

    async def produce(
        self, topic: str, messages: Sequence[dict[str, Any]], *, idempotency_key: str | None = None
    ) -> dict[str, Any]:
        key = idempotency_key or uuid.uuid4().hex
        result: dict[str, Any] = await self.request(
            "POST",
            _path("v1", "topics", topic, "messages"),
            json_body={"messages": list(messages)},
            headers={"Idempotency-Key": key},
            write=True,
        )
        return result

    async def send(self, topic: str, body: str, **fields: Any) -> dict[str, Any]:
        result = await self.produce(topic, [{"body": body, **fields}])
        first: dict[str, Any] = result["results"][0]
        return first

    async def pull(
        self,
        topic: str,
        queue: int,
        offset: int,
        max_messages: int = 32,
        wait_ms: int = 0,
        url: str | None = None,
        prev: str | None = None,
    ) -> dict[str, Any]:
        """A page from ``offset``; with ``prev`` (the msg_id read at ``offset - 1``) a 409
        ``offset_diverged`` when the log no longer holds it there."""
        path = _path("v1", "topics", topic, "queues", queue, "messages") + _query(
            offset=offset, max=max_messages, wait_ms=wait_ms, prev=prev
        )
        result: dict[str, Any] = await self.request("GET", path, url=url)
        return result

    async def topic(self, topic: str) -> dict[str, Any]:
        result: dict[str, Any] = await self.request("GET", _path("v1", "topics", topic))
        return result

    async def topics(self) -> dict[str, Any]:
        result: dict[str, Any] = await self.request("GET", "/v1/topics")
        return result

    async def create_topic(self, topic: str, queues: int) -> dict[str, Any]:
        result: dict[str, Any] = await self.request(
            "PUT", _path("v1", "topics", topic), json_body={"queues": queues}, write=True
        )
        return result

    async def commit_offset(self, group: str, topic: str, queue: int, offset: int) -> None:
        await self.request(
            "PUT",
            _path("v1", "groups", group, "offsets"),
            json_body={"topic": topic, "queue": queue, "offset": offset},
            write=True,
        )

    async def offsets(
        self, group: str, topic: str | None = None, url: str | None = None
    ) -> list[dict[str, Any]]:
        target = _path("v1", "groups", group, "offsets") + _query(topic=topic or None)
        result = await self.request("GET", target, url=url)
        offsets: list[dict[str, Any]] = result["offsets"]
        return offsets

    async def retry(
        self, group: str, topic: str, queue: int, offset: int, delay_level: int = 0
    ) -> dict[str, Any]:
        """Send a consumed message back; ``delay_level`` 0 lets the broker pick 3 + retries."""
        body: dict[str, Any] = {"topic": topic, "queue": queue, "offset": offset}
        if delay_level:
            body["delay_level"] = delay_level
        result: dict[str, Any] = await self.request(
            "POST", _path("v1", "groups", group, "retry"), json_body=body, write=True
        )
        return result

    async def schedule(self, url: str | None = None) -> dict[str, Any]:
        """The schedule service's levels, mode and pause switch."""
        result: dict[str, Any] = await self.request("GET", "/v1/admin/schedule", url=url)
        return result

    async def set_schedule(
        self, *, mode: str | None = None, paused: bool | None = None
    ) -> dict[str, Any]:
        """Switch delivery mode or pause delivery, cluster-wide."""
        body: dict[str, Any] = {}
        if mode is not None:
            body["mode"] = mode
        if paused is not None:
            body["paused"] = paused
        result: dict[str, Any] = await self.request(
            "PATCH", "/v1/admin/schedule", json_body=body, write=True
        )
        return result

    async def cancel_timer(self, msg_id: str) -> dict[str, Any]:
        """Cancel a timer message: ``{"status": "cancelled" | "delivered" | "unknown", ...}``."""
        result: dict[str, Any] = await self.request(
            "DELETE", _path("v1", "timers", msg_id), write=True
        )
        return result

    async def timer_status(self, url: str | None = None) -> dict[str, Any]:
        """``GET /v1/admin/timer`` of one node (any node if ``url`` is not given)."""
        result: dict[str, Any] = await self.request("GET", "/v1/admin/timer", url=url)
        return result

    async def timer_switches(
        self, *, stop_enqueue: bool | None = None, stop_dequeue: bool | None = None
    ) -> dict[str, Any]:
        """Stop or start timer enqueue/delivery cluster-wide; returns the switches."""
        body = {
            k: v
            for k, v in (("stop_enqueue", stop_enqueue), ("stop_dequeue", stop_dequeue))
            if v is not None
        }
        result: dict[str, Any] = await self.request(
            "POST", "/v1/admin/timer/switches", json_body=body, write=True
        )
        return result

    async def cluster(self, url: str | None = None) -> dict[str, Any]:
        result: dict[str, Any] = await self.request("GET", "/v1/admin/cluster", url=url)
        return result

    async def node(self, url: str) -> dict[str, Any]:
        result: dict[str, Any] = await self.request("GET", "/v1/admin/node", url=url)
        return result

    async def admin_config(self) -> dict[str, Any]:
        result: dict[str, Any] = await self.request("GET", "/v1/admin/config")
        return result

    async def patch_config(self, changes: dict[str, Any]) -> dict[str, Any]:
        result: dict[str, Any] = await self.request(
            "PATCH", "/v1/admin/config", json_body=changes, write=True
        )
        return result

    async def transfer_leadership(
        self, to: int | None, timeout_ms: int | None = None
    ) -> dict[str, Any]:
        """Move the leadership to node ``to`` (None: the most caught-up follower); answers
        ``{"status": "transferred", "leader", "term", "waited_ms", ...}`` once it has moved.
        A refusal raises :class:`ClientError` (409 with ``reason``; 504 is retried until the
        client's deadline)."""
        body: dict[str, Any] = {"to": to} if to is not None else {}
        if timeout_ms is not None:
            body["timeout_ms"] = timeout_ms
        result: dict[str, Any] = await self.request(
            "POST", "/v1/admin/leadership/transfer", json_body=body, write=True
        )
        return result


class BatchingProducer:
    """Collects single messages and sends them in batches of up to ``max_batch``."""

    def __init__(
        self, client: Client, topic: str, *, max_batch: int = 100, linger_ms: int = 5
    ) -> None:
        self.client = client
        self.topic = topic
        self.max_batch = max_batch
        self.linger_s = linger_ms / 1000
        self._pending: list[tuple[dict[str, Any], asyncio.Future[dict[str, Any]]]] = []
        self._flusher: asyncio.Task[None] | None = None

    async def send(self, message: dict[str, Any]) -> dict[str, Any]:
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending.append((message, fut))
        if len(self._pending) >= self.max_batch:
            await self._flush()
        elif self._flusher is None:
            self._flusher = asyncio.create_task(self._linger())
        return await fut

    async def _linger(self) -> None:
        await asyncio.sleep(self.linger_s)
        self._flusher = None
        await self._flush()

    async def _flush(self) -> None:
        batch, self._pending = self._pending[: self.max_batch], self._pending[self.max_batch :]
        if not batch:
            return
        try:
            result = await self.client.produce(self.topic, [m for m, _ in batch])
            for (_, fut), r in zip(batch, result["results"], strict=True):
                if not fut.done():
                    fut.set_result(r)
        except Exception as exc:
            for _, fut in batch:
                if not fut.done():
                    fut.set_exception(exc)

    async def flush(self) -> None:
        while self._pending:
            await self._flush()


class ConsumedLog:
    """``consumed`` latency lines of what this client consumed, for ``chronomq report``.

    Written by a background :class:`chronomq.cluster.logs.writer.LogWriter` to ``<directory>/<name>/``
    (``name`` defaults to ``client-<pid>-<n>``, unique in the process); give the report this
    directory next to the nodes' ones. :meth:`consumed` never blocks; :meth:`close` drains.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        name: str | None = None,
        *,
        sample_rate: float = 1.0,
    ) -> None:
        from chronomq.cluster.logs.writer import LogWriter, LogWriterConfig

        self.name = name or f"client-{os.getpid()}-{next(_log_names)}"
        self.directory = Path(directory).absolute()
        self.writer: LogWriter = LogWriter(
            self.directory, self.name, LogWriterConfig(sample_rate=sample_rate)
        ).start()

    def consumed(
        self, topic: str, messages: Sequence[Mapping[str, Any]], consumed_ms: int | None = None
    ) -> None:
        """Messages pulled from ``topic`` and handed to the application at ``consumed_ms``."""
        if not messages:
            return
        at_ms = time.time_ns() // 1_000_000 if consumed_ms is None else consumed_ms
        name = self.name
        from chronomq.cluster.logs.schema import RecordType

        self.writer.write_rows(
            RecordType.LATENCY,
            messages,
            lambda m: consumed_line(m, topic, at_ms, name),
            lambda m: str(m["msg_id"]),
        )

    def close(self) -> WriterStats:
        return self.writer.close()


class Consumer:
    """Pulls one queue from its committed offset and commits as it goes.

    With ``latency_log_dir``, every message :meth:`poll` returns is logged as consumed
    (:class:`ConsumedLog`, named ``latency_log_name``); :meth:`close` then drains that log.
    """

    def __init__(
        self,
        client: Client,
        group: str,
        topic: str,
        queue: int,
        *,
        latency_log_dir: str | os.PathLike[str] | None = None,
        latency_log_name: str | None = None,
    ) -> None:
        self.client = client
        self.group = group
        self.topic = topic
        self.queue = queue
        self.offset: int | None = None
        self.latency_log = (
            ConsumedLog(latency_log_dir, latency_log_name) if latency_log_dir is not None else None
        )

    async def __aenter__(self) -> Consumer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self.latency_log is not None:
            await asyncio.to_thread(self.latency_log.close)

    async def _start_offset(self) -> int:
        for o in await self.client.offsets(self.group, self.topic):
            if o["queue"] == self.queue:
                return int(o["offset"])
        return 0

    async def poll(self, max_messages: int = 32, wait_ms: int = 1000) -> list[dict[str, Any]]:
        if self.offset is None:
            self.offset = await self._start_offset()
        data = await self.client.pull(self.topic, self.queue, self.offset, max_messages, wait_ms)
        self.offset = data["next_offset"]
        messages: list[dict[str, Any]] = data["messages"]
        if self.latency_log is not None:
            self.latency_log.consumed(self.topic, messages)
        return messages

    async def commit(self) -> None:
        if self.offset is not None:
            await self.client.commit_offset(self.group, self.topic, self.queue, self.offset)
