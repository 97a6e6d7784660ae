"""The schedule service: one delivery loop per delay level, on the leader only.

The cores beside this module decide (:mod:`chronomq.schedule.planner`, :mod:`chronomq.schedule.pending`,
:mod:`chronomq.schedule.rewrite`); this module drives them against the replicated log. It runs on a
thread of its own with its own asyncio loop, so delivery never competes with the HTTP loop for
a turn, and it talks to Raft only through :meth:`chronomq.raftlog.node.RaftLog.append`.

**Progress and effect in one command.** Each level's offset is the replicated kv entry
``sched/off/{level}``. A delivery command covers a contiguous range ``[a, b)`` of the level's
queue: it carries the due messages of that range (restored to their real topic, keeping their
msg_id), ``expect={offset: a}`` and ``updates={offset: b}``. Apply accepts it only if the offset
still is ``a``, so a range is delivered exactly once however often it is sent, by however many
leaders: a resend of a range that already went through fails its condition and is known to be
delivered because the offset has passed it. A new leader resumes at the offset, with no replay
window (RocketMQ persists offsets every 10 s and re-delivers after failover).

**Sync mode** (seed 000, ``deliverMessage`` before 4.9.3): one message per command, each waits
for its commit before the next.

**Async mode** (``enable_schedule_async_deliver``): due messages go into the level's
:class:`~chronomq.schedule.pending.PendingQueue` (bounded; when full the loop backs off and rescans) and
out in batches of up to ``batch_max_messages`` per command without waiting; batches of a level
are chained (each expects the offset the previous one sets), and the group committer keeps
them in order. Completions come back on this loop; the pending queue settles them in queue
order, resends failures with back-off ``min(n x 100 ms, 60 s)``, blocks the level after
``schedule_async_deliver_max_resend_num_to_blocked`` failures of one message, and skips a
message missing from the CommitLog (below its minimum offset: retention deleted it) after 6
tries (then one empty command moves the offset past it). A message the CommitLog still holds but
this node cannot read (EIO, CRC mismatch) is read from a peer
(:meth:`chronomq.raftlog.store.Store.read_record`); if no peer can give it either, it is never skipped:
the level waits on it, resending with back-off, and ``GET /v1/admin/schedule`` shows the level
``blocked`` with the ``read_error`` (logged once per message). An entry whose deliver time lies
more than the level's delay plus :data:`SKEW_ALLOWANCE_MS` ahead (a stamp no produce makes) is
treated as due now rather than holding its level for ever. While any message waits for a resend, nothing new is added: everything behind it would
only fail its condition.

**Leadership.** The service is one piece of leader-only work owned by
:class:`chronomq.raftlog.leadership.Leadership`, which :class:`chronomq.raftlog.node.RaftLog` feeds with confirmed
terms (a barrier committed in the term, so every earlier command, and every offset, is applied
here). For each term the owner hands the service a :class:`~chronomq.raftlog.leadership.TermToken`; the
service starts one loop per level for it, and the next term's loops start only after every
loop of the last one has returned. A loop checks its token after every await (a commit, a
sleep) and before every proposal: once the term is over it leaves, whatever the await
answered, instead of retrying. Loss of leadership also cancels the loops to cut their waits
short, but cancellation is not what stops them: ``asyncio.wait_for`` in Python 3.11 swallows a
cancel that arrives as the awaited commit completes (the committer fails every pending command
at the same instant), which used to leave a loop running without an owner and racing the next
term's loop on the same offset. Commits and sleeps are therefore awaited under
``asyncio.timeout``. Mode switches and pauses happen inside each level's loop and never start
another. The owner counts the running loops (``loops`` in ``GET /v1/admin/schedule``). A stale
leader's commands cannot commit, and if one did, its condition would fail.

**A blocked level** (async mode, a message that failed ``max_resend_num_to_blocked`` times) is
logged once at ERROR with its queue offset, failures and last error, and once more when it is
no longer blocked; ``GET /v1/admin/schedule`` shows it as ``blocked`` / ``blocked_by``. A sync
delivery that fails is logged once per queue offset, not once per retry.

**Cluster-wide controls** are replicated kv entries too, so a new leader keeps them: the
delivery mode (``sched/mode``, defaulting to the config key) and a pause switch
(``sched/paused``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Final

from chronomq.raftlog import record
from chronomq.raftlog.errors import ConditionFailed, RaftLogError, StoreCorruption
from chronomq.raftlog.leadership import Leadership, Piece, TermToken
from chronomq.raftlog.node import NewMessage, RaftLog
from chronomq.raftlog.store import OK, BatchOutcome
from chronomq.schedule import rewrite
from chronomq.schedule.errors import CorruptScheduleMessage
from chronomq.schedule.levels import SCHEDULE_TOPIC, DelayLevelTable, format_delay
from chronomq.schedule.pending import (
    AddResult,
    BlockInfo,
    PendingConfig,
    PendingQueue,
    PendingStats,
)
from chronomq.schedule.planner import ScanPlan, ScheduleEntry, StopReason, correct_offset, plan_scan

log = logging.getLogger(__name__)

OFFSET_PREFIX: Final = "sched/off/"
MODE_KEY: Final = "sched/mode"
PAUSED_KEY: Final = "sched/paused"
SYNC: Final = "sync"
ASYNC: Final = "async"
MODES: Final = (SYNC, ASYNC)

DeliveredItem = tuple[str, str, int, int]
"""(msg_id hex, real topic, store_ms of the waiting copy, due_ms)."""
OnDelivered = Callable[[int, list[DeliveredItem], int], None]
"""``on_delivered(level, items, delivered_ms)``, called on the service thread after commit."""
OnEvent = Callable[..., None]
"""``on_event(type, **detail)`` for service start and stop."""


def offset_key(level: int) -> str:
    """The replicated kv key holding ``level``'s offset in the schedule topic."""
    return f"{OFFSET_PREFIX}{level}"


