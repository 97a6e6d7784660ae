"""The drill's gRPC workload: the official RocketMQ 5 Python client, unchanged.

Producers send plain messages, timers (``delivery_timestamp``, whole seconds, as the client
takes it) and 4.x delay levels (the ``DELAY`` user property) with :class:`rocketmq.Producer`.
Each message's body is its token (``<seed>-<n>``), chosen before the send. The client keeps
its ``message_id`` across its own retries and the broker uses it as the send's idempotency key,
so a send retried across a failover is stored once. An answer that refuses the message (a bad
request) is ``fail``; any other error, the client's retries used up or no answer in time, is
``unknown``.

Consumers are :class:`rocketmq.SimpleConsumer` members of one group: receive (pop), then ack
each message, through the faults. A few messages are deliberately left unacked, so they come
back after their invisible time: the revive path runs through the faults too. Every receive
and every ack is recorded: the checker (:func:`chronomq.ops.drill.checker.check` with
``delivery="pop"``) counts a message acked successfully more than once as duplicated, and a
message received again after an ack failed or its invisible time passed as redelivered.

The due time of a timer is the one sent. The broker decides a delay level's due time from its
store time, which the send receipt does not carry; the drill takes the invoke time plus the
level's delay, never later than the real one, so the early check stays sound.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import random
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Final, TypeVar

from rocketmq import (
    ClientConfiguration,
    Credentials,
    FilterExpression,
    Message,
    Producer,
    SimpleConsumer,
)
from rocketmq.v5.exception import (
    BadRequestException,
    ForbiddenException,
    NotFoundException,
    PayloadEmptyException,
    PayloadTooLargeException,
    UnauthorizedException,
)

from chronomq.ops.drill.context import blocking
from chronomq.ops.drill.history import History, now_ms
from chronomq.ops.drill.workload import TOPIC, WorkloadConfig

GROUP: Final = "drill-grpc"
DELAY_PROPERTY: Final = "DELAY"
REFUSED: Final = (
    BadRequestException,
    ForbiddenException,
    NotFoundException,
    PayloadEmptyException,
    PayloadTooLargeException,
    UnauthorizedException,
)
"""Errors that mean the broker refused the send: nothing was stored (``fail``)."""

T = TypeVar("T")


@dataclass
class GrpcConfig:
    consumers: int = 2
    """SimpleConsumer instances (each its own client and connections)."""
    receivers: int = 2
    """Concurrent receive loops per consumer."""
    batch: int = 32
    invisible_s: int = 5
    await_s: int = 2
    """The receive's long poll."""
    request_timeout_s: int = 3
    skip_ack_fraction: float = 0.03
    """Messages received and deliberately not acked, so that they come back."""
    call_deadline_s: float = 20.0
    """Bound on any one client call as the drill awaits it."""
    burst_in_flight: int = 64
    ack_threads: int = 8
    """Threads for acks: the client's ``ack_async`` returns None (rocketmq-python-client
    5.1.2), so the drill calls the blocking ``ack`` on its own pool."""


