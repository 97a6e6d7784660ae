"""Sync delivery of a level (seed 000, ``deliverMessage`` before 4.9.3): one message per
command, each waiting for its commit before the next.

A failed delivery is retried every back-off step and logged once per queue offset; a range an
earlier send already delivered (its offset has moved past it) counts as delivered, once. A
message missing from the CommitLog is skipped after ``max_missing_tries``; one that cannot be
read here or from a peer holds the level, never skipped.
"""

from __future__ import annotations

import logging

from chronomq.raftlog.errors import ConditionFailed, RaftLogError
from chronomq.raftlog.leadership import TermToken
from chronomq.raftlog.store import OK
from chronomq.schedule.delivery import (
    Delivery,
    LevelContext,
    LevelState,
    MissingMessage,
    TermOver,
    UnreadableMessage,
)
from chronomq.schedule.errors import CorruptScheduleMessage
from chronomq.schedule.planner import ScheduleEntry
from chronomq.schedule.state import SYNC

# The schedule service's lines, as before its parts had modules of their own.
log = logging.getLogger("chronomq.schedule.service")


class SyncDelivery:
    """Sync passes over one level at a time."""

    def __init__(self, ctx: LevelContext) -> None:
        self.ctx = ctx

    async def run_pass(self, st: LevelState, token: TermToken) -> float:
        """Deliver what is due now, one committed message at a time; return how long to wait."""
        offset = self.ctx.offset(st.level)
        now = self.ctx.raftlog.clock.now_ms()
        plan = self.ctx.plan(st, offset, self.ctx.settings.scan_max, now)
        for entry in plan.due:
            if self.ctx.mode != SYNC or self.ctx.paused or not self.ctx.live(token):
                return 0.0
            delivery = self._delivery(st, entry)
            if delivery is None:
                if st.read_error is not None:
                    return 1.0  # every try asks the peers: not more than once a second
                return min(1.0, self.ctx.settings.pending.resend_backoff_step_ms / 1000)
            store_ms = self.ctx.raftlog.clock.now_ms()
            try:
                outcome = await self.ctx.commit(self.ctx.propose(st, [delivery], store_ms))
            except (RaftLogError, TimeoutError) as exc:
                if not self.ctx.live(token):
                    raise TermOver from None  # the term ended under the command: leave
                if (
                    isinstance(exc, ConditionFailed)
                    and self.ctx.offset(st.level) > entry.queue_offset
                ):
                    # An earlier send of this entry went through (a retry after a timeout, or
                    # a command forwarded to the next leader as this one stepped down): it is
                    # delivered, once. Go on from the offset.
                    log.debug("schedule level %d: %s; already delivered", st.level, exc)
                    return 0.0
                # A commit that fails as the leadership moves fails before the loss reaches
                # the owner: wait the back-off, and leave without a word if the term ended.
                await self.ctx.sleep(st, self.ctx.settings.pending.resend_backoff_step_ms / 1000)
                if not self.ctx.live(token):
                    raise TermOver from None
                self._failed(st, entry, str(exc) or type(exc).__name__)
                return 0.0
            if outcome.status == OK and not outcome.duplicate:
                self.ctx.report(st, [delivery], store_ms)
            if st.sync_failing is not None and outcome.status == OK:
                log.info(
                    "schedule level %d queue offset %d delivered after failures",
                    st.level,
                    entry.queue_offset,
                )
                st.sync_failing = None
            if not self.ctx.live(token):
                raise TermOver
            if outcome.status != OK:
                # Another delivery of this range went through (or the offset was corrected):
                # start again from the replicated offset.
                return 0.0
        if len(plan.due) == self.ctx.settings.scan_max:
            return 0.0  # the read was cut by the limit, more may be due
        return self.ctx.wait_s(plan.next_due_ms, plan.stop)

    def _failed(self, st: LevelState, entry: ScheduleEntry, error: str) -> None:
        """Count a failed sync delivery; log it once per queue offset (the level retries it
        every back-off step, and a line per retry would flood the log)."""
        st.failures_total += 1
        st.last_error = error
        if st.sync_failing != entry.queue_offset:
            st.sync_failing = entry.queue_offset
            log.warning(
                "schedule level %d: delivery of queue offset %d failed (retrying every %d ms): %s",
                st.level,
                entry.queue_offset,
                self.ctx.settings.pending.resend_backoff_step_ms,
                error,
            )

    def _delivery(self, st: LevelState, entry: ScheduleEntry) -> Delivery | None:
        try:
            message, item = self.ctx.build(st, entry)
        except UnreadableMessage:
            return None  # the level waits; LevelContext.read_failed showed why
        except MissingMessage as exc:
            tries = st.missing_sync.get(entry.queue_offset, 0) + 1
            st.missing_sync = {entry.queue_offset: tries}
            if tries < self.ctx.settings.pending.max_missing_tries:
                st.failures_total += 1
                st.last_error = f"message missing from the CommitLog: {exc}"
                return None
            log.warning(
                "schedule level %d queue offset %d: message missing from the CommitLog after "
                "%d tries; skipped",
                st.level,
                entry.queue_offset,
                tries,
            )
            return Delivery(entry, 1, None, None)
        except CorruptScheduleMessage as exc:
            log.warning("%s; skipped", exc)
            return Delivery(entry, 1, None, None)
        st.missing_sync.clear()
        return Delivery(entry, 1, message, item)