@dataclass(frozen=True, slots=True)
class ScheduleSettings:
    levels: DelayLevelTable
    async_deliver: bool = False
    """The mode while no one has switched it at runtime (``sched/mode`` unset)."""
    pending: PendingConfig = field(default_factory=PendingConfig)
    batch_max_messages: int = 128
    """Deliveries per Raft command in async mode."""
    scan_max: int = 512
    """ConsumeQueue units read per scan."""
    poll_ms: int = 50
    """How often an idle level looks for new entries and a changed mode. New entries are due a
    whole level delay (>= 1 s) after they are stored, so this never makes a delivery late."""
    commit_wait_s: float = 15.0
    """Upper bound on waiting for one command (the committer times out well before)."""


class _Missing(Exception):
    """The message of a ConsumeQueue unit is no longer in the CommitLog (below its minimum
    offset: retention deleted its segment). Skipped after ``max_missing_tries``."""


class _TermOver(Exception):
    """The level's term ended: nothing more is proposed; the loop leaves."""


class _Unreadable(Exception):
    """The message of a ConsumeQueue unit is in the CommitLog but neither this node nor a peer
    could read it (EIO, CRC mismatch). Never skipped: the level waits, the error shown."""


#: How far past ``now + level delay`` an entry's deliver time may lie before the planner
#: treats it as due now: no message of a level can be due later than its store time plus the
#: level's delay, so only a clock running ahead (bounded by this) or a record stamped by
#: something else (a due time in 2^62) gets there, and neither may hold the level for ever.
SKEW_ALLOWANCE_MS: Final = 60_000


@dataclass(slots=True)
class _Delivery:
    entry: ScheduleEntry
    attempt: int
    message: NewMessage | None
    """None for an entry whose message cannot be delivered (corrupt): the range still covers
    it, so the offset moves past it, with a log line."""
    item: DeliveredItem | None


@dataclass(slots=True)
class _Batch:
    pending: PendingQueue
    deliveries: list[_Delivery]
    store_ms: int


@dataclass(slots=True)
class _LevelState:
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


