"""The schedule service: one delivery loop per delay level, on the leader only.

The cores beside this module decide (:mod:`chronomq.schedule.planner`,
:mod:`chronomq.schedule.pending`, :mod:`chronomq.schedule.rewrite`); the delivery modules drive
them against the replicated log, one level at a time: :mod:`chronomq.schedule.delivery` (what
both modes share), :mod:`chronomq.schedule.sync_delivery`, :mod:`chronomq.schedule.async_delivery`.
This module runs a loop per level for the term it leads in, switching between the modes. It
runs on a thread of its own with its own asyncio loop, so delivery never competes with the HTTP
loop for a turn, and it talks to Raft only through :meth:`chronomq.raftlog.node.RaftLog.append`.
The replicated offsets and controls are named in :mod:`chronomq.schedule.state`.

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
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Final

from chronomq.raftlog.leadership import Leadership, Piece, TermToken
from chronomq.raftlog.node import RaftLog
from chronomq.raftlog.store import OK, BatchOutcome
from chronomq.schedule.async_delivery import AsyncDelivery
from chronomq.schedule.delivery import LevelContext, LevelState, OnDelivered, TermOver
from chronomq.schedule.levels import SCHEDULE_TOPIC, format_delay
from chronomq.schedule.pending import BlockInfo, PendingStats
from chronomq.schedule.planner import correct_offset
from chronomq.schedule.settings import ScheduleSettings
from chronomq.schedule.state import ASYNC, MODE_KEY, MODES, PAUSED_KEY, offset_key
from chronomq.schedule.sync_delivery import SyncDelivery

log = logging.getLogger(__name__)

OnEvent = Callable[..., None]
"""``on_event(type, **detail)`` for service start and stop."""


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
        self._states = {lv: LevelState(lv, self.levels.delay_ms(lv)) for lv in self.levels.levels()}
        self._ctx = LevelContext(
            raftlog, settings, on_delivered=on_delivered, closing=lambda: self._closing
        )
        self._sync = SyncDelivery(self._ctx)
        self._async = AsyncDelivery(self._ctx)
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
        return self._ctx.live(token)

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
        return self._ctx.offset(level)

    @property
    def mode(self) -> str:
        return self._ctx.mode

    @property
    def paused(self) -> bool:
        return self._ctx.paused

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
            outcome = await self._ctx.commit(self.raftlog.update(updates, expect=expect))
            if outcome.status != OK:
                raise RuntimeError(f"offset update refused: {outcome.detail}")

    async def _run_level(self, st: LevelState, token: TermToken) -> None:
        with token.loop(self.name, f"schedule level {st.level}"):
            st.token = token
            try:
                await self._level_loop(st, token)
            finally:
                st.token = None

    async def _level_loop(self, st: LevelState, token: TermToken) -> None:
        while self._live(token):
            if self.paused:
                await self._ctx.sleep(st, self.settings.poll_ms / 1000)
                continue
            try:
                if self.mode == ASYNC:
                    await self._async.session(st, token)
                else:
                    wait_s = await self._sync.run_pass(st, token)
                    await self._ctx.sleep(st, wait_s)
            except asyncio.CancelledError:
                raise
            except TermOver:
                return
            except Exception as exc:  # never let one level's bug stop the others
                if not self._live(token):
                    return
                st.last_error = str(exc)
                log.exception("schedule level %d failed; retrying in 1 s", st.level)
                await self._ctx.sleep(st, 1.0)

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

    def _pending_view(self, st: LevelState) -> tuple[PendingStats | None, BlockInfo | None]:
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
