"""The schedule service: one delivery loop per delay level, on the leader only.

The cores beside this module decide (:mod:`chronomq.schedule.planner`,
:mod:`chronomq.schedule.pending`, :mod:`chronomq.schedule.rewrite`); the delivery modules drive
them against the replicated log, one level at a time: :mod:`chronomq.schedule.delivery` (what
both modes share), :mod:`chronomq.schedule.sync_delivery`, :mod:`chronomq.schedule.async_delivery`.
:mod:`chronomq.schedule.level_loop` runs a loop per level for the term the node leads in,
switching between the modes, on the node's leader runtime
(:class:`chronomq.raftlog.leaderloop.LeaderRuntime`: the ``leader-work`` thread and its asyncio
loop), so delivery never competes with the HTTP loop for a turn; it talks to Raft only through
:meth:`chronomq.raftlog.node.RaftLog.append`. This module is the service around it: its
registration, the cluster-wide controls and the figures.
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

**Leadership.** The level loops are leader-only work owned by
:class:`chronomq.raftlog.leadership.Leadership`, which :class:`chronomq.raftlog.node.RaftLog` feeds with confirmed
terms (a barrier committed in the term, so every earlier command, and every offset, is applied
here). For each term the owner hands the leader runtime a :class:`~chronomq.raftlog.leadership.TermToken`;
the runtime runs the schedule's loop for it, which starts one loop per level, and the next
term's loops start only after every loop of the last one has returned. A loop checks its token after every await (a commit, a
sleep) and before every proposal: once the term is over it leaves, whatever the await
answered, instead of retrying. Loss of leadership also cancels the loops to cut their waits
short, but cancellation is not what stops them: ``asyncio.wait_for`` in Python 3.11 swallows a
cancel that arrives as the awaited commit completes (the committer fails every pending command
at the same instant), which used to leave a loop running without an owner and racing the next
term's loop on the same offset. Commits and sleeps are therefore awaited under
``asyncio.timeout`` (:func:`chronomq.raftlog.leaderloop.commit`, :func:`~chronomq.raftlog.leaderloop.sleep`).
Mode switches and pauses happen inside each level's loop and never start another. The owner counts the running loops (``loops`` in ``GET /v1/admin/schedule``). A stale
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

from concurrent.futures import Future
from typing import Any, Final

from chronomq.raftlog.leaderloop import LeaderRuntime
from chronomq.raftlog.leadership import Leadership
from chronomq.raftlog.node import RaftLog
from chronomq.raftlog.store import BatchOutcome
from chronomq.schedule.delivery import LevelContext, LevelState, OnDelivered
from chronomq.schedule.level_loop import WORK, LevelLoops, OnEvent
from chronomq.schedule.levels import SCHEDULE_TOPIC, format_delay
from chronomq.schedule.pending import BlockInfo, PendingStats
from chronomq.schedule.settings import ScheduleSettings
from chronomq.schedule.state import MODE_KEY, MODES, PAUSED_KEY

__all__ = ["OnEvent", "ScheduleService"]


class ScheduleService:
    """Per-level delivery loops on the leader, their controls and their figures.

    Its loops (:class:`chronomq.schedule.level_loop.LevelLoops`, leader-only work named
    ``schedule``) run on the node's :class:`~chronomq.raftlog.leaderloop.LeaderRuntime`, one term
    at a time; without a runtime given the service makes its own (with its own
    :class:`~chronomq.raftlog.leadership.Leadership`, fed by the log).
    """

    name: Final = WORK

    def __init__(
        self,
        raftlog: RaftLog,
        settings: ScheduleSettings,
        *,
        on_delivered: OnDelivered | None = None,
        on_event: OnEvent | None = None,
        runtime: LeaderRuntime | None = None,
    ) -> None:
        self.raftlog = raftlog
        self.settings = settings
        self.levels = settings.levels
        self.on_delivered = on_delivered
        self.on_event = on_event
        self._own_runtime = runtime is None
        self.runtime = runtime or LeaderRuntime(Leadership(now_ms=raftlog.clock.monotonic_ms))
        self.leadership = self.runtime.leadership
        self._closing = False
        self._states = {lv: LevelState(lv, self.levels.delay_ms(lv)) for lv in self.levels.levels()}
        self._ctx = LevelContext(
            raftlog, settings, on_delivered=on_delivered, closing=self._is_closing
        )
        self._loops = LevelLoops(
            self._ctx, self._states, on_event=on_event, closing=self._is_closing
        )

    @property
    def running(self) -> bool:
        """True while the delivery loops run (this node leads)."""
        return self._loops.running

    def _is_closing(self) -> bool:
        return self._closing or self.runtime.closing

    # ------------------------------------------------------------------ life cycle

    def start(self) -> None:
        """Add the level loops to the leader runtime (starting the service's own runtime, fed
        from the log's leadership, if it has one)."""
        self.attach()
        if self._own_runtime:
            self.runtime.start()
            self.raftlog.add_leader_listener(self.leadership.on_leader)
            term = self.raftlog.leader_term
            if term is not None:  # confirmed before we listened
                self.leadership.on_leader(True, term)

    def attach(self) -> None:
        """Add the level loops to the leader runtime."""
        self.runtime.add(self._loops.spec())

    def close(self) -> None:
        self._closing = True
        self.runtime.call_soon(self._loops.wake_all)
        if self._own_runtime:
            self.runtime.close()

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
        fut.add_done_callback(lambda _f: self.runtime.call_soon(self._loops.wake_all))
        return fut

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
            "term": self._term(),
            "loops": self.loops_view(),
            "levels": levels,
        }

    def _term(self) -> int | None:
        token = self._loops.token
        return token.term if self.running and token is not None else None

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