@dataclass
class GrpcWorkload:
    endpoints: str
    history: History
    rng: random.Random
    seed: int
    level_delays_ms: tuple[int, ...]
    """The cluster's ``message_delay_level`` table (level n waits ``[n - 1]``)."""
    token: str | None = None
    config: WorkloadConfig = field(default_factory=WorkloadConfig)
    grpc: GrpcConfig = field(default_factory=GrpcConfig)
    tokens: int = 0
    acknowledged: set[str] = field(default_factory=set)
    cancelled: set[str] = field(default_factory=set)
    """Kept for the drill's interface: the gRPC workload recalls nothing."""
    cancel_tasks: list[asyncio.Task[None]] = field(default_factory=list)
    """Kept for the drill's interface: the gRPC workload recalls nothing."""
    seen: set[str] = field(default_factory=set)
    acked: set[str] = field(default_factory=set)
    """Tokens with at least one successful ack."""
    maybe_acked: set[str] = field(default_factory=set)
    """Tokens with an ack left without an answer: it may have counted, then nothing returns."""
    _producer: Producer | None = None
    _consumers: list[SimpleConsumer] = field(default_factory=list)
    _ack_pool: concurrent.futures.ThreadPoolExecutor | None = None

    def _client_config(self) -> ClientConfiguration:
        credentials = Credentials("drill", self.token) if self.token else Credentials()
        return ClientConfiguration(
            self.endpoints, credentials, request_timeout=self.grpc.request_timeout_s
        )

    async def start(self) -> None:
        """Start the producer, then the consumers (their startup needs the topic's route)."""
        config = self._client_config()

        def start_producer() -> Producer:
            p = Producer(config, (TOPIC,))
            p.startup()
            return p

        self._ack_pool = concurrent.futures.ThreadPoolExecutor(
            self.grpc.ack_threads, thread_name_prefix="drill-ack"
        )
        self._producer = await blocking(start_producer)
        for _ in range(self.grpc.consumers):

            def start_consumer() -> SimpleConsumer:
                c = SimpleConsumer(
                    config, GROUP, {TOPIC: FilterExpression()}, await_duration=self.grpc.await_s
                )
                c.startup()
                return c

            self._consumers.append(await blocking(start_consumer))

    async def close(self) -> None:
        # Shut down with receives still pending (the drill was interrupted), the client
        # cancels them and then calls back on the executor it has just removed: each logs an
        # AttributeError traceback. Nothing is lost by it.
        logging.getLogger("concurrent.futures").addFilter(_callback_after_shutdown)
        for client in [*self._consumers, self._producer]:
            if client is not None:
                # A client that failed to start, or already stopped, refuses to shut down.
                with contextlib.suppress(Exception):
                    await blocking(client.shutdown)
        self._consumers.clear()
        self._producer = None
        if self._ack_pool is not None:
            self._ack_pool.shutdown(wait=False, cancel_futures=True)
            self._ack_pool = None

    async def _wait(self, future: concurrent.futures.Future[T]) -> T:
        return await asyncio.wait_for(asyncio.wrap_future(future), self.grpc.call_deadline_s)

    def next_token(self) -> str:
        self.tokens += 1
        return f"{self.seed}-{self.tokens}"

    # ------------------------------------------------------------------ producing

    def _message(self, token: str, level: int | None, at_s: int | None) -> Message:
        m = Message()
        m.topic = TOPIC
        m.body = token.encode()
        if level is not None:
            m.add_property(DELAY_PROPERTY, str(level))
        if at_s is not None:
            m.delivery_timestamp = at_s
        return m

    def _due_ms(self, invoked_ms: int, level: int | None, at_s: int | None) -> int | None:
        if at_s is not None:
            return at_s * 1000
        if level is not None:
            delays = self.level_delays_ms
            return invoked_ms + delays[min(level, len(delays)) - 1]
        return None

    async def _send(self, kind: str, level: int | None = None, at_s: int | None = None) -> bool:
        assert self._producer is not None, "start() first"
        token = self.next_token()
        invoked = now_ms()
        self.history.add("produce", "invoke", t_ms=invoked, token=token, kind=kind, level=level)
        message = self._message(token, level, at_s)
        try:
            receipt = await self._wait(self._producer.send_async(message))
        except REFUSED as exc:
            self.history.add("produce", "fail", token=token, error=str(exc)[:200])
            return False
        except Exception as exc:  # noqa: BLE001 - any other end: it may have been stored
            self.history.add(
                "produce", "unknown", token=token, error=f"{type(exc).__name__}: {exc}"[:200]
            )
            return False
        self.history.add(
            "produce",
            "ok",
            token=token,
            msg_id=receipt.message_id,
            due_ms=self._due_ms(invoked, level, at_s),
        )
        self.acknowledged.add(token)
        return True

    def _pick(self) -> tuple[str, int | None, int | None]:
        kind = self.rng.choice(self.config.kinds)
        if kind == "level":
            return kind, self.rng.randint(1, self.config.levels), None
        if kind == "timer":
            at_ms = now_ms() + self.rng.randint(self.config.timer_min_ms, self.config.timer_max_ms)
            return kind, None, -(-at_ms // 1000)  # whole seconds, rounded up
        return kind, None, None

    async def _producer_loop(self, stop_at: float) -> None:
        period = self.config.producers / max(self.config.rate, 0.1)
        nxt = time.monotonic()
        while time.monotonic() < stop_at:
            await self._send(*self._pick())
            nxt += period
            await asyncio.sleep(max(0.0, nxt - time.monotonic()))

    async def run_producers(self, duration_s: float) -> None:
        stop_at = time.monotonic() + duration_s
        await asyncio.gather(*(self._producer_loop(stop_at) for _ in range(self.config.producers)))

    async def wait_cancels(self) -> None:
        return None

    async def burst(self, n: int, level: int = 1) -> int:
        """``n`` messages at one level, sent at once, so they fall due together; the latest
        due time of those acknowledged."""
        gate = asyncio.Semaphore(self.grpc.burst_in_flight)
        started = now_ms()

        async def one() -> None:
            async with gate:
                await self._send("level", level=level)

        await asyncio.gather(*(one() for _ in range(n)))
        return self._due_ms(started, level, None) or started

    # ------------------------------------------------------------------ consuming

    async def _receiver(self, consumer: SimpleConsumer, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                messages = await self._wait(
                    consumer.receive_async(self.grpc.batch, self.grpc.invisible_s)
                )
            except Exception:  # noqa: BLE001 - a node killed or cut off: try again
                await asyncio.sleep(0.1)
                continue
            t = now_ms()
            acks: list[Awaitable[None]] = []
            for m in messages:
                body = m.body
                token = body.decode(errors="replace") if isinstance(body, bytes) else str(body)
                attempt = int(m.delivery_attempt or 0)
                self.history.add(
                    "consume",
                    "ok",
                    t_ms=t,
                    token=token,
                    msg_id=m.message_id,
                    topic=m.topic,
                    attempt=attempt,
                    handed_ms=m.transport_delivery_timestamp,
                    delivery_ms=m.delivery_timestamp or None,
                )
                self.seen.add(token)
                if self.rng.random() < self.grpc.skip_ack_fraction:
                    self.history.add("ack", "skip", token=token, attempt=attempt)
                else:
                    acks.append(self._ack(consumer, m, token, attempt))
            if acks:
                await asyncio.gather(*acks)

    async def _ack(self, consumer: SimpleConsumer, m: Message, token: str, attempt: int) -> None:
        self.history.add("ack", "invoke", token=token, attempt=attempt)
        try:
            assert self._ack_pool is not None, "start() first"
            await self._wait(self._ack_pool.submit(consumer.ack, m))
        except BadRequestException as exc:
            # INVALID_RECEIPT_HANDLE: revived, handed out again or sent to the DLQ meanwhile.
            self.history.add("ack", "fail", token=token, attempt=attempt, error=str(exc)[:200])
            return
        except Exception as exc:  # noqa: BLE001 - no answer: the ack may or may not count
            self.history.add(
                "ack",
                "unknown",
                token=token,
                attempt=attempt,
                error=f"{type(exc).__name__}: {exc}"[:200],
            )
            self.maybe_acked.add(token)
            return
        self.history.add("ack", "ok", token=token, attempt=attempt)
        self.acked.add(token)

    def start_consumers(self, stop: asyncio.Event) -> list[asyncio.Task[None]]:
        return [
            asyncio.create_task(self._receiver(c, stop))
            for c in self._consumers
            for _ in range(self.grpc.receivers)
        ]

    def outstanding(self) -> int:
        """Acknowledged messages not yet acked by a consumer (each will be received again),
        leaving out those whose ack went unanswered (they may never come back)."""
        return len(self.acknowledged - self.cancelled - self.acked - self.maybe_acked)

    async def read_past_sentinels(self, deadline_s: float) -> bool:
        """Keep receiving for an invisible time and a bit after everything was acked: a
        message handed out again although acked (a duplicate) shows up by then. False when
        some acknowledged message was still unacked at the start."""
        settled = self.outstanding() == 0
        await asyncio.sleep(min(deadline_s, self.grpc.invisible_s + 3.0))
        return settled


def _callback_after_shutdown(record: logging.LogRecord) -> bool:
    """False for the traceback rocketmq-python-client (5.1.2) logs when it calls back a
    cancelled receive on the executor its shutdown removed (``'NoneType' object has no
    attribute 'submit'``); True for everything else."""
    exc = record.exc_info[1] if record.exc_info else None
    return not (isinstance(exc, AttributeError) and "'submit'" in str(exc))
