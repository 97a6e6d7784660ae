"""The timer's apply extension: what every replica does when a timer command is applied.

The leader proposes timer commands (:mod:`chronomq.timer.service`); each is a JSON payload applied by
:meth:`TimerMachine.apply` on every replica, in log order, as a
:class:`chronomq.raftlog.extension.ApplyExtension`. A payload may hold, applied in this order:

``switch``  ``{"stop_enqueue": bool, "stop_dequeue": bool}``: cluster-wide runtime switches.
``enq``     a timer-topic ConsumeQueue offset: put every timer message below it (at most
            :data:`MAX_ENQUEUE_PER_COMMAND` per command) into the TimerLog and wheel with
            :func:`chronomq.timer.enqueue.enqueue`, its store time as "now" and the committed cursor;
            one already due (its slot read) is delivered by this same apply.
``cancel``  ``[[msg_id_hex, deliver_ms], ...]``: :func:`chronomq.timer.cancel.decide_cancel` answers
            each; a cancel that must be kept is stored as a timer-topic record and put into
            the wheel at once (its slot's cancel chain), so no later delivery can miss it.
``span``    nine integers, a :class:`chronomq.timer.dequeue.DequeueSpan` the leader planned:
            :meth:`chronomq.timer.dequeue.DequeuePlanner.replay` walks it again over this replica's
            TimerLog; unless stale, the DELIVER items are written to their real topics, the
            cursor becomes the span's end, and then the REPUT items go back into the timer
            topic (roll count + 1), to be enqueued by a later command.
``reclaim`` a TimerLog position the leader found no unread slot's chain, and no cancel that a
            message still waiting in the timer topic may need, reaches below
            (:mod:`chronomq.timer.reclaim`): it becomes the replicated reclaim position
            (``timer/rc``) when it is past the current one and within the TimerLog. From then
            on every replica reads chains only down to it, and deletes the whole segments
            before it at its next checkpoint (:meth:`chronomq.timer.files.TimerFiles.persist`).

Every apply that appends TimerLog records also appends, last, their bytes to the system topic
``rmq_sys_timer_log`` (:mod:`chronomq.timer.logtopic`), stamped with the command's propose time: the
TimerLog can then be rebuilt from the node's own CommitLog (:meth:`TimerMachine.attach`).

Everything apply decides comes from the log: the records' store times, the command's propose
time (the store time of what it writes), the committed state in kv (:mod:`chronomq.timer.state`). So
every replica writes the same records and ends with the same TimerLog and wheel, and a
delivery is the cursor moving, once, in a committed command: a new leader neither skips nor
repeats, and a stale span (another leader moved the cursor) changes nothing.

Apply is bounded: at most :data:`MAX_ENQUEUE_PER_COMMAND` messages enqueued, the span's records
(the planner's batch limit) and the cancels of one command.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from chronomq.raftlog import record
from chronomq.raftlog.errors import NodeFault
from chronomq.raftlog.extension import ApplyContext, DerivedRecord
from chronomq.raftlog.store import Store
from chronomq.timer import logtopic
from chronomq.timer import message as tm
from chronomq.timer.cancel import CancelStatus, decide_cancel
from chronomq.timer.chains import tombstone_keys
from chronomq.timer.config import TimerConfig
from chronomq.timer.cursor import ReadCursor
from chronomq.timer.dequeue import DequeuePlanner, DequeueSpan, ItemAction
from chronomq.timer.enqueue import EnqueueAction, TimerMessage, enqueue
from chronomq.timer.errors import InvalidTimerConfig, TimerCorruptionError, TimerStateError
from chronomq.timer.files import AlignReport, Fetch, TimerFiles
from chronomq.timer.flow import RateMeter
from chronomq.timer.state import GEOMETRY, TimerState
from chronomq.timer.timerlog import NO_POS, topic_hash, uniq_key_hash

log = logging.getLogger(__name__)

NAME = "timer"
#: Most timer messages one command puts into the wheel: bounds the time apply holds the Raft
#: thread. A larger backlog (enqueue was stopped, a burst) drains over several commands.
MAX_ENQUEUE_PER_COMMAND = 2048
#: Most cancels one command carries.
MAX_CANCELS_PER_COMMAND = 256
#: Most delivery notices (messages) waiting for the observer (see
#: :attr:`TimerMachine.observed`); beyond it the oldest are dropped and counted.
OBSERVED_ITEMS = 65_536

DeliveredItem = tuple[str, str, int, int]
"""(msg_id hex, real topic, store_ms of the waiting timer message, due_ms)."""


@dataclass(frozen=True, slots=True)
class _Read:
    """A timer-topic record read back in apply: its bytes and what the timer needs of it."""

    data: bytes
    msg_id: bytes
    store_ms: int
    props: dict[str, str]
    fields: tm.TimerFields | None


@dataclass(slots=True)
class CancelAnswer:
    msg_id: str
    status: str
    reason: str


@dataclass(slots=True)
class TimerOutcome:
    """What one timer command did here (``ApplyResult.ext``)."""

    enqueued: int = 0
    due_now: int = 0
    delivered: int = 0
    suppressed: int = 0
    rolled: int = 0
    stale: bool = False
    invalid: str | None = None
    cursor: ReadCursor | None = None
    cancels: list[CancelAnswer] = field(default_factory=list)


class TimerMachine:
    """The :class:`~chronomq.raftlog.extension.ApplyExtension` of the timer (see the module docstring).

    ``lock`` guards the files and the mirrored state: apply and attach take it on the Raft
    thread, the leader's planner takes it to read the wheel and TimerLog.
    """

    def __init__(
        self,
        root: Path | str,
        config: TimerConfig,
        *,
        fetch: Fetch | None = None,
        is_leader: Callable[[], bool] = lambda: False,
    ) -> None:
        self.config = config
        self.geometry = config.geometry
        self.lock = threading.RLock()
        self.files = TimerFiles(root, config)
        self._replayer = DequeuePlanner(
            self.geometry,
            max_records=config.timer_dequeue_batch_max,
            max_slots=config.timer_dequeue_scan_slots_max,
        )
        self.fetch = fetch
        self.is_leader = is_leader
        self.state = TimerState()
        self.store: Store | None = None
        self.enqueue_meter = RateMeter()
        self.dequeue_meter = RateMeter()
        #: Deliveries applied while this node leads, for the observer: (items, delivered_ms).
        #: Bounded by :data:`OBSERVED_ITEMS`; the oldest are dropped (and counted) when the
        #: observer falls behind.
        self.observed: collections.deque[tuple[list[DeliveredItem], int]] = collections.deque()
        self.observed_items = 0
        self.observed_dropped = 0
        self.on_applied: Callable[[TimerOutcome], None] | None = None

    @property
    def name(self) -> str:
        return NAME

    # ------------------------------------------------------------------ extension hooks

    def _geometry(self) -> str:
        c = self.config
        return (
            f"{c.timer_precision_ms},{c.timer_wheel_slots},{c.timer_roll_window_slots},"
            f"{c.timer_log_segment_bytes}"
        )

    def _check_geometry(self, recorded: object) -> None:
        """Every replica must slot, roll and lay out the TimerLog alike, or their deliveries
        diverge: refuse to run with settings other than the cluster's, naming the key."""
        if recorded is None or recorded == self._geometry():
            return
        theirs = str(recorded).split(",")
        ours = self._geometry().split(",")
        names = (
            "timer_precision_ms",
            "timer_roll_window_slots",  # the wheel's size follows from it
            "timer_roll_window_slots",
            "timer_log_segment_bytes",
        )
        key = next((n for n, a, b in zip(names, theirs, ours, strict=False) if a != b), names[0])
        raise InvalidTimerConfig(
            f"this node's timer settings ({self._geometry()}) differ from the cluster's "
            f"({recorded}: precision_ms, wheel_slots, roll_window_slots, segment_bytes); "
            f"{key} must be the same on every node",
            field=key,
        )

    def attach(self, store: Store) -> None:
        with self.lock:
            self._check_geometry(store.kv.get(GEOMETRY))
            self.store = store
            self.state = TimerState.from_kv(store.kv)
            report = self.files.align(
                self.state.log_end,
                self.fetch,
                lambda timer_log, end: logtopic.rebuild_from_store(store, timer_log, end),
                self.state.reclaim_pos,
            )
            log.info(
                "timer attached at index %d: cursor %s, enqueue offset %d, TimerLog end %d (%s)",
                store.applied_index,
                self.state.cursor,
                self.state.enqueue_offset,
                self.state.log_end,
                report,
            )

    def before_snapshot(self, index: int) -> None:
        with self.lock:
            st = self.state
            self.files.persist(
                applied_index=index,
                enqueue_offset=st.enqueue_offset,
                cursor=st.cursor or ReadCursor.at(0),
                last_delivered_ms=st.last_delivered_ms,
                reclaim_pos=st.reclaim_pos,
            )

    def apply(self, ctx: ApplyContext, payload: Any) -> TimerOutcome:
        try:
            return self._apply(ctx, payload)
        except (InvalidTimerConfig, TimerCorruptionError) as exc:
            # This node's settings or TimerLog/wheel files, not the command: stop this node.
            raise NodeFault(f"timer apply at index {ctx.index}: {exc}") from exc

    def _apply(self, ctx: ApplyContext, payload: Any) -> TimerOutcome:
        out = TimerOutcome()
        if not isinstance(payload, dict):
            out.invalid = "payload is not an object"
            log.error("timer command at index %d ignored: %s", ctx.index, out.invalid)
            return out
        with self.lock:
            geometry = ctx.kv_get(GEOMETRY)
            if geometry is None:
                ctx.kv_set(GEOMETRY, self._geometry())
            else:
                self._check_geometry(geometry)  # raises: this node must not apply on
            before = self.state
            st = before.copy()
            if st.cursor is None:
                st.cursor = ReadCursor.at(self.geometry.slot_ms(ctx.propose_ms))
            self._switch(st, payload.get("switch"))
            self.files.log.start_capture()
            try:
                enq = payload.get("enq")
                if isinstance(enq, int) and not isinstance(enq, bool) and not st.stop_enqueue:
                    self._enqueue(ctx, st, enq, out)
                cancels = payload.get("cancel")
                if isinstance(cancels, list):
                    for seq, item in enumerate(cancels[:MAX_CANCELS_PER_COMMAND]):
                        out.cancels.append(self._cancel(ctx, st, item, seq))
                span = payload.get("span")
                if span is not None:
                    self._dequeue(ctx, st, span, out)
                reclaim = payload.get("reclaim")
                if (
                    isinstance(reclaim, int)
                    and not isinstance(reclaim, bool)
                    and st.reclaim_pos < reclaim <= self.files.log.end_pos
                ):
                    st.reclaim_pos = reclaim
            finally:
                appended = self.files.log.stop_capture()
            if appended:
                ctx.ensure_topic(logtopic.TOPIC, 1)
                records = logtopic.derived_records(appended, store_ms=ctx.propose_ms)
                ctx.append(records, internal=True)  # wakes no consumer
            self.files.sync_wheel_pos()
            st.log_end = self.files.log.end_pos
            for key, value in st.kv_changes(before).items():
                ctx.kv_set(key, value)
            self.state = st
            out.cursor = st.cursor
            self.enqueue_meter.add(ctx.propose_ms, out.enqueued + out.due_now)
            self.dequeue_meter.add(ctx.propose_ms, out.delivered + out.due_now)
        if self.on_applied is not None:
            self.on_applied(out)
        return out

    # ------------------------------------------------------------------ parts of apply

    @staticmethod
    def _switch(st: TimerState, sw: Any) -> None:
        if not isinstance(sw, dict):
            return
        for key, attr in (("stop_enqueue", "stop_enqueue"), ("stop_dequeue", "stop_dequeue")):
            value = sw.get(key)
            if isinstance(value, bool):
                setattr(st, attr, value)

    def _read(self, ctx: ApplyContext, offset: int, size: int) -> _Read:
        # A local read error is not a reason to skip: the peers' copy, or stop this node.
        data = ctx.store.read_record(offset, size)
        msg_id, store_ms, props = record.head(data)
        return _Read(data, msg_id, store_ms, props, tm.timer_fields(msg_id, props))

    def _deliver(
        self,
        ctx: ApplyContext,
        got: _Read,
        due_ms: int,
        records: list[DerivedRecord],
        observed: list[DeliveredItem],
    ) -> None:
        props = got.props
        topic = props[tm.REAL_TOPIC]
        queues = ctx.ensure_topic(topic, int(props[tm.REAL_QID]) + 1)
        records.append(
            tm.delivered_record(got.data, props, queue_count=queues, store_ms=ctx.propose_ms)
        )
        observed.append((record.msg_id_hex(got.msg_id), topic, got.store_ms, due_ms))

    def _enqueue(self, ctx: ApplyContext, st: TimerState, upto: int, out: TimerOutcome) -> None:
        store = ctx.store
        assert st.cursor is not None
        end = min(
            upto,
            store.max_offset(tm.TIMER_TOPIC, tm.TIMER_QUEUE),
            st.enqueue_offset + MAX_ENQUEUE_PER_COMMAND,
        )
        pos = st.enqueue_offset
        log_, wheel = self.files.log, self.files.wheel
        due: list[DerivedRecord] = []
        observed: list[DeliveredItem] = []
        while pos < end:
            units = store.read_units(tm.TIMER_TOPIC, tm.TIMER_QUEUE, pos, min(1024, end - pos))
            if not units:
                break
            for unit in units:
                got = self._read(ctx, unit.commitlog_offset, unit.size)
                fields = got.fields
                if fields is None:
                    self._dropped(ctx, got)
                    st.count("skipped")
                    continue
                if fields.pre_enqueued:
                    continue
                key_hash = uniq_key_hash(fields.key)
                result = enqueue(
                    TimerMessage(
                        cl_offset=unit.commitlog_offset,
                        cl_size=unit.size,
                        deliver_ms=fields.deliver_ms,
                        store_ms=got.store_ms,
                        key_hash=key_hash,
                        topic_hash=topic_hash(fields.real_topic) if fields.real_topic else 0,
                        roll_count=fields.roll_times,
                        tombstone=fields.tombstone,
                    ),
                    cursor_slot_ms=st.cursor.slot_ms,
                    log=log_,
                    wheel=wheel,
                )
                if result.plan.action is not EnqueueAction.DUE_NOW:
                    if not fields.tombstone:
                        st.add_backlog(fields.real_topic, 1)
                        st.count("enqueued")
                        out.enqueued += 1
                    continue
                if fields.tombstone:
                    continue  # its target's slot is read: nothing left to cancel
                if self._cancelled(fields.deliver_ms, key_hash, st.reclaim_pos):
                    st.count("cancelled")
                    out.suppressed += 1
                    continue
                self._deliver(ctx, got, fields.deliver_ms, due, observed)
            pos += len(units)
        st.enqueue_offset = pos
        if due:
            ctx.append(due)
            st.count("due_now", len(due))
            st.count("delivered", len(due))
            out.due_now += len(due)
            st.last_delivered_ms = ctx.propose_ms
            self._observe(observed, ctx.propose_ms)

    @staticmethod
    def _dropped(ctx: ApplyContext, got: _Read) -> None:
        props = got.props
        problem = tm.destination_problem(props) if tm.TIMER_DEL_UNIQKEY not in props else None
        log.warning(
            "timer message %s at index %d dropped: %s",
            record.msg_id_hex(got.msg_id),
            ctx.index,
            problem[0] if problem else "its timer properties are unusable",
        )

    def _cancelled(self, deliver_ms: int, key_hash: int, floor: int) -> bool:
        """Whether the slot of a message found already due holds a cancel of it (the cancel
        was stored while the message still waited in the timer topic); its cancel chain is
        read down to ``floor``, the replicated reclaim position."""
        slot = self.files.wheel.get(deliver_ms)
        if slot.tomb_last_pos == NO_POS:
            return False
        return key_hash in tombstone_keys(self.files.log, slot, floor)

    def _cancel(self, ctx: ApplyContext, st: TimerState, item: Any, seq: int) -> CancelAnswer:
        assert st.cursor is not None
        if (
            not isinstance(item, list)
            or len(item) != 2
            or not isinstance(item[0], str)
            or len(item[0]) != 32
            or not isinstance(item[1], int)
            or item[1] < 0
        ):
            return CancelAnswer(str(item)[:40], CancelStatus.UNKNOWN.value, "malformed cancel")
        target, deliver_ms = item[0].upper(), item[1]
        key_hash = uniq_key_hash(target)
        wheel, log_ = self.files.wheel, self.files.log
        slot = wheel.get(deliver_ms)
        if slot.tomb_count >= self.config.timer_max_tombstones_each_slot:
            return CancelAnswer(target, CancelStatus.UNKNOWN.value, "too many cancels in its slot")
        decision = decide_cancel(
            target_deliver_ms=deliver_ms,
            key_hash=key_hash,
            committed=st.cursor,
            wheel=wheel,
            log=log_,
            geometry=self.geometry,
            floor=st.reclaim_pos,
        )
        if decision.write_tombstone:
            derived = tm.cancel_record(
                target, deliver_ms=deliver_ms, store_ms=ctx.propose_ms, index=ctx.index, seq=seq
            )
            placed = ctx.append([derived])[0]
            enqueue(
                TimerMessage(
                    cl_offset=placed.physical_offset,
                    cl_size=placed.size,
                    deliver_ms=deliver_ms,
                    store_ms=ctx.propose_ms,
                    key_hash=key_hash,
                    tombstone=True,
                ),
                cursor_slot_ms=st.cursor.slot_ms,
                log=log_,
                wheel=wheel,
            )
            st.count("tombstones")
        return CancelAnswer(target, decision.status.value, decision.reason)

    def _valid_span(self, st: TimerState, span: DequeueSpan) -> str | None:
        assert st.cursor is not None
        g = self.geometry
        if span.from_cursor != st.cursor:
            return None  # stale, not invalid
        gap = span.to_cursor.slot_ms - span.from_cursor.slot_ms
        if gap < 0 or gap > g.window_ms or span.to_cursor.slot_ms % g.precision_ms:
            return f"span from {span.from_cursor} to {span.to_cursor} is not a forward walk"
        if span.end_pos > self.files.log.end_pos:
            return f"span planned at TimerLog end {span.end_pos}, beyond this log"
        return None

    def _dequeue(self, ctx: ApplyContext, st: TimerState, raw: Any, out: TimerOutcome) -> None:
        assert st.cursor is not None
        try:
            span = DequeueSpan.from_tuple(list(raw))
        except (TimerStateError, TypeError, ValueError) as exc:
            out.invalid = f"bad span: {exc}"
            log.error("timer command at index %d: %s", ctx.index, out.invalid)
            return
        problem = self._valid_span(st, span)
        if problem is not None:
            out.invalid = problem
            log.error("timer command at index %d ignored: %s", ctx.index, problem)
            return
        result = self._replayer.replay(span, st.cursor, self.files.wheel, self.files.log)
        if result.stale:
            out.stale = True
            st.count("stale_spans")
            return
        deliveries: list[DerivedRecord] = []
        reputs: list[DerivedRecord] = []
        observed: list[DeliveredItem] = []
        for item in result.items:
            rec = item.record
            got = self._read(ctx, rec.cl_offset, rec.cl_size)
            fields = got.fields
            if item.action is ItemAction.DELIVER:
                if fields is None or fields.tombstone:
                    st.count("skipped")
                    continue
                st.add_backlog(fields.real_topic, -1)
                self._deliver(ctx, got, rec.deliver_ms, deliveries, observed)
            elif item.action is ItemAction.SUPPRESS:
                if fields is not None and not fields.tombstone:
                    st.add_backlog(fields.real_topic, -1)
                st.count("cancelled")
                out.suppressed += 1
            else:  # REPUT
                if fields is not None and not fields.tombstone:
                    st.add_backlog(fields.real_topic, -1)
                reputs.append(
                    tm.reput_record(
                        record.decode(got.data), deliver_ms=rec.deliver_ms, store_ms=ctx.propose_ms
                    )
                )
        if deliveries:
            ctx.append(deliveries)
            st.count("delivered", len(deliveries))
            st.last_delivered_ms = ctx.propose_ms
            out.delivered += len(deliveries)
            self._observe(observed, ctx.propose_ms)
        st.cursor = result.cursor
        if reputs:
            ctx.append(reputs)
            st.count("rolled", len(reputs))
            out.rolled += len(reputs)

    def _observe(self, items: list[DeliveredItem], delivered_ms: int) -> None:
        if not items or not self.is_leader():
            return
        self.observed.append((items, delivered_ms))
        self.observed_items += len(items)
        while self.observed_items > OBSERVED_ITEMS:
            dropped, _ = self.observed.popleft()
            self.observed_items -= len(dropped)
            self.observed_dropped += len(dropped)

    def take_observed(self) -> tuple[list[DeliveredItem], int] | None:
        """The oldest delivery notice for the observer (any thread), or ``None``."""
        with self.lock:
            if not self.observed:
                return None
            items, delivered_ms = self.observed.popleft()
            self.observed_items -= len(items)
            return items, delivered_ms

    # ------------------------------------------------------------------ reads for others

    def committed(self) -> TimerState:
        """The state as of the last applied timer command (a copy; safe from any thread)."""
        with self.lock:
            return self.state.copy()

    def timerlog_stats(self) -> dict[str, int]:
        """The TimerLog on this node's disk, and how much of it was reclaimed (any thread)."""
        with self.lock:
            tlog = self.files.log
            return {
                "bytes": tlog.size_bytes,
                "segments": tlog.segment_count,
                "segment_bytes": tlog.segment_bytes,
                "start_pos": tlog.start_pos,
                "end_pos": tlog.end_pos,
                "reclaim_pos": self.state.reclaim_pos,
                "segments_deleted": self.files.reclaimed_segments,
            }

    def align_report(self) -> AlignReport | None:
        return self.files.last_align

    def close(self) -> None:
        with self.lock:
            self.files.close()
