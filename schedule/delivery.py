"""What both delivery modes of a level share: read its due entries, build the messages to
deliver, propose the command that delivers a range and moves the level's offset, wait for it,
and report what went through.

:class:`LevelContext` is bound to the log, the settings and the observer; the sync mode
(:mod:`chronomq.schedule.sync_delivery`) and the async mode
(:mod:`chronomq.schedule.async_delivery`) drive it for one :class:`LevelState` at a time, and
the level loop (:mod:`chronomq.schedule.level_loop`) runs them per level for the term it owns.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Final

from chronomq.raftlog import leaderloop, record
from chronomq.raftlog.errors import StoreCorruption
from chronomq.raftlog.leadership import TermToken
from chronomq.raftlog.node import NewMessage, RaftLog
from chronomq.raftlog.store import BatchOutcome
from chronomq.schedule import rewrite
from chronomq.schedule.errors import CorruptScheduleMessage
from chronomq.schedule.levels import SCHEDULE_TOPIC
from chronomq.schedule.pending import PendingQueue
from chronomq.schedule.planner import ScanPlan, ScheduleEntry, StopReason, plan_scan
from chronomq.schedule.settings import ScheduleSettings
from chronomq.schedule.state import delivery_mode, is_paused, level_offset, offset_key

# The schedule service's lines, as before its parts had modules of their own.
log = logging.getLogger("chronomq.schedule.service")

DeliveredItem = tuple[str, str, int, int]
"""(msg_id hex, real topic, store_ms of the waiting copy, due_ms)."""
OnDelivered = Callable[[int, list[DeliveredItem], int], None]
"""``on_delivered(level, items, delivered_ms)``, called on the ``leader-work`` thread after commit."""


class MissingMessage(Exception):
    """The message of a ConsumeQueue unit is no longer in the CommitLog (below its minimum
    offset: retention deleted its segment). Skipped after ``max_missing_tries``."""


class TermOver(Exception):
    """The level's term ended: nothing more is proposed; the loop leaves."""


class UnreadableMessage(Exception):
    """The message of a ConsumeQueue unit is in the CommitLog but neither this node nor a peer
    could read it (EIO, CRC mismatch). Never skipped: the level waits, the error shown."""


#: How far past ``now + level delay`` an entry's deliver time may lie before the planner
#: treats it as due now: no message of a level can be due later than its store time plus the
#: level's delay, so only a clock running ahead (bounded by this) or a record stamped by
#: something else (a due time in 2^62) gets there, and neither may hold the level for ever.
SKEW_ALLOWANCE_MS: Final = 60_000


@dataclass(slots=True)
class Delivery:
    """One entry of a level on its way: the message to write back to its real topic."""

    entry: ScheduleEntry
    attempt: int
    message: NewMessage | None
    """None for an entry whose message cannot be delivered (corrupt): the range still covers
    it, so the offset moves past it, with a log line."""
    item: DeliveredItem | None


@dataclass(slots=True)
class LevelState:
    """One level's figures and the state of its delivery on this node (the service's loop)."""

    level: int
    delay_ms: int
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    pending: PendingQueue | None = None
    inflight_batches: int = 0
    advance_inflight: bool = False
    delivered_total: int = 0
    skipped_total: int = 0
    failures_total: int = 0
    commands_total: int = 0
    last_error: str | None = None
    missing_sync: dict[int, int] = field(default_factory=dict)
    read_error: tuple[int, str] | None = None
    """(queue offset, error) of an entry no node could read: the level waits on it."""
    token: TermToken | None = None
    """The term the level's loop runs for (None while it does not run)."""
    blocked_at: int | None = None
    """Queue offset of the entry the level was last logged as blocked on."""
    sync_failing: int | None = None
    """Queue offset whose sync delivery has failed since it was last logged."""


