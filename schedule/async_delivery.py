"""Async delivery of a level (``enable_schedule_async_deliver``).

Due messages go into the level's :class:`~chronomq.schedule.pending.PendingQueue` (bounded;
when full the loop backs off and rescans) and out in batches of up to ``batch_max_messages``
per command without waiting; batches of a level are chained (each expects the offset the
previous one sets), and the group committer keeps them in order. Completions come back on the
service's loop; the pending queue settles them in queue order, resends failures with back-off,
blocks the level after ``schedule_async_deliver_max_resend_num_to_blocked`` failures of one
message (logged once at ERROR, and once more when it no longer blocks), and skips a message
missing from the CommitLog after 6 tries (then one empty command moves the offset past it).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass

from chronomq.raftlog.errors import ConditionFailed, RaftLogError
from chronomq.raftlog.leadership import TermToken
from chronomq.raftlog.store import OK, BatchOutcome
from chronomq.schedule.delivery import (
    Delivery,
    LevelContext,
    LevelState,
    MissingMessage,
    TermOver,
    UnreadableMessage,
)
from chronomq.schedule.errors import CorruptScheduleMessage
from chronomq.schedule.pending import AddResult, BlockInfo, PendingQueue
from chronomq.schedule.planner import ScheduleEntry, StopReason
from chronomq.schedule.state import ASYNC, offset_key

# The schedule service's lines, as before its parts had modules of their own.
log = logging.getLogger("chronomq.schedule.service")


@dataclass(slots=True)
class _Batch:
    pending: PendingQueue
    deliveries: list[Delivery]
    store_ms: int


class AsyncDelivery:
    """Async sessions of one level at a time, and the completions of their commands."""

    def __init__(self, ctx: LevelContext) -> None:
        self.ctx = ctx

    async def session(self, st: LevelState, token: TermToken) -> None:
        """Deliver asynchronously until the mode changes, the service pauses, or the term
        ends."""
        pq = PendingQueue(st.level, self.ctx.offset(st.level), self.ctx.settings.pending)
        st.pending = pq
        st.inflight_batches = 0
        st.advance_inflight = False
        try:
            while self.ctx.mode == ASYNC and not self.ctx.paused and self.ctx.live(token):
                wait_s = self._step(st, pq)
                await self.ctx.sleep(st, wait_s)
            # Let what is in flight finish so the next mode starts from a settled offset.
            loop = asyncio.get_running_loop()
            deadline = loop.time() + self.ctx.settings.commit_wait_s
            while st.inflight_batches and loop.time() < deadline and self.ctx.live(token):
                await self.ctx.sleep(st, 0.05)
        finally:
            st.pending = None
            self.log_block(st, None)

    def _step(self, st: LevelState, pq: PendingQueue) -> float:
        now = self.ctx.raftlog.clock.now_ms()
        settled = pq.settle(now)
        for skipped in settled.skipped:
            log.warning("%s", skipped.reason)
        self.log_block(st, pq.blocking_entry())
        self._advance_over_skips(st, pq)
        waits: list[float] = []
        if settled.resends:
            self._resend(st, pq, [(r.entry, r.attempt) for r in settled.resends], now)
        if settled.next_resend_ms is not None:
            waits.append(max(0.0, (settled.next_resend_ms - now) / 1000))
        if pq.blocked or pq.failed_count:
            waits.append(self.ctx.settings.poll_ms / 1000)
            return min(waits)
        free = pq.config.max_pending_limit - len(pq)
        if free <= 0:
            # Flow control (seed 000): back off and rescan once completions make room.
            waits.append(self.ctx.settings.poll_ms / 1000)
            return min(waits)
        start = pq.next_offset
        plan = self.ctx.plan(st, start, min(free, self.ctx.settings.scan_max), now)
        run: list[Delivery] = []
        stopped_early = False
        for entry in plan.due:
            try:
                message, item = self.ctx.build(st, entry)
            except UnreadableMessage as exc:
                if pq.try_add(entry) is AddResult.ADDED:
                    pq.on_failure(entry.queue_offset, 1, now, str(exc))
                stopped_early = True
                break
            except MissingMessage:
                if pq.try_add(entry) is AddResult.ADDED:
                    pq.on_missing(entry.queue_offset, 1, now)
                stopped_early = True
                break
            except CorruptScheduleMessage as exc:
                log.warning("%s; skipped", exc)
                message, item = None, None
            added = pq.try_add(entry)
            if added is not AddResult.ADDED:
                stopped_early = True
                break
            run.append(Delivery(entry, 1, message, item))
        self._submit_runs(st, pq, run, now)
        if stopped_early:
            waits.append(self.ctx.settings.poll_ms / 1000)
        elif plan.stop is StopReason.END and len(plan.due) == min(free, self.ctx.settings.scan_max):
            waits.append(0.0)  # the read was cut by the limit, more may be due
        else:
            waits.append(self.ctx.wait_s(plan.next_due_ms, plan.stop))
        return min(waits)

    def log_block(self, st: LevelState, block: BlockInfo | None) -> None:
        """Log once when the level blocks (naming the entry and why) and once when it no
        longer does."""
        if block is not None and st.blocked_at != block.entry.queue_offset:
            st.blocked_at = block.entry.queue_offset
            log.error(
                "schedule level %d blocked at queue offset %d after %d failures: %s; nothing "
                "behind it is delivered until it goes through",
                st.level,
                block.entry.queue_offset,
                block.failures,
                block.last_error,
            )
        elif block is None and st.blocked_at is not None:
            log.warning(
                "schedule level %d no longer blocked at queue offset %d%s",
                st.level,
                st.blocked_at,
                "" if st.pending is not None else " (its delivery session ended)",
            )
            st.blocked_at = None

    def _resend(
        self,
        st: LevelState,
        pq: PendingQueue,
        resends: list[tuple[ScheduleEntry, int]],
        now: int,
    ) -> None:
        deliveries: list[Delivery] = []
        for i, (entry, attempt) in enumerate(resends):
            try:
                message, item = self.ctx.build(st, entry)
            except (MissingMessage, UnreadableMessage) as exc:
                if isinstance(exc, MissingMessage):
                    pq.on_missing(entry.queue_offset, attempt, now)
                else:
                    pq.on_failure(entry.queue_offset, attempt, now, str(exc))
                for later, later_attempt in resends[i + 1 :]:
                    pq.on_failure(
                        later.queue_offset, later_attempt, now, "an earlier message is missing"
                    )
                break
            except CorruptScheduleMessage as exc:
                log.warning("%s; skipped", exc)
                message, item = None, None
            deliveries.append(Delivery(entry, attempt, message, item))
        self._submit_runs(st, pq, deliveries, now)

    def _submit_runs(
        self, st: LevelState, pq: PendingQueue, deliveries: list[Delivery], now: int
    ) -> None:
        """Submit ``deliveries`` as commands of contiguous ranges, at most a batch each."""
        batch: list[Delivery] = []
        for d in deliveries:
            if batch and (
                d.entry.queue_offset != batch[-1].entry.queue_offset + 1
                or len(batch) >= self.ctx.settings.batch_max_messages
            ):
                self._submit(st, pq, batch, now)
                batch = []
            batch.append(d)
        if batch:
            self._submit(st, pq, batch, now)

    def _submit(
        self, st: LevelState, pq: PendingQueue, deliveries: list[Delivery], now: int
    ) -> None:
        store_ms = self.ctx.raftlog.clock.now_ms()
        try:
            fut = self.ctx.propose(st, deliveries, store_ms)
        except TermOver:
            return  # the session ends at its next check; nothing of it is proposed
        except RaftLogError as exc:
            self._failed(st, pq, deliveries, now, str(exc))
            return
        st.inflight_batches += 1
        batch = _Batch(pq, deliveries, store_ms)
        loop = asyncio.get_running_loop()
        fut.add_done_callback(
            lambda f: loop.call_soon_threadsafe(self._on_batch_done, st, batch, f)
        )

    def _on_batch_done(self, st: LevelState, batch: _Batch, fut: Future[BatchOutcome]) -> None:
        pq = batch.pending
        if st.pending is not pq:
            return  # its session (or term) is over; the next one starts from the offset
        st.inflight_batches = max(0, st.inflight_batches - 1)
        st.wake.set()
        now = self.ctx.raftlog.clock.now_ms()
        try:
            outcome = fut.result()
        except ConditionFailed as exc:  # how the committer reports a failed ``expect``
            self._refused(st, pq, batch, now, str(exc))
            return
        except Exception as exc:
            self._failed(st, pq, batch.deliveries, now, str(exc) or type(exc).__name__)
            return
        if outcome.status == OK:
            for d in batch.deliveries:
                pq.on_success(d.entry.queue_offset)
            if not outcome.duplicate:
                self.ctx.report(st, batch.deliveries, batch.store_ms)
            return
        self._refused(st, pq, batch, now, outcome.detail)

    def _refused(
        self, st: LevelState, pq: PendingQueue, batch: _Batch, now: int, reason: str
    ) -> None:
        """The offset was not where the batch's range started. Entries it has passed were
        delivered by an earlier send of theirs (a resend after a timeout, or a command that
        reached the next leader as this one stepped down): they count as delivered, so a level
        never blocks on an entry that went through. The others wait for what is ahead."""
        offset = self.ctx.offset(st.level)
        for d in batch.deliveries:
            if offset > d.entry.queue_offset:
                pq.on_success(d.entry.queue_offset)
            else:
                st.failures_total += 1
                st.last_error = reason
                pq.on_failure(d.entry.queue_offset, d.attempt, now, reason or "refused")

    def _failed(
        self,
        st: LevelState,
        pq: PendingQueue,
        deliveries: Sequence[Delivery],
        now: int,
        error: str,
    ) -> None:
        st.failures_total += len(deliveries)
        st.last_error = error
        for d in deliveries:
            pq.on_failure(d.entry.queue_offset, d.attempt, now, error)

    def _advance_over_skips(self, st: LevelState, pq: PendingQueue) -> None:
        """Move the replicated offset over skipped entries the pending queue has popped."""
        offset = self.ctx.offset(st.level)
        if offset >= pq.safe_offset or st.advance_inflight:
            return
        if st.token is None or not self.ctx.live(st.token):
            return
        key = offset_key(st.level)
        try:
            fut = self.ctx.raftlog.update({key: pq.safe_offset}, expect={key: offset})
        except RaftLogError as exc:
            st.last_error = str(exc)
            return
        st.advance_inflight = True
        st.skipped_total += pq.safe_offset - offset
        loop = asyncio.get_running_loop()

        def done(_f: Future[BatchOutcome]) -> None:
            loop.call_soon_threadsafe(self._advance_done, st, pq)

        fut.add_done_callback(done)

    def _advance_done(self, st: LevelState, pq: PendingQueue) -> None:
        if st.pending is not pq:
            return
        st.advance_inflight = False
        st.wake.set()
