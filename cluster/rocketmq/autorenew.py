"""The driver of :mod:`chronomq.cluster.rocketmq.renew` on a node's event loop.

One task sweeps the registry every :func:`sweep_period_s` (a sixth of the invisible time, at
most 5 s, as RocketMQ's proxy sweeps every 5 s); when renewals are held back by the rate it
looks again sooner. Due hand-outs (most urgent first, as many as ``renew_max_per_second``
allows) are renewed in batches of :data:`BATCH` by the ``renew`` function the servicer gives:
one ``chg`` command per batch on the leader, one forward per handle (at most
:data:`MAX_FORWARDS_IN_FLIGHT` at once) to the leader's ``POST /v1/groups/{g}/invisible``
from a follower, with no retry: a renewal whose outcome is unknown is tried again when next
due, and a stale answer then ends the tracking.

The servicer calls :meth:`AutoRenewer.track` after a receive with ``auto_renew``,
:meth:`AutoRenewer.saw` whenever a client id makes a call, :meth:`AutoRenewer.client_gone`
on ``NotifyClientTermination``, and wraps ack, change and forward in :meth:`AutoRenewer.hold`
/ :meth:`AutoRenewer.release`: a renewal in flight on one of the handles ends first (within
the call's time), so the call acts on the newest handle.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, Final

from chronomq.cluster.rocketmq.metrics import GrpcMetrics
from chronomq.cluster.rocketmq.renew import (
    RenewRegistry,
    StopReason,
    TokenBucket,
    Tracked,
    client_id_problem,
)
from chronomq.pop import MAX_ITEMS_PER_COMMAND

log = logging.getLogger(__name__)

BATCH: Final = MAX_ITEMS_PER_COMMAND
"""Renewals per ``chg`` command (and per batch of forwards from a follower)."""
MAX_BATCHES_IN_FLIGHT: Final = 4
MAX_FORWARDS_IN_FLIGHT: Final = 16
"""Renewals a follower forwards to the leader at once."""
MAX_SWEEP_S: Final = 5.0
MIN_SWEEP_S: Final = 0.05
BACKLOG_SWEEP_S: Final = 0.2
"""How soon to look again when renewals were held back by the rate."""


class RenewStatus(Enum):
    CHANGED = "changed"
    EXPIRED = "expired"
    ERROR = "error"


@dataclass(frozen=True, slots=True)
class RenewAnswer:
    status: RenewStatus
    receipt_handle: str | None = None
    invisible_until_ms: int | None = None


RenewFn = Callable[[Sequence[Tracked], int], Awaitable[list[RenewAnswer]]]
"""Renew these hand-outs (by their ``current`` handle) for ``invisible_ms``; one answer each."""


def wall_ms() -> int:
    return time.time_ns() // 1_000_000


def sweep_period_s(invisible_ms: int) -> float:
    return max(MIN_SWEEP_S, min(MAX_SWEEP_S, invisible_ms / 6000))


class AutoRenewer:
    """Renews the auto_renew hand-outs one node served (event loop only)."""

    def __init__(
        self,
        renew: RenewFn,
        metrics: GrpcMetrics,
        *,
        invisible_ms: int,
        max_renew_ms: int,
        max_tracked: int,
        max_per_second: int,
        now_ms: Callable[[], int] = wall_ms,
    ) -> None:
        self.registry = RenewRegistry(
            invisible_ms=invisible_ms, max_renew_ms=max_renew_ms, max_tracked=max_tracked
        )
        self.invisible_ms = invisible_ms
        self.metrics = metrics
        self._renew = renew
        self._now_ms = now_ms
        self._bucket = TokenBucket(max_per_second, now_ms())
        self._inflight: dict[str, asyncio.Future[None]] = {}
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self.period_s = sweep_period_s(invisible_ms)

    @classmethod
    def from_config(cls, config: Any, renew: RenewFn, metrics: GrpcMetrics) -> AutoRenewer:
        return cls(
            renew,
            metrics,
            invisible_ms=int(config.default_invisible_time_ms),
            max_renew_ms=int(config.renew_max_time_ms),
            max_tracked=int(config.renew_max_tracked),
            max_per_second=int(config.renew_max_per_second),
        )

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run(self) -> None:
        while True:
            try:
                wait_s = await self.sweep()
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug must not end renewals for good
                log.exception("auto-renew sweep failed")
                wait_s = self.period_s
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), wait_s)

    # ------------------------------------------------------------------ the servicer's calls

    def track(
        self, group: str, topic: str, client_id: str | None, handed: Iterable[tuple[str, int]]
    ) -> int:
        """Renew these hand-outs ((receipt handle, invisible-until ms) each) of ``client_id``;
        how many are tracked (none without a usable client id)."""
        if client_id is None or client_id_problem(client_id) is not None:
            return 0
        now = self._now_ms()
        n = 0
        soonest: int | None = None
        for handle, until_ms in handed:
            dropped = self.registry.track(
                handle,
                group=group,
                topic=topic,
                client_id=client_id,
                invisible_until_ms=until_ms,
                now_ms=now,
            )
            if dropped:
                self.metrics.renew_stopped.labels(StopReason.DROPPED.value).inc(len(dropped))
            n += 1
            soonest = until_ms if soonest is None else min(soonest, until_ms)
        self._gauge()
        if soonest is not None and soonest - now <= self.registry.ahead_ms:
            self._wake.set()  # due at once (a very short invisible time)
        return n

    def saw(self, client_id: str | None) -> None:
        if client_id:
            self.registry.saw_client(client_id, self._now_ms())

    def client_gone(self, client_id: str | None) -> None:
        if not client_id:
            return
        gone = self.registry.client_gone(client_id)
        if gone:
            self.metrics.renew_stopped.labels(StopReason.CLIENT_GONE.value).inc(len(gone))
            self._gauge()

    async def hold(self, handles: Sequence[str], timeout_s: float) -> list[str]:
        """The handle to act on for each of ``handles`` (the newest of a tracked hand-out,
        which is then not renewed until :meth:`release`), after waiting up to ``timeout_s``
        for renewals of them in flight."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(0.0, timeout_s)
        out = []
        for h in handles:
            while self.registry.renewing(h):
                fut = self._inflight.get(h)
                left = deadline - loop.time()
                if fut is None or left <= 0:
                    break
                await asyncio.wait([fut], timeout=left)
            entry = self.registry.get(h)
            if entry is not None and entry.renewing:  # still unknown: act on the last known
                out.append(entry.current)
            else:
                out.append(self.registry.hold(h, self._now_ms()))
        return out

    def release(self, handles: Sequence[str], reasons: Sequence[StopReason | None]) -> None:
        """The call on ``handles`` (as given to :meth:`hold`) ended: stop renewing each whose
        reason is given (acked, changed, forwarded, or ``stale`` when the hand-out was over),
        renew the others (``None``: the call failed and may be retried) again."""
        n = 0
        for h, why in zip(handles, reasons, strict=True):
            if self.registry.release(h, why is not None) is not None and why is not None:
                self.metrics.renew_stopped.labels(why.value).inc()
                n += 1
        if n:
            self._gauge()

    # ------------------------------------------------------------------ renewing

    def _gauge(self) -> None:
        self.metrics.renew_tracked.set(len(self.registry))

    async def sweep(self) -> float:
        """One pass: stop what must stop, renew what is due (within the rate); how long to
        wait before the next."""
        now = self._now_ms()
        found = self.registry.sweep(now)
        for _entry, why in found.stopped:
            self.metrics.renew_stopped.labels(why.value).inc()
        allowed = self._bucket.take(len(found.due), now)
        held_back = len(found.due) - allowed
        if held_back:
            self.metrics.renew_deferred.inc(held_back)
        due = [e.original for e in found.due[:allowed]]
        batches = [due[i : i + BATCH] for i in range(0, len(due), BATCH)]
        gate = asyncio.Semaphore(MAX_BATCHES_IN_FLIGHT)

        async def one(batch: list[str]) -> None:
            async with gate:
                await self._renew_batch(batch)

        if batches:
            await asyncio.gather(*(one(b) for b in batches))
        self._gauge()
        return BACKLOG_SWEEP_S if held_back else self.period_s

    async def _renew_batch(self, originals: list[str]) -> None:
        entries = self.registry.begin_renew(originals)
        if not entries:
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        for e in entries:
            self._inflight[e.original] = fut
        try:
            try:
                answers = await self._renew(entries, self.invisible_ms)
                if len(answers) != len(entries):
                    raise ValueError("renew answered a different number of handles")
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.info("auto-renew of %d handles failed: %s", len(entries), exc)
                answers = [RenewAnswer(RenewStatus.ERROR)] * len(entries)
            for e, a in zip(entries, answers, strict=True):
                self._settle(e, a)
        finally:
            for e in entries:
                if self._inflight.get(e.original) is fut:
                    del self._inflight[e.original]
                self.registry.failed(e.original)  # no-op unless left renewing (cancelled)
            fut.set_result(None)

    def _settle(self, entry: Tracked, answer: RenewAnswer) -> None:
        if (
            answer.status is RenewStatus.CHANGED
            and answer.receipt_handle
            and answer.invisible_until_ms is not None
        ):
            if self.registry.renewed(
                entry.original, answer.receipt_handle, answer.invisible_until_ms
            ):
                self.metrics.renewals.inc()
        elif answer.status is RenewStatus.EXPIRED:
            self.metrics.renew_failures.labels("stale").inc()
            if self.registry.refused(entry.original) is not None:
                self.metrics.renew_stopped.labels(StopReason.STALE.value).inc()
        else:
            self.metrics.renew_failures.labels("error").inc()
            self.registry.failed(entry.original)