class LevelContext:
    """The log, the settings and the observer, and what a level's delivery does with them."""

    def __init__(
        self,
        raftlog: RaftLog,
        settings: ScheduleSettings,
        *,
        on_delivered: OnDelivered | None = None,
        closing: Callable[[], bool] = lambda: False,
    ) -> None:
        self.raftlog = raftlog
        self.settings = settings
        self.levels = settings.levels
        self.on_delivered = on_delivered
        self._closing = closing

    def live(self, token: TermToken) -> bool:
        """``token``'s term is current and the service is not closing: work may go on."""
        return token.is_current() and not self._closing()

    # ------------------------------------------------------------------ replicated state

    def offset(self, level: int) -> int:
        return level_offset(self.raftlog.store.kv, level)

    @property
    def mode(self) -> str:
        return delivery_mode(self.raftlog.store.kv, self.settings.async_deliver)

    @property
    def paused(self) -> bool:
        return is_paused(self.raftlog.store.kv)

    # ------------------------------------------------------------------ waiting

    async def sleep(self, st: LevelState, seconds: float) -> None:
        """Wait ``seconds`` or until the level is woken (:func:`leaderloop.sleep`)."""
        await leaderloop.sleep(st.wake, seconds)

    def wait_s(self, next_due_ms: int | None, stop: StopReason) -> float:
        poll = self.settings.poll_ms / 1000
        if stop is StopReason.LIMIT:
            return 0.0
        if next_due_ms is None:
            return poll
        return min(poll, max(0.0, (next_due_ms - self.raftlog.clock.now_ms()) / 1000))

    # ------------------------------------------------------------------ reading

    def scan(self, st: LevelState, offset: int, limit: int) -> list[ScheduleEntry]:
        units = self.raftlog.store.read_units(
            SCHEDULE_TOPIC, self.levels.queue_id(st.level), offset, limit
        )
        return [
            ScheduleEntry(u.queue_offset, u.commitlog_offset, u.size, u.tags_code) for u in units
        ]

    def build(self, st: LevelState, entry: ScheduleEntry) -> tuple[NewMessage, DeliveredItem]:
        """The message to deliver for ``entry``.

        Raises :class:`MissingMessage` when the CommitLog cannot give it, and
        :class:`CorruptScheduleMessage` when it cannot be delivered at all.
        """
        store = self.raftlog.store
        if entry.commitlog_offset < store.commitlog.min_offset:
            raise MissingMessage(f"CommitLog starts at {store.commitlog.min_offset} now")
        try:
            msg = record.decode(store.read_record(entry.commitlog_offset, entry.size_bytes))
        except (StoreCorruption, OSError, ValueError) as exc:
            self.read_failed(st, entry, str(exc))
            raise UnreadableMessage(str(exc)) from None
        if st.read_error is not None and st.read_error[0] == entry.queue_offset:
            log.info(
                "schedule level %d queue offset %d is readable again", st.level, entry.queue_offset
            )
            st.read_error = None
        restored = rewrite.restore(self.levels.queue_id(st.level), msg.properties)
        queues = self.raftlog.store.queue_count(restored.topic)
        if queues is None or restored.queue_id >= queues:
            raise CorruptScheduleMessage(
                f"{SCHEDULE_TOPIC} queue {st.level - 1} offset {entry.queue_offset}: real "
                f"destination {restored.topic}/{restored.queue_id} does not exist"
            )
        message = NewMessage(
            restored.topic,
            msg.body,
            queue_id=restored.queue_id,
            properties=restored.properties,
            flag=msg.flag,
            sys_flag=msg.sys_flag,
            born_ms=msg.born_ms,
            reconsume_times=msg.reconsume_times,
            msg_id=msg.msg_id,
        )
        item = (record.msg_id_hex(msg.msg_id), restored.topic, msg.store_ms, entry.deliver_ms)
        return message, item

    def read_failed(self, st: LevelState, entry: ScheduleEntry, error: str) -> None:
        """Show (and log, once per entry) that the level waits on an unreadable message."""
        st.failures_total += 1
        st.last_error = f"queue offset {entry.queue_offset} unreadable: {error}"
        if st.read_error is None or st.read_error[0] != entry.queue_offset:
            log.error(
                "schedule level %d waits on queue offset %d: its message (CommitLog %d, %d "
                "bytes) cannot be read here or from a peer: %s",
                st.level,
                entry.queue_offset,
                entry.commitlog_offset,
                entry.size_bytes,
                error,
            )
        st.read_error = (entry.queue_offset, error)

    def plan(self, st: LevelState, offset: int, limit: int, now: int) -> ScanPlan:
        """:func:`plan_scan` of the level from ``offset``: an entry due later than the level's
        delay (plus :data:`SKEW_ALLOWANCE_MS`) from now is treated as due now."""
        return plan_scan(
            offset,
            self.scan(st, offset, limit),
            now,
            max_delay_ms=st.delay_ms + SKEW_ALLOWANCE_MS,
        )

    # ------------------------------------------------------------------ committing

    async def commit(self, fut: Future[BatchOutcome]) -> BatchOutcome:
        """Wait for a command the Raft thread completes, up to ``commit_wait_s``
        (:func:`leaderloop.commit`: a cancel is never swallowed, nor passed to the committer)."""
        return await leaderloop.commit(fut, self.settings.commit_wait_s)

    def propose(
        self, st: LevelState, deliveries: Sequence[Delivery], store_ms: int
    ) -> Future[BatchOutcome]:
        """One command delivering ``deliveries`` (contiguous) and moving the offset past them.

        Raises :class:`TermOver` once the level's term has ended: a loop never proposes for a
        term it no longer owns."""
        if st.token is None or not self.live(st.token):
            raise TermOver
        first = deliveries[0].entry.queue_offset
        end = deliveries[-1].entry.queue_offset + 1
        key = offset_key(st.level)
        messages = [d.message for d in deliveries if d.message is not None]
        st.commands_total += 1
        return self.raftlog.append(
            messages, expect={key: first}, updates={key: end}, store_ms=store_ms
        )

    def report(self, st: LevelState, deliveries: Sequence[Delivery], store_ms: int) -> None:
        items = [d.item for d in deliveries if d.item is not None]
        st.delivered_total += len(items)
        for d in deliveries:
            if d.message is None:
                st.skipped_total += 1
        if items and self.on_delivered is not None:
            try:
                self.on_delivered(st.level, items, store_ms)
            except Exception:
                log.exception("on_delivered callback failed")