class ScheduleService:
    """Per-level delivery loops; runs them only for the term the leadership owner hands it.

    It is one piece of :class:`chronomq.raftlog.leadership.Work` (named ``schedule``): ``start(token)``
    starts one loop per level for ``token.term`` on the service's own asyncio loop; the loops
    leave as soon as the token is stale, and ``token.exited`` follows once all have returned.
    """

    name: Final = "schedule"

    def __init__(
        self,
        raftlog: RaftLog,
        settings: ScheduleSettings,
        *,
        on_delivered: OnDelivered | None = None,
        on_event: OnEvent | None = None,
        leadership: Leadership | None = None,
    ) -> None:
        self.raftlog = raftlog
        self.settings = settings
        self.levels = settings.levels
        self.on_delivered = on_delivered
        self.on_event = on_event
        self._own_leadership = leadership is None
        self.leadership = leadership or Leadership(now_ms=raftlog.clock.monotonic_ms)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._closing = False
        self._runner: asyncio.Task[None] | None = None
        self._token: TermToken | None = None
        self._states = {
            lv: _LevelState(lv, self.levels.delay_ms(lv)) for lv in self.levels.levels()
        }
        self.running = False
        """True while the delivery loops run (this node leads)."""

    # ------------------------------------------------------------------ life cycle

    def start(self) -> None:
        """Start the service's thread and loop, and register with the leadership owner."""
        self._thread = threading.Thread(target=self._main, name="schedule", daemon=True)
        self._thread.start()
        self._ready.wait(5)
        self.attach()

    def attach(self) -> None:
        """Register with the leadership owner (and, if the owner is this service's own, feed it
        from the log's leadership)."""
        self.leadership.register(Piece(self.name, self._begin_term, self._wake_term))
        if self._own_leadership:
            self.raftlog.add_leader_listener(self.leadership.on_leader)
            term = self.raftlog.leader_term
            if term is not None:  # confirmed before we listened
                self.leadership.on_leader(True, term)

    def close(self) -> None:
        self._closing = True
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(stop.set)
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _main(self) -> None:
        asyncio.run(self.serve())

    async def serve(self) -> None:
        """The service's loop: runs until :meth:`close` (the thread of :meth:`start` runs it;
        tests run it on their own loop and call :meth:`attach`)."""
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        for st in self._states.values():
            st.wake = asyncio.Event()
        self._ready.set()
        try:
            await self._stop.wait()
        finally:
            self._closing = True
            self._wake_all()
            runner = self._runner
            if runner is not None:
                runner.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await runner

    def _wake_term(self) -> None:
        """The term ended (leadership thread): every loop looks at its token now."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(self._end_term)

    def _begin_term(self, token: TermToken) -> None:
        """Run the level loops for ``token.term`` (leadership thread; returns at once)."""
        loop = self._loop
        if loop is None or loop.is_closed() or self._closing:
            token.exited(self.name)
            return
        try:
            loop.call_soon_threadsafe(self._spawn, token)
        except RuntimeError:  # closed meanwhile
            token.exited(self.name)

    def _spawn(self, token: TermToken) -> None:
        if self._closing or not token.is_current() or self._runner is not None:
            # The owner starts a term only once the last one exited, so a runner still here is
            # a bug: refuse rather than run two sets of loops.
            if self._runner is not None:
                log.error(
                    "schedule term %d not started: term %s still runs",
                    token.term,
                    None if self._token is None else self._token.term,
                )
            token.exited(self.name)
            return
        self._token = token
        runner = asyncio.get_running_loop().create_task(self._lead(token))
        self._runner = runner
        # A done callback, not a ``finally``: a task cancelled before its first step never
        # enters its body, and the owner must still hear that the term's work exited.
        runner.add_done_callback(lambda _t: self._lead_done(token))

    def _lead_done(self, token: TermToken) -> None:
        was_running = self.running
        self._runner = None
        self._token = None
        if was_running:
            self._stopped(
                "service closed" if self._closing else f"leadership lost in term {token.term}"
            )
        token.exited(self.name)

    def _end_term(self) -> None:
        self._wake_all()
        runner, token = self._runner, self._token
        if runner is not None and token is not None and not token.is_current():
            # Only cuts waits short: every loop also checks its token after each await.
            runner.cancel()

    def _live(self, token: TermToken) -> bool:
        return token.is_current() and not self._closing

    def _stopped(self, why: str) -> None:
        self.running = False
        for st in self._states.values():
            st.pending = None
            st.inflight_batches = 0
            st.advance_inflight = False
            st.blocked_at = None
        log.info("schedule service stopped: %s", why)
        if self.on_event is not None:
            self.on_event("service_stop", service="schedule", reason=why)

    # ------------------------------------------------------------------ replicated state

    def offset(self, level: int) -> int:
        value = self.raftlog.store.kv.get(offset_key(level), 0)
        return value if isinstance(value, int) else 0

    @property
    def mode(self) -> str:
        value = self.raftlog.store.kv.get(MODE_KEY)
        if value in MODES:
            return str(value)
        return ASYNC if self.settings.async_deliver else SYNC

    @property
    def paused(self) -> bool:
        return self.raftlog.store.kv.get(PAUSED_KEY) == 1

    def set_controls(
        self, *, mode: str | None = None, paused: bool | None = None
    ) -> Future[BatchOutcome]:
        """Switch the delivery mode or pause delivery, cluster-wide (through Raft)."""
        updates: dict[str, int | str | None] = {}
        if mode is not None:
            if mode not in MODES:
                raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
            updates[MODE_KEY] = mode
        if paused is not None:
            updates[PAUSED_KEY] = 1 if paused else 0
        fut = self.raftlog.update(updates)
        loop = self._loop
        if loop is not None:
            fut.add_done_callback(lambda _f: loop.call_soon_threadsafe(self._wake_all))
        return fut

    def _wake_all(self) -> None:
        for st in self._states.values():
            st.wake.set()

    # ------------------------------------------------------------------ leading

    async def _lead(self, token: TermToken) -> None:
        term = token.term
        while self._live(token):
            try:
                await self._prepare_offsets(token)
                break
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if not self._live(token):
                    return
                log.warning(
                    "schedule service could not check its offsets in term %d: %s; retrying in 1 s",
                    term,
                    exc,
                )
                await asyncio.sleep(1.0)
        if not self._live(token):
            return
        self.running = True
        log.info(
            "schedule service running in term %d: %d levels, mode %s",
            term,
            self.levels.max_level,
            self.mode,
        )
        if self.on_event is not None:
            self.on_event("service_start", service="schedule", term=term, mode=self.mode)
        # return_exceptions: the term's work has exited only once every level loop has.
        results = await asyncio.gather(
            *(self._run_level(st, token) for st in self._states.values()), return_exceptions=True
        )
        for st, result in zip(self._states.values(), results, strict=True):
            if isinstance(result, BaseException) and not isinstance(result, asyncio.CancelledError):
                log.error("schedule level %d loop ended in term %d: %r", st.level, term, result)

    async def _prepare_offsets(self, token: TermToken) -> None:
        """Create missing level offsets; move any outside its queue's range back inside it.

        There is no retention yet, so a queue's minimum is 0; the maximum is the queue's length.
        """
        kv = self.raftlog.store.kv
        expect: dict[str, int | str | None] = {}
        updates: dict[str, int | str | None] = {}
        for lv in self.levels.levels():
            key = offset_key(lv)
            have = kv.get(key)
            high = self.raftlog.store.max_offset(SCHEDULE_TOPIC, self.levels.queue_id(lv))
            if not isinstance(have, int):
                expect[key], updates[key] = have, 0
                continue
            fix = correct_offset(lv, have, 0, high)
            if fix.corrected:
                log.warning("%s", fix.describe())
                expect[key], updates[key] = have, fix.offset
        if updates and self._live(token):
            outcome = await self._commit(self.raftlog.update(updates, expect=expect))
            if outcome.status != OK:
                raise RuntimeError(f"offset update refused: {outcome.detail}")

    async def _run_level(self, st: _LevelState, token: TermToken) -> None:
        with token.loop(self.name, f"schedule level {st.level}"):
            st.token = token
            try:
                await self._level_loop(st, token)
            finally:
                st.token = None

    async def _level_loop(self, st: _LevelState, token: TermToken) -> None:
        while self._live(token):
            if self.paused:
                await self._sleep(st, self.settings.poll_ms / 1000)
                continue
            try:
                if self.mode == ASYNC:
                    await self._async_session(st, token)
                else:
                    wait_s = await self._sync_pass(st, token)
                    await self._sleep(st, wait_s)
            except asyncio.CancelledError:
                raise
            except _TermOver:
                return
            except Exception as exc:  # never let one level's bug stop the others
                if not self._live(token):
                    return
                st.last_error = str(exc)
                log.exception("schedule level %d failed; retrying in 1 s", st.level)
                await self._sleep(st, 1.0)

    async def _sleep(self, st: _LevelState, seconds: float) -> None:
        """Wait ``seconds`` or until the level is woken. ``asyncio.timeout`` (not
        ``wait_for``): a cancel arriving with the timeout is never swallowed."""
        if seconds > 0 and not st.wake.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(seconds):
                    await st.wake.wait()
        st.wake.clear()

    def _wait_s(self, next_due_ms: int | None, stop: StopReason) -> float:
        poll = self.settings.poll_ms / 1000
        if stop is StopReason.LIMIT:
            return 0.0
        if next_due_ms is None:
            return poll
        return min(poll, max(0.0, (next_due_ms - self.raftlog.clock.now_ms()) / 1000))

    # ------------------------------------------------------------------ reading

    def _scan(self, st: _LevelState, offset: int, limit: int) -> list[ScheduleEntry]:
        units = self.raftlog.store.read_units(
            SCHEDULE_TOPIC, self.levels.queue_id(st.level), offset, limit
        )
        return [
            ScheduleEntry(u.queue_offset, u.commitlog_offset, u.size, u.tags_code) for u in units
        ]

    def _build(self, st: _LevelState, entry: ScheduleEntry) -> tuple[NewMessage, DeliveredItem]:
        """The message to deliver for ``entry``.

        Raises :class:`_Missing` when the CommitLog cannot give it, and
        :class:`CorruptScheduleMessage` when it cannot be delivered at all.
        """
        store = self.raftlog.store
        if entry.commitlog_offset < store.commitlog.min_offset:
            raise _Missing(f"CommitLog starts at {store.commitlog.min_offset} now")
        try:
            msg = record.decode(store.read_record(entry.commitlog_offset, entry.size_bytes))
        except (StoreCorruption, OSError, ValueError) as exc:
            self._read_failed(st, entry, str(exc))
            raise _Unreadable(str(exc)) from None
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

    def _read_failed(self, st: _LevelState, entry: ScheduleEntry, error: str) -> None:
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

    def _plan(self, st: _LevelState, offset: int, limit: int, now: int) -> ScanPlan:
        """:func:`plan_scan` of the level from ``offset``: an entry due later than the level's
        delay (plus :data:`SKEW_ALLOWANCE_MS`) from now is treated as due now."""
        return plan_scan(
            offset,
            self._scan(st, offset, limit),
            now,
            max_delay_ms=st.delay_ms + SKEW_ALLOWANCE_MS,
        )

    # ------------------------------------------------------------------ committing

    async def _commit(self, fut: Future[BatchOutcome]) -> BatchOutcome:
        """Wait for a command the Raft thread completes. Not ``asyncio.wait_for``: in 3.11 it
        returns the result of a future that completes as the waiter is cancelled, swallowing
        the cancel; the shield keeps a cancel from cancelling the committer's future."""
        async with asyncio.timeout(self.settings.commit_wait_s):
            return await asyncio.shield(asyncio.wrap_future(fut))

    def _propose(
        self, st: _LevelState, deliveries: Sequence[_Delivery], store_ms: int
    ) -> Future[BatchOutcome]:
        """One command delivering ``deliveries`` (contiguous) and moving the offset past them.

        Raises :class:`_TermOver` once the level's term has ended: a loop never proposes for a
        term it no longer owns."""
        if st.token is None or not self._live(st.token):
            raise _TermOver
        first = deliveries[0].entry.queue_offset
        end = deliveries[-1].entry.queue_offset + 1
        key = offset_key(st.level)
        messages = [d.message for d in deliveries if d.message is not None]
        st.commands_total += 1
        return self.raftlog.append(
            messages, expect={key: first}, updates={key: end}, store_ms=store_ms
        )

    def _report(self, st: _LevelState, deliveries: Sequence[_Delivery], store_ms: int) -> None:
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

    # ------------------------------------------------------------------ sync mode

    async def _sync_pass(self, st: _LevelState, token: TermToken) -> float:
        """Deliver what is due now, one committed message at a time; return how long to wait."""
        offset = self.offset(st.level)
        now = self.raftlog.clock.now_ms()
        plan = self._plan(st, offset, self.settings.scan_max, now)
        for entry in plan.due:
            if self.mode != SYNC or self.paused or not self._live(token):
                return 0.0
            delivery = self._sync_delivery(st, entry)
            if delivery is None:
                if st.read_error is not None:
                    return 1.0  # every try asks the peers: not more than once a second
                return min(1.0, self.settings.pending.resend_backoff_step_ms / 1000)
            store_ms = self.raftlog.clock.now_ms()
            try:
                outcome = await self._commit(self._propose(st, [delivery], store_ms))
            except (RaftLogError, TimeoutError) as exc:
                if not self._live(token):
                    raise _TermOver from None  # the term ended under the command: leave
                if isinstance(exc, ConditionFailed) and self.offset(st.level) > entry.queue_offset:
                    # An earlier send of this entry went through (a retry after a timeout, or
                    # a command forwarded to the next leader as this one stepped down): it is
                    # delivered, once. Go on from the offset.
                    log.debug("schedule level %d: %s; already delivered", st.level, exc)
                    return 0.0
                # A commit that fails as the leadership moves fails before the loss reaches
                # the owner: wait the back-off, and leave without a word if the term ended.
                await self._sleep(st, self.settings.pending.resend_backoff_step_ms / 1000)
                if not self._live(token):
                    raise _TermOver from None
                self._sync_failed(st, entry, str(exc) or type(exc).__name__)
                return 0.0
            if outcome.status == OK and not outcome.duplicate:
                self._report(st, [delivery], store_ms)
            if st.sync_failing is not None and outcome.status == OK:
                log.info(
                    "schedule level %d queue offset %d delivered after failures",
                    st.level,
                    entry.queue_offset,
                )
                st.sync_failing = None
            if not self._live(token):
                raise _TermOver
            if outcome.status != OK:
                # Another delivery of this range went through (or the offset was corrected):
                # start again from the replicated offset.
                return 0.0
        if len(plan.due) == self.settings.scan_max:
            return 0.0  # the read was cut by the limit, more may be due
        return self._wait_s(plan.next_due_ms, plan.stop)

    def _sync_failed(self, st: _LevelState, entry: ScheduleEntry, error: str) -> None:
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
                self.settings.pending.resend_backoff_step_ms,
                error,
            )

    def _sync_delivery(self, st: _LevelState, entry: ScheduleEntry) -> _Delivery | None:
        try:
            message, item = self._build(st, entry)
        except _Unreadable:
            return None  # the level waits; _read_failed showed why
        except _Missing as exc:
            tries = st.missing_sync.get(entry.queue_offset, 0) + 1
            st.missing_sync = {entry.queue_offset: tries}
            if tries < self.settings.pending.max_missing_tries:
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
            return _Delivery(entry, 1, None, None)
        except CorruptScheduleMessage as exc:
            log.warning("%s; skipped", exc)
            return _Delivery(entry, 1, None, None)
        st.missing_sync.clear()
        return _Delivery(entry, 1, message, item)

    # ------------------------------------------------------------------ async mode

    async def _async_session(self, st: _LevelState, token: TermToken) -> None:
        """Deliver asynchronously until the mode changes, the service pauses, or the term
        ends."""
        pq = PendingQueue(st.level, self.offset(st.level), self.settings.pending)
        st.pending = pq
        st.inflight_batches = 0
        st.advance_inflight = False
        try:
            while self.mode == ASYNC and not self.paused and self._live(token):
                wait_s = self._async_step(st, pq)
                await self._sleep(st, wait_s)
            # Let what is in flight finish so the next mode starts from a settled offset.
            loop = asyncio.get_running_loop()
            deadline = loop.time() + self.settings.commit_wait_s
            while st.inflight_batches and loop.time() < deadline and self._live(token):
                await self._sleep(st, 0.05)
        finally:
            st.pending = None
            self._log_block(st, None)

    def _async_step(self, st: _LevelState, pq: PendingQueue) -> float:
        now = self.raftlog.clock.now_ms()
        settled = pq.settle(now)
        for skipped in settled.skipped:
            log.warning("%s", skipped.reason)
        self._log_block(st, pq.blocking_entry())
        self._advance_over_skips(st, pq)
        waits: list[float] = []
        if settled.resends:
            self._resend(st, pq, [(r.entry, r.attempt) for r in settled.resends], now)
        if settled.next_resend_ms is not None:
            waits.append(max(0.0, (settled.next_resend_ms - now) / 1000))
        if pq.blocked or pq.failed_count:
            waits.append(self.settings.poll_ms / 1000)
            return min(waits)
        free = pq.config.max_pending_limit - len(pq)
        if free <= 0:
            # Flow control (seed 000): back off and rescan once completions make room.
            waits.append(self.settings.poll_ms / 1000)
            return min(waits)
        start = pq.next_offset
        plan = self._plan(st, start, min(free, self.settings.scan_max), now)
        run: list[_Delivery] = []
        stopped_early = False
        for entry in plan.due:
            try:
                message, item = self._build(st, entry)
            except _Unreadable as exc:
                if pq.try_add(entry) is AddResult.ADDED:
                    pq.on_failure(entry.queue_offset, 1, now, str(exc))
                stopped_early = True
                break
            except _Missing:
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
            run.append(_Delivery(entry, 1, message, item))
        self._submit_runs(st, pq, run, now)
        if stopped_early:
            waits.append(self.settings.poll_ms / 1000)
        elif plan.stop is StopReason.END and len(plan.due) == min(free, self.settings.scan_max):
            waits.append(0.0)  # the read was cut by the limit, more may be due
        else:
            waits.append(self._wait_s(plan.next_due_ms, plan.stop))
        return min(waits)

    def _log_block(self, st: _LevelState, block: BlockInfo | None) -> None:
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
        st: _LevelState,
        pq: PendingQueue,
        resends: list[tuple[ScheduleEntry, int]],
        now: int,
    ) -> None:
        deliveries: list[_Delivery] = []
        for i, (entry, attempt) in enumerate(resends):
            try:
                message, item = self._build(st, entry)
            except (_Missing, _Unreadable) as exc:
                if isinstance(exc, _Missing):
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
            deliveries.append(_Delivery(entry, attempt, message, item))
        self._submit_runs(st, pq, deliveries, now)

    def _submit_runs(
        self, st: _LevelState, pq: PendingQueue, deliveries: list[_Delivery], now: int
    ) -> None:
        """Submit ``deliveries`` as commands of contiguous ranges, at most a batch each."""
        batch: list[_Delivery] = []
        for d in deliveries:
            if batch and (
                d.entry.queue_offset != batch[-1].entry.queue_offset + 1
                or len(batch) >= self.settings.batch_max_messages
            ):
                self._submit(st, pq, batch, now)
                batch = []
            batch.append(d)
        if batch:
            self._submit(st, pq, batch, now)

    def _submit(
        self, st: _LevelState, pq: PendingQueue, deliveries: list[_Delivery], now: int
    ) -> None:
        store_ms = self.raftlog.clock.now_ms()
        try:
            fut = self._propose(st, deliveries, store_ms)
        except _TermOver:
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

    def _on_batch_done(self, st: _LevelState, batch: _Batch, fut: Future[BatchOutcome]) -> None:
        pq = batch.pending
        if st.pending is not pq:
            return  # its session (or term) is over; the next one starts from the offset
        st.inflight_batches = max(0, st.inflight_batches - 1)
        st.wake.set()
        now = self.raftlog.clock.now_ms()
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
                self._report(st, batch.deliveries, batch.store_ms)
            return
        self._refused(st, pq, batch, now, outcome.detail)

    def _refused(
        self, st: _LevelState, pq: PendingQueue, batch: _Batch, now: int, reason: str
    ) -> None:
        """The offset was not where the batch's range started. Entries it has passed were
        delivered by an earlier send of theirs (a resend after a timeout, or a command that
        reached the next leader as this one stepped down): they count as delivered, so a level
        never blocks on an entry that went through. The others wait for what is ahead."""
        offset = self.offset(st.level)
        for d in batch.deliveries:
            if offset > d.entry.queue_offset:
                pq.on_success(d.entry.queue_offset)
            else:
                st.failures_total += 1
                st.last_error = reason
                pq.on_failure(d.entry.queue_offset, d.attempt, now, reason or "refused")

    def _failed(
        self,
        st: _LevelState,
        pq: PendingQueue,
        deliveries: Sequence[_Delivery],
        now: int,
        error: str,
    ) -> None:
        st.failures_total += len(deliveries)
        st.last_error = error
        for d in deliveries:
            pq.on_failure(d.entry.queue_offset, d.attempt, now, error)

    def _advance_over_skips(self, st: _LevelState, pq: PendingQueue) -> None:
        """Move the replicated offset over skipped entries the pending queue has popped."""
        offset = self.offset(st.level)
        if offset >= pq.safe_offset or st.advance_inflight:
            return
        if st.token is None or not self._live(st.token):
            return
        key = offset_key(st.level)
        try:
            fut = self.raftlog.update({key: pq.safe_offset}, expect={key: offset})
        except RaftLogError as exc:
            st.last_error = str(exc)
            return
        st.advance_inflight = True
        st.skipped_total += pq.safe_offset - offset
        loop = asyncio.get_running_loop()

        def done(_f: Future[BatchOutcome]) -> None:
            loop.call_soon_threadsafe(self._advance_done, st, pq)

        fut.add_done_callback(done)

    def _advance_done(self, st: _LevelState, pq: PendingQueue) -> None:
        if st.pending is not pq:
            return
        st.advance_inflight = False
        st.wake.set()

    # ------------------------------------------------------------------ status

    def stats(self) -> dict[str, Any]:
        """Per level: delay, offset, max offset, backlog, oldest-due lag, pending, blocked."""
        store = self.raftlog.store
        now = self.raftlog.clock.now_ms()
        levels = []
        for lv, st in self._states.items():
            qid = self.levels.queue_id(lv)
            offset = self.offset(lv)
            high = store.max_offset(SCHEDULE_TOPIC, qid)
            lag = 0
            if offset < high:
                head = store.read_units(SCHEDULE_TOPIC, qid, offset, 1)
                if head and head[0].tags_code <= now:
                    lag = now - head[0].tags_code
            pstats, blocking = self._pending_view(st)
            levels.append(
                {
                    "level": lv,
                    "delay": format_delay(st.delay_ms),
                    "delay_ms": st.delay_ms,
                    "offset": offset,
                    "max_offset": high,
                    "backlog": max(0, high - offset),
                    "oldest_due_lag_ms": lag,
                    "pending": pstats.pending if pstats else 0,
                    "inflight_commands": st.inflight_batches if self.running else 0,
                    "blocked": bool(pstats and pstats.blocked) or st.read_error is not None,
                    "read_error": None
                    if st.read_error is None
                    else {"queue_offset": st.read_error[0], "error": st.read_error[1]},
                    "blocked_by": None
                    if blocking is None
                    else {
                        "queue_offset": blocking.entry.queue_offset,
                        "failures": blocking.failures,
                        "last_error": blocking.last_error,
                    },
                    "delivered": st.delivered_total,
                    "skipped": st.skipped_total,
                    "failures": st.failures_total,
                    "resends": pstats.resends_total if pstats else 0,
                    "last_error": st.last_error,
                }
            )
        return {
            "running": self.running,
            "mode": self.mode,
            "paused": self.paused,
            "term": self._token.term if self.running and self._token is not None else None,
            "loops": self.loops_view(),
            "levels": levels,
        }

    def loops_view(self) -> dict[str, Any]:
        """The node's running leader-only loops (schedule levels and timer driver), the term
        they run for, and loops started/stopped since the node started."""
        view = self.leadership.stats()
        out = view.as_dict()
        out["schedule_levels"] = view.by_work.get(self.name, 0)
        out["timer_driver"] = view.by_work.get("timer", 0)
        return out

    def _pending_view(self, st: _LevelState) -> tuple[PendingStats | None, BlockInfo | None]:
        """The level's pending queue as seen from another thread (it may change under us)."""
        pq = st.pending
        if pq is None or not self.running:
            return None, None
        for _ in range(5):
            try:
                return pq.stats(), pq.blocking_entry()
            except RuntimeError:  # mutated while we iterated
                continue
        return None, None
