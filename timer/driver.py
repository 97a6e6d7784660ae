"""The timer's leader-only driver: when to propose which enqueue and dequeue commands.

A loop of the node's leader runtime (:class:`chronomq.raftlog.leaderloop.SteppedLoop`), its
steps on a thread of their own (``leader-work-timer``: planning reads files and must not stall
the HTTP loop or the schedule's levels). While this node is the confirmed leader it loops: it plans a dequeue batch from the cursor
(the last one proposed, or the committed one) with the leader's clock,
:meth:`~chronomq.timer.dequeue.DequeuePlanner.plan`, and proposes ``{"enq", "span"}``: enqueue
what the timer topic holds, then deliver the span. Up to ``max_inflight`` commands are in
flight, each planned from where the previous one will leave the cursor (a pipeline, so Raft
round trips overlap with planning). A command found stale or failed, a timeout or a
:class:`~chronomq.timer.errors.StaleCursor` drains the pipeline and planning restarts from the
committed cursor: duplicates are impossible (apply delivers only from the committed cursor),
so resyncing is always safe. When nothing is due it sleeps until the next slot's last
millisecond; a commit that grows the timer topic wakes it to propose an enqueue. Moving the
cursor over empty slots alone is proposed only once it lags by ``idle_advance_ms`` (2 s), so an
idle cluster does not commit ten commands a second.

**Reclaim.** At most once a second the driver looks for the first TimerLog record an apply may
still read (:class:`~chronomq.timer.reclaim.ReclaimScanner`, from the committed state) and, when
the start of its segment is past the replicated reclaim position, adds ``"reclaim"`` to the
next command it proposes; every replica then deletes the segments before it at its next
checkpoints.

**Leadership.** The driver is one piece of leader-only work (``timer``) owned by
:class:`chronomq.raftlog.leadership.Leadership`, which the log feeds with confirmed terms (a
barrier committed in the term, so every earlier timer command is applied here and the
committed cursor is current). The owner hands the driver a
:class:`~chronomq.raftlog.leadership.TermToken` for a term; the driver takes it up at its next
turn (:class:`chronomq.raftlog.leaderloop.SteppedWork` calls :meth:`TimerDriver.begin`) and
does leader work only while that token is current: every proposal checks it. When the term
ends the driver, at its next turn (the owner wakes it), drops its in-flight commands and
cursors (:meth:`TimerDriver.end`), counts its loop stopped and tells the owner, and only then
may the next term's work start, which plans again from the committed cursor. A follower keeps its wheel
current by applying the same commands, so taking over is planning from the committed cursor at
once; :attr:`TimerDriver.takeover` says how long the first command took.

Observer: ``on_delivered(items, delivered_ms)`` is called **on the node that leads when the
delivery is applied**, from the driver's thread, shortly after the apply (never on the Raft
thread); ``items`` are ``(msg_id_hex, real_topic, store_ms_of_timer_message, due_ms)`` and
``delivered_ms`` is the store time of the delivered copies. If the observer falls behind by
more than :data:`chronomq.timer.machine.OBSERVED_ITEMS` messages, the oldest notices are dropped
and counted (``observer_dropped``).
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from chronomq.raftlog.errors import RaftLogError
from chronomq.raftlog.leaderloop import LoopSpec, SteppedLoop, SteppedWork, Wake
from chronomq.raftlog.leadership import TermToken
from chronomq.raftlog.node import RaftLog
from chronomq.raftlog.store import ApplyResult
from chronomq.timer import message as tm
from chronomq.timer.config import TimerConfig
from chronomq.timer.cursor import ReadCursor
from chronomq.timer.dequeue import DequeueBatch, DequeuePlanner
from chronomq.timer.errors import StaleCursor
from chronomq.timer.machine import (
    MAX_ENQUEUE_PER_COMMAND,
    NAME,
    DeliveredItem,
    TimerMachine,
    TimerOutcome,
)
from chronomq.timer.reclaim import ReclaimScanner, reclaim_position

# The timer service's lines, as before the driver had a module of its own.
log = logging.getLogger("chronomq.timer.service")

OnDelivered = Callable[[list[DeliveredItem], int], None]

RECLAIM_INTERVAL_S = 1.0
"""How often the leader looks for a new TimerLog reclaim position."""
RECLAIM_CHUNKS = 4
"""Scans (of :data:`chronomq.timer.reclaim.CHUNK_RECORDS` records, the timer's lock released
between them) one look may take; the next look goes on from there."""

#: The driver's name as leader-only work, and its loop's.
DRIVER_WORK = "timer"
DRIVER_LOOP = "timer driver"


def switch_value(replicated: bool | None, default: bool) -> bool:
    """A runtime switch: the replicated value once set, the node's default until then."""
    return default if replicated is None else replicated


