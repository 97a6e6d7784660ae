"""The drill's workload: producers of plain, delay-level and timer messages, and consumers.

Each message's body is its token (``<seed>-<n>``), known before it is sent. A produce is one
message per request with the token as Idempotency-Key, so the client's retries store it once.
An answer 4xx is ``fail``; no answer before the deadline (or a 5xx to the end) is ``unknown``.
Consumers read every queue of the topic from offset 0, each from one node until that node
fails to answer (killed, cut off, removed from the cluster), then from the next, and record
each message they see once per position.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from typing import Any

from chronomq._consume import FetchStart, Pulled, QueueCursor
from chronomq.cluster.cli.client import Client, ClientError
from chronomq.errors import ApiError
from chronomq.ops.drill.history import History, now_ms

TOPIC = "drill"
QUEUES = 4
PULL_DEADLINE_S = 1.5
"""How long a consumer retries one node before it reads from the next."""
PULL_MAX = 500
PULL_WAIT_MS = 500


@dataclass
class WorkloadConfig:
    rate: float = 100.0
    """Messages per second, all producers together."""
    producers: int = 8
    kinds: tuple[str, ...] = ("plain", "level", "timer")
    levels: int = 4
    timer_min_ms: int = 1_000
    timer_max_ms: int = 8_000
    cancel_fraction: float = 0.1
    produce_deadline_s: float = 10.0


@dataclass
class Workload:
    client: Client
    history: History
    rng: random.Random
    seed: int
    config: WorkloadConfig = field(default_factory=WorkloadConfig)
    tokens: int = 0
    acknowledged: set[str] = field(default_factory=set)
    cancelled: set[str] = field(default_factory=set)
    seen: set[str] = field(default_factory=set)
    latency_sink: Any = None
    """Optional ``fn(message: dict, consumed_ms: int)`` for the report's consumed stage."""
    cancel_tasks: list[asyncio.Task[None]] = field(default_factory=list)
    """The timer cancels waiting for their moment."""

    def next_token(self) -> str:
        self.tokens += 1
        return f"{self.seed}-{self.tokens}"

    # ------------------------------------------------------------------ producing

    async def produce_one(self, kind: str, extra: dict[str, Any]) -> dict[str, Any] | None:
        token = self.next_token()
        level = extra.get("delay_level")
        self.history.add("produce", "invoke", token=token, kind=kind, level=level)
        try:
            answer = await asyncio.wait_for(
                self.client.produce(TOPIC, [{"body": token, **extra}], idempotency_key=token),
                self.config.produce_deadline_s,
            )
        except ClientError as exc:
            outcome = "fail" if exc.status < 500 else "unknown"
            self.history.add("produce", outcome, token=token, error=str(exc)[:200])
            return None
        except (TimeoutError, ConnectionError, OSError) as exc:
            self.history.add("produce", "unknown", token=token, error=str(exc)[:200])
            return None
        r = answer["results"][0]
        due = r.get("deliver_ms", extra.get("deliver_at_ms"))
        self.history.add("produce", "ok", token=token, msg_id=r.get("msg_id"), due_ms=due)
        self.acknowledged.add(token)
        return {"token": token, **r}

    def _pick(self) -> tuple[str, dict[str, Any]]:
        kind = self.rng.choice(self.config.kinds)
        if kind == "level":
            return kind, {"delay_level": self.rng.randint(1, self.config.levels)}
        if kind == "timer":
            at = now_ms() + self.rng.randint(self.config.timer_min_ms, self.config.timer_max_ms)
            return kind, {"deliver_at_ms": at}
        return kind, {}

    async def _producer(self, stop_at: float) -> None:
        period = self.config.producers / max(self.config.rate, 0.1)
        nxt = time.monotonic()
        while time.monotonic() < stop_at:
            kind, extra = self._pick()
            answer = await self.produce_one(kind, extra)
            if (
                answer is not None
                and kind == "timer"
                and self.rng.random() < self.config.cancel_fraction
            ):
                wait_ms = max(0, extra["deliver_at_ms"] - now_ms() - 500)
                if wait_ms > 0:
                    delay = self.rng.uniform(0, wait_ms) / 1000
                    self.cancel_tasks.append(asyncio.create_task(self._cancel_later(answer, delay)))
            nxt += period
            await asyncio.sleep(max(0.0, nxt - time.monotonic()))

    async def _cancel_later(self, answer: dict[str, Any], delay_s: float) -> None:
        await asyncio.sleep(delay_s)
        token, msg_id = answer["token"], answer["msg_id"]
        self.history.add("cancel", "invoke", token=token, msg_id=msg_id)
        try:
            result = await asyncio.wait_for(
                self.client.cancel_timer(msg_id), self.config.produce_deadline_s
            )
        except (ClientError, TimeoutError, ConnectionError, OSError) as exc:
            self.history.add("cancel", "unknown", token=token, error=str(exc)[:200])
            return
        status = result.get("status")
        self.history.add("cancel", "ok", token=token, msg_id=msg_id, status=status)
        if status == "cancelled":
            self.cancelled.add(token)

    async def burst(self, n: int, level: int = 1) -> int:
        """``n`` messages at one level in few requests, so they fall due together; the due time."""
        tokens = [self.next_token() for _ in range(n)]
        due = 0
        for start in range(0, n, 500):
            chunk = tokens[start : start + 500]
            for t in chunk:
                self.history.add("produce", "invoke", token=t, kind="level", level=level)
            try:
                answer = await self.client.produce(
                    TOPIC,
                    [{"body": t, "delay_level": level} for t in chunk],
                    idempotency_key=f"burst-{chunk[0]}",
                )
            except (ClientError, TimeoutError, ConnectionError, OSError) as exc:
                for t in chunk:
                    self.history.add("produce", "unknown", token=t, error=str(exc)[:200])
                continue
            for t, r in zip(chunk, answer["results"], strict=True):
                self.history.add(
                    "produce", "ok", token=t, msg_id=r.get("msg_id"), due_ms=r["deliver_ms"]
                )
                self.acknowledged.add(t)
                due = max(due, int(r["deliver_ms"]))
        return due

    # ------------------------------------------------------------------ consuming

    async def _consumer(self, queue: int, stop: asyncio.Event) -> None:
        """Read ``queue`` from its start, one node at a time (the next when one fails), with
        the client library's :class:`QueueCursor`: every pull names the message read before
        its offset, and after a rewind (every node lost power under ``flush = async``)
        reading goes on from the first offset whose message changed, recorded as a
        ``rewind``."""
        cursor = QueueCursor(FetchStart(TOPIC, queue, 0), PULL_MAX, PULL_WAIT_MS)
        urls = self.client.urls
        node = queue % len(urls)
        while not stop.is_set():
            req = cursor.request()
            try:
                answer = await self.client.request(
                    req.method, req.target, url=urls[node], deadline_s=PULL_DEADLINE_S
                )
            except (ClientError, TimeoutError, ConnectionError, OSError) as exc:
                if isinstance(exc, ClientError):
                    got = cursor.refused(ApiError(exc.status, exc.body))
                    if got is not None:  # 409 offset_diverged: the search starts
                        self._rewound(got)
                        continue
                # Killed, cut off, or no longer a member (410): read from the next node.
                node = (node + 1) % len(urls)
                await asyncio.sleep(0.1)
                continue
            got = cursor.answered(answer)
            self._rewound(got)
            t = now_ms()
            for m in got.messages:
                token = m.get("body")
                self.history.add(
                    "consume",
                    "ok",
                    t_ms=t,
                    token=token,
                    msg_id=m["msg_id"],
                    topic=TOPIC,
                    queue=queue,
                    offset=m["offset"],
                    store_ms=m["store_ms"],
                )
                if isinstance(token, str):
                    self.seen.add(token)
                if self.latency_sink is not None:
                    self.latency_sink(m, t)

    def _rewound(self, got: Pulled) -> None:
        r = got.rewind
        if r is not None:
            self.history.add(
                "rewind", "ok", topic=r.topic, queue=r.queue, offset=r.old_offset, resume=r.offset
            )

    def start_consumers(self, stop: asyncio.Event) -> list[asyncio.Task[None]]:
        return [asyncio.create_task(self._consumer(q, stop)) for q in range(QUEUES)]

    async def run_producers(self, duration_s: float) -> None:
        stop_at = time.monotonic() + duration_s
        await asyncio.gather(*(self._producer(stop_at) for _ in range(self.config.producers)))

    async def wait_cancels(self) -> None:
        if self.cancel_tasks:
            await asyncio.gather(*self.cancel_tasks, return_exceptions=True)

    async def read_past_sentinels(self, deadline_s: float) -> bool:
        """Write a plain message to every queue, after everything else, and wait until the
        consumers have read each: then every queue was read to where it ended when the
        sentinels were written (a duplicate written before them has been seen). False when a
        sentinel was not acknowledged or not read in time."""
        tokens = []
        for q in range(QUEUES):
            answer = await self.produce_one("plain", {"queue": q})
            if answer is None:
                return False
            tokens.append(answer["token"])
        deadline = time.monotonic() + deadline_s
        while not self.seen.issuperset(tokens):
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.05)
        return True

    async def final_read(self, deadline_s: float = 60.0) -> bool:
        """Read every queue again from offset 0 and record which tokens the log holds now
        (one ``final`` record per queue): a message consumed and then lost from the log (a
        power cut) shows up missing there. False when a queue could not be read to its end."""
        deadline = time.monotonic() + deadline_s
        for q in range(QUEUES):
            offset, tokens = 0, list[Any]()
            while True:
                if time.monotonic() > deadline:
                    return False
                path = f"/v1/topics/{TOPIC}/queues/{q}/messages?offset={offset}&max=500"
                try:
                    page = await self.client.request("GET", path, deadline_s=5)
                except (ClientError, TimeoutError, ConnectionError, OSError):
                    await asyncio.sleep(0.2)
                    continue
                tokens.extend(m.get("body") for m in page["messages"])
                if not page["messages"] or page["next_offset"] <= offset:
                    break
                offset = page["next_offset"]
            self.history.add("final", "ok", queue=q, tokens=tokens)
        return True

    def outstanding(self) -> int:
        """Acknowledged messages not yet seen (cancelled timers excluded)."""
        return len(self.acknowledged - self.cancelled - self.seen)