@dataclass(slots=True)
class _InFlight:
    future: Future[ApplyResult]
    deadline: float
    cursor: ReadCursor | None
    enq: int | None


class TimerDriver:
    """The timer's driver on the leader, and the figures of its work."""

    def __init__(
        self,
        raftlog: RaftLog,
        machine: TimerMachine,
        config: TimerConfig,
        *,
        stop: threading.Event,
        auto_create_topics: bool = True,
        on_delivered: OnDelivered | None = None,
        commit_timeout_s: float = 10.0,
        max_inflight: int = 4,
    ) -> None:
        self.raftlog = raftlog
        self.machine = machine
        self.geometry = config.geometry
        self.auto_create_topics = auto_create_topics
        self.on_delivered = on_delivered
        self.commit_timeout_s = commit_timeout_s
        self.max_inflight = max_inflight
        self._planner = DequeuePlanner(
            self.geometry,
            max_records=config.timer_dequeue_batch_max,
            max_slots=config.timer_dequeue_scan_slots_max,
        )
        # Node-level defaults of the runtime switches; the replicated ones win once set.
        self.stop_enqueue_default = config.timer_stop_enqueue
        self.stop_dequeue_default = config.timer_stop_dequeue
        self._wake = Wake()
        self._stop = stop
        #: The driver as a loop of the leader runtime.
        self.loop = SteppedLoop(DRIVER_WORK, DRIVER_LOOP, self, self._wake, "timer driver")
        #: The driver as leader-only work turned by hand (tests with a fake clock).
        self.work = SteppedWork(DRIVER_WORK, DRIVER_LOOP, self, self._wake)
        # Driver state (driver thread only).
        self._token: TermToken | None = None
        """The term the driver works for; None while it does no leader work."""
        self._inflight: collections.deque[_InFlight] = collections.deque()
        self._inflight_cursor: ReadCursor | None = None
        # Where the last plan stopped (proposed or not): how far reading has got on the leader.
        self.scan_cursor: ReadCursor | None = None
        self._last_enq_propose = 0.0
        self._reclaimer = ReclaimScanner()
        self._reclaim_due = 0.0
        self._reclaim_proposed = 0
        self._resync = False
        self._switches_pushed = False
        self._seen_cq = 0
        # Moving the cursor over empty slots is proposed only once it lags this far: an idle
        # cluster commits one such command every two seconds, and a plan scans at most this
        # many empty slots again.
        self.idle_advance_ms = max(2000, 20 * self.geometry.precision_ms)
        self.enq_interval_s = min(0.025, max(0.005, self.geometry.precision_ms / 4000))
        # Figures.
        self.commands = 0
        self.resyncs = 0
        self.leader_since_ms: int | None = None
        self._confirmed_at = 0.0
        self._awaiting_first = False
        self.takeover: dict[str, Any] = {}

    def _mono(self) -> float:
        """Seconds on the log's monotonic clock (a fake one in tests)."""
        return self.raftlog.clock.monotonic_ms() / 1000

    # ------------------------------------------------------------------ lifecycle

    def spec(self) -> LoopSpec:
        """The driver as a loop of the leader runtime."""
        return self.loop.spec()

    def wake(self) -> None:
        """Cut the driver's sleep short (any thread)."""
        self._wake.set()

    def step(self) -> float:
        """One step of the driver for the term it works for; how long it may sleep."""
        self._notify_observer()
        return self._step()

    def turn(self) -> float:
        """Take up (or leave) the term the owner handed over, then :meth:`step`: the driver
        turned by hand (:attr:`work`); tests call it with a fake clock."""
        return self.work.turn()

    def close(self) -> None:
        """Propose nothing more; leave the term the driver works for by hand (the runtime ends
        its own loop)."""
        self._stop.set()
        self._wake.set()
        self.work.close()

    # ------------------------------------------------------------------ figures

    @property
    def active(self) -> bool:
        """The driver runs on the leader runtime and works for the current term."""
        return self._current() and self.loop.running

    @property
    def inflight(self) -> int:
        """Commands proposed and not settled yet."""
        return len(self._inflight)

    def switches(self) -> dict[str, bool]:
        """The runtime switches as they stand: replicated, or this node's defaults."""
        st = self.machine.committed()
        return {
            "stop_enqueue": switch_value(st.stop_enqueue, self.stop_enqueue_default),
            "stop_dequeue": switch_value(st.stop_dequeue, self.stop_dequeue_default),
        }

    # ------------------------------------------------------------------ listeners

    def on_apply(self, result: ApplyResult) -> None:
        # Raft thread: cheap. Wake the driver when the timer topic grew on the leader.
        if not result.messages or not self.raftlog.is_leader:
            return
        cq = self.raftlog.store.max_offset(tm.TIMER_TOPIC, tm.TIMER_QUEUE)
        if cq != self._seen_cq:
            self._seen_cq = cq
            self._wake.set()

    def on_applied(self, out: TimerOutcome) -> None:
        if self.machine.observed:
            self._wake.set()

    # ------------------------------------------------------------------ driver

    def failed(self) -> None:
        """A step raised: plan again from the committed cursor."""
        self._resync = True

    def _notify_observer(self) -> None:
        while self.machine.observed:
            taken = self.machine.take_observed()
            if taken is None:
                return
            items, delivered_ms = taken
            if self.on_delivered is not None:
                try:
                    self.on_delivered(items, delivered_ms)
                except Exception:
                    log.exception("timer delivery observer failed")

    def _reset(self) -> None:
        self._inflight.clear()
        self._inflight_cursor = None
        self.scan_cursor = None
        self._resync = False
        self._reclaimer.reset()
        self._reclaim_proposed = 0

    def begin(self, token: TermToken) -> None:
        """Work for ``token.term`` from now on: plan from the committed cursor."""
        self._confirmed_at = self._mono()
        self._token = token
        self._become_leader()

    def end(self) -> None:
        """Stop the leader work: drop what is in flight (the next term plans from the committed
        cursor)."""
        token, self._token = self._token, None
        if token is None:
            return
        self._reset()
        self.leader_since_ms = None
        log.info("timer driver stopped: term %d ended", token.term)
        self._notify_observer()  # what the term's last commands delivered

    def _current(self) -> bool:
        token = self._token
        return token is not None and token.is_current() and not self._stop.is_set()

    def _step(self) -> float:
        """One turn of the driver; returns how long it may sleep (a wake cuts it short)."""
        if self._token is None:
            return 0.5
        if not self.raftlog.is_leader:
            return 0.05  # the loss is on its way to the owner: propose nothing meanwhile
        self._settle()
        if not self._current():
            return 0.0
        if self._resync:
            if self._inflight:
                return 0.05
            self._reset()
            self.resyncs += 1
        if len(self._inflight) >= self.max_inflight:
            return 0.05
        committed = self.machine.committed()
        stop_enq = switch_value(committed.stop_enqueue, self.stop_enqueue_default)
        stop_deq = switch_value(committed.stop_dequeue, self.stop_dequeue_default)
        store = self.raftlog.store
        now = self.raftlog.clock.now_ms()
        cq = store.max_offset(tm.TIMER_TOPIC, tm.TIMER_QUEUE)
        enq_lag = cq - self._enqueue_expected(committed.enqueue_offset)
        since_enq = self._mono() - self._last_enq_propose
        want_enq = not stop_enq and enq_lag > 0
        urgent_enq = want_enq and (enq_lag >= 512 or since_enq >= self.enq_interval_s)
        if committed.cursor is None:
            # No timer command yet: the first one starts the cursor at its propose time.
            if not self._inflight:
                self._propose({"enq": cq}, None, cq)
            return 0.05
        batch: DequeueBatch | None = None
        worth = False
        if not stop_deq:
            start = self._inflight_cursor or committed.cursor
            try:
                with self.machine.lock:
                    batch = self._planner.plan(
                        start, now, self.machine.files.wheel, self.machine.files.log
                    )
            except StaleCursor as exc:
                log.info("timer cursor moved under the planner (%s): resyncing", exc)
                self._resync = True
                return 0.0
            self.scan_cursor = batch.cursor
            # Items are always worth a command; a walk over empty slots only once it is long
            # (measured from where this plan started, so a full pipeline adds nothing).
            worth = bool(batch.items) or (
                batch.cursor.slot_ms - start.slot_ms >= self.idle_advance_ms
            )
        if worth or urgent_enq:
            payload: dict[str, Any] = {}
            if not stop_enq:
                payload["enq"] = cq
            cursor = None
            if batch is not None and not batch.is_noop:
                payload["span"] = list(batch.span.as_tuple())
                cursor = batch.cursor
            reclaim = self._reclaim_position()
            if reclaim is not None:
                payload["reclaim"] = reclaim
                self._reclaim_proposed = reclaim
            self._propose(payload, cursor, cq if not stop_enq else None)
            return 0.0
        # Nothing worth proposing now: sleep until the next slot falls due, or until the
        # pending enqueue is due. (A commit or a leadership change wakes us earlier.)
        timeout = 0.25
        if batch is not None:
            wait_ms = self.geometry.slot_last_ms(batch.cursor.slot_ms) - now + 1
            timeout = max(0.001, min(wait_ms / 1000, 0.25))
        if want_enq:
            timeout = min(timeout, max(0.0, self.enq_interval_s - since_enq))
        return timeout

    def _reclaim_position(self) -> int | None:
        """A TimerLog reclaim position past the committed one (and past what was proposed
        already), at most once every :data:`RECLAIM_INTERVAL_S`; None otherwise."""
        if self._mono() < self._reclaim_due:
            return None
        self._reclaim_due = self._mono() + RECLAIM_INTERVAL_S
        machine, store = self.machine, self.raftlog.store
        with machine.lock:
            st = machine.state
            if st.cursor is None or machine.files.log.end_pos != st.log_end:
                return None  # no timer command yet, or the files are being aligned
            cursor_ms, enqueued, committed = st.cursor.slot_ms, st.enqueue_offset, st.reclaim_pos
        units = store.read_units(tm.TIMER_TOPIC, tm.TIMER_QUEUE, enqueued, 1)
        waiting = units[0].commitlog_offset if units else None
        cancels_before = self._reclaimer.cancels_read_before(
            cursor_ms, store.commitlog.length, waiting
        )
        for _ in range(RECLAIM_CHUNKS):
            with machine.lock:
                tlog = machine.files.log
                pos, done = self._reclaimer.first_needed(
                    tlog, cursor_ms, cancels_before, from_pos=committed
                )
                segment_bytes = tlog.segment_bytes
            if done:
                found = reclaim_position(pos, segment_bytes)
                if found > max(committed, self._reclaim_proposed):
                    return found
                return None
        return None

    def _enqueue_expected(self, committed: int) -> int:
        """Where the enqueue offset will be once the commands in flight apply: each enqueues
        at most ``MAX_ENQUEUE_PER_COMMAND``, whatever offset it asked for."""
        asked = [f.enq for f in self._inflight if f.enq is not None]
        if not asked:
            return committed
        return min(max(asked), committed + MAX_ENQUEUE_PER_COMMAND * len(asked))

    def _become_leader(self) -> None:
        self._reset()
        self.leader_since_ms = self.raftlog.clock.now_ms()
        self._awaiting_first = True
        self.takeover = {
            "confirmed_ms": self.leader_since_ms,
            "first_command_ms": None,
            "rebuild_ms": 0,
        }
        self._switches_pushed = False
        store = self.raftlog.store
        if not self.auto_create_topics and store.queue_count(tm.TIMER_TOPIC) is None:
            # Without auto-creation the first timer produce would find no timer topic; with
            # it, that produce creates the topic (like the schedule topic), and an idle
            # cluster shows no internal topic.
            try:
                if self._current():
                    self.raftlog.create_topic(tm.TIMER_TOPIC, 1)
            except RaftLogError as exc:
                log.warning("could not create %s: %s", tm.TIMER_TOPIC, exc)
        committed = self.machine.committed()
        changes = {}
        if committed.stop_enqueue is None and self.stop_enqueue_default:
            changes["stop_enqueue"] = True
        if committed.stop_dequeue is None and self.stop_dequeue_default:
            changes["stop_dequeue"] = True
        if changes:
            self._propose({"switch": changes}, None, None)
        log.info("timer driver active: cursor %s", committed.cursor)

    def _propose(self, payload: dict[str, Any], cursor: ReadCursor | None, enq: int | None) -> None:
        if not self._current():
            self._resync = True  # the term ended: nothing more is proposed for it
            return
        try:
            fut = self.raftlog.propose_extension(NAME, payload)
        except RaftLogError as exc:
            log.info("timer command not proposed: %s", exc)
            self._resync = True
            return
        fut.add_done_callback(lambda _f: self._wake.set())
        self.commands += 1
        self._inflight.append(_InFlight(fut, self._mono() + self.commit_timeout_s, cursor, enq))
        if cursor is not None:
            self._inflight_cursor = cursor
        if enq is not None:
            self._last_enq_propose = self._mono()

    def _settle(self) -> None:
        now = self._mono()
        while self._inflight:
            head = self._inflight[0]
            if not head.future.done():
                if now > head.deadline:
                    self._inflight.popleft()
                    log.warning("timer command got no answer in %.1f s", self.commit_timeout_s)
                    self._resync = True
                    continue
                return
            self._inflight.popleft()
            try:
                result = head.future.result()
            except Exception as exc:
                log.info("timer command failed: %s", exc)
                self._resync = True
                continue
            out = result.ext
            if not isinstance(out, TimerOutcome) or out.stale or out.invalid:
                self._resync = True
            if self._awaiting_first:
                self._awaiting_first = False
                self.takeover["first_command_ms"] = round(
                    (self._mono() - self._confirmed_at) * 1000, 1
                )
                log.info("timer takeover: first command committed %s", self.takeover)
