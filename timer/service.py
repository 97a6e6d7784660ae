"""The timer service: the leader's dequeue/enqueue driver, the produce rewrite and cancel.

The deterministic part lives in :mod:`chronomq.timer.machine` (the apply extension every replica runs);
this module decides *when* to propose what, on the leader only:

* **Driver thread** (``timer-driver``, a plain thread: planning reads files and must not stall
  the HTTP loop). While this node is the confirmed leader it loops: it plans a dequeue batch
  from the cursor (the last one proposed, or the committed one) with the leader's clock,
  :meth:`~chronomq.timer.dequeue.DequeuePlanner.plan`, and proposes ``{"enq", "span"}``: enqueue what
  the timer topic holds, then deliver the span. Up to ``max_inflight`` commands are in flight,
  each planned from where the previous one will leave the cursor (a pipeline, so Raft round
  trips overlap with planning). A command found stale or failed, a timeout or a
  :class:`~chronomq.timer.errors.StaleCursor` drains the pipeline and planning restarts from the
  committed cursor: duplicates are impossible (apply delivers only from the committed
  cursor), so resyncing is always safe. When nothing is due it sleeps until the next slot's
  last millisecond; a commit that grows the timer topic wakes it to propose an enqueue.
  Moving the cursor over empty slots alone is proposed only once it lags by
  ``idle_advance_ms`` (2 s), so an idle cluster does not commit ten commands a second.
* **Produce** (:meth:`TimerService.produce_hook`, on the HTTP loop of the leader): checks the
  deliver time (at most ``timer_max_delay_sec`` ahead; a past time means now), the slot's
  congestion (:mod:`chronomq.timer.flow`, 429), and rewrites the message into the timer topic with a
  timer message id (:mod:`chronomq.timer.message`).
* **Cancel** and **switches**: one command each, answered from the apply outcome.

**Leadership.** The driver is one piece of leader-only work (``timer``) owned by
:class:`chronomq.raftlog.leadership.Leadership`, which the log feeds with confirmed terms (a barrier
committed in the term, so every earlier timer command is applied here and the committed cursor
is current). The owner hands the driver a :class:`~chronomq.raftlog.leadership.TermToken` for a term; the
driver thread takes it up at its next step and does leader work only while that token is
current: every proposal checks it. When the term ends the driver, at its next step (the owner
wakes it), drops its in-flight commands and cursors, counts its loop stopped and tells the
owner, and only then may the next term's work start, which plans again from the committed
cursor. A follower keeps its wheel current by applying the same commands, so taking over is
planning from the committed cursor at once; :attr:`TimerService.takeover` says how long the
first command took.

Pop revive, once it exists, plugs in the same way: a second piece registered with the same
owner (``leadership.register(Piece("pop-revive", start, wake))``), driven from the timer's
apply of revive timers, proposing only while its token is current and calling
``token.exited`` when its loop returns. Nothing in the replicated command says which term
proposed it: the token only decides whether to propose.

Observer: ``on_delivered(items, delivered_ms)`` is called **on the node that leads when the
delivery is applied**, from the driver thread, shortly after the apply (never on the Raft
thread); ``items`` are ``(msg_id_hex, real_topic, store_ms_of_timer_message, due_ms)`` and
``delivered_ms`` is the store time of the delivered copies. If the observer falls behind by
more than :data:`chronomq.timer.machine.OBSERVED_ITEMS` messages, the oldest notices are dropped and
counted (``observer_dropped``).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import random
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from chronomq.raftlog import record
from chronomq.raftlog.errors import InvalidInput, RaftLogError, UnknownQueue, UnknownTopic
from chronomq.raftlog.leadership import Leadership, Piece, TermToken, drive
from chronomq.raftlog.node import NewMessage, RaftLog
from chronomq.raftlog.store import ApplyResult
from chronomq.timer import message as tm
from chronomq.timer.chains import find_message, tombstone_keys
from chronomq.timer.config import TimerConfig
from chronomq.timer.cursor import ReadCursor
from chronomq.timer.dequeue import DequeueBatch, DequeuePlanner
from chronomq.timer.enqueue import check_deliver_time
from chronomq.timer.errors import InvalidDeliverTime, StaleCursor, TimerStateError
from chronomq.timer.flow import check_cancel_room, check_congestion
from chronomq.timer.histogram import due_histogram
from chronomq.timer.machine import (
    MAX_ENQUEUE_PER_COMMAND,
    NAME,
    DeliveredItem,
    TimerMachine,
    TimerOutcome,
)
from chronomq.timer.state import TimerState
from chronomq.timer.timerlog import read_records, uniq_key_hash
from chronomq.timer.wheel import Slot

log = logging.getLogger(__name__)

OnDelivered = Callable[[list[DeliveredItem], int], None]

#: The driver's name as leader-only work, and its loop's.
DRIVER_WORK = "timer"
DRIVER_LOOP = "timer driver"
#: Most TimerLog records one fetch answer carries (4 MB).
FETCH_MAX_RECORDS = 50_000
#: Wheel cells by default: two days at 100 ms (110 MB of sparse file).
DEFAULT_WHEEL_SLOTS = 1_728_000


@dataclass(slots=True)
class _InFlight:
    future: Future[ApplyResult]
    deadline: float
    cursor: ReadCursor | None
    enq: int | None


class TimerService:
    """One node's timer: the apply extension plus, on the leader, the driver."""

    def __init__(
        self,
        raftlog: RaftLog,
        config: TimerConfig,
        data_dir: Path | str,
        *,
        default_topic_queues: int = 4,
        auto_create_topics: bool = True,
        peer_urls: Callable[[], list[str]] = list,
        open_url: Callable[[str, float], Any] | None = None,
        on_delivered: OnDelivered | None = None,
        commit_timeout_ms: int = 10_000,
        max_inflight: int = 4,
        leadership: Leadership | None = None,
    ) -> None:
        self.raftlog = raftlog
        self.config = config
        self.geometry = config.geometry
        self.default_topic_queues = default_topic_queues
        self.auto_create_topics = auto_create_topics
        self.peer_urls = peer_urls
        # How a peer's URL is opened (blocking): the node passes one that authenticates.
        self.open_url: Callable[[str, float], Any] = open_url or (
            lambda url, timeout_s: urllib.request.urlopen(url, timeout=timeout_s)  # noqa: S310
        )
        self.on_delivered = on_delivered
        self.commit_timeout_s = commit_timeout_ms / 1000
        self.max_inflight = max_inflight
        self.machine = TimerMachine(
            data_dir, config, fetch=self._fetch, is_leader=lambda: raftlog.is_leader
        )
        self.machine.on_applied = self._on_applied
        self._planner = DequeuePlanner(
            self.geometry,
            max_records=config.timer_dequeue_batch_max,
            max_slots=config.timer_dequeue_scan_slots_max,
        )
        # Node-level defaults of the runtime switches; the replicated ones win once set.
        self.stop_enqueue_default = config.timer_stop_enqueue
        self.stop_dequeue_default = config.timer_stop_dequeue
        self._rng = random.Random(random.SystemRandom().getrandbits(128))
        self._rr: dict[str, itertools.count[int]] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._own_leadership = leadership is None
        self.leadership = leadership or Leadership(now_ms=raftlog.clock.monotonic_ms)
        self._token_lock = threading.Lock()
        self._next_token: TermToken | None = None
        """Handed over by the leadership owner, taken up by the driver at its next step."""
        # Driver state (driver thread only).
        self._token: TermToken | None = None
        """The term the driver works for; None while it does no leader work."""
        self._inflight: collections.deque[_InFlight] = collections.deque()
        self._inflight_cursor: ReadCursor | None = None
        # Where the last plan stopped (proposed or not): how far reading has got on the leader.
        self._scan_cursor: ReadCursor | None = None
        self._last_enq_propose = 0.0
        self._resync = False
        self._switches_pushed = False
        self._seen_cq = 0
        # Moving the cursor over empty slots is proposed only once it lags this far: an idle
        # cluster commits one such command every two seconds, and a plan scans at most this
        # many empty slots again.
        self.idle_advance_ms = max(2000, 20 * self.geometry.precision_ms)
        self.enq_interval_s = min(0.025, max(0.005, self.geometry.precision_ms / 4000))
        # Figures.
        self.rejected = 0
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

    def register(self) -> None:
        """Register the apply extension (aligning the files to the replicated state) and the
        listeners. Timer commands the Raft thread met before this waited for it."""
        self.raftlog.register_extension(self.machine)
        self.raftlog.add_apply_listener(self._on_apply)
        self.leadership.register(Piece(DRIVER_WORK, self._begin_term, self._wake.set))
        if self._own_leadership:
            self.raftlog.add_leader_listener(self.leadership.on_leader)

    def start(self) -> None:
        """:meth:`register`, then start the driver thread."""
        self.register()
        self._thread = threading.Thread(target=self._run, name="timer-driver", daemon=True)
        self._thread.start()

    def step(self) -> float:
        """One turn of the driver (what its thread loops on); tests call it with a fake clock."""
        self._notify_observer()
        return self._step()

    def close(self) -> None:
        """Stop the driver. The files stay open until the log closes (the Raft thread may still
        apply timer commands until then); :meth:`chronomq.raftlog.store.Store.close` closes them."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            if self._thread.is_alive():
                return  # still stepping; it leaves its term when the step returns
        self._leave_term()

    # ------------------------------------------------------------------ listeners

    def _begin_term(self, token: TermToken) -> None:
        """The leadership owner starts the driver's work for ``token.term`` (leadership thread);
        the driver takes it up at its next step."""
        if self._stop.is_set():
            token.exited(DRIVER_WORK)
            return
        with self._token_lock:
            stale, self._next_token = self._next_token, token
        if stale is not None:  # never taken up: the owner ended it before the driver looked
            stale.exited(DRIVER_WORK)
        self._confirmed_at = self._mono()
        self._wake.set()

    def _on_apply(self, result: ApplyResult) -> None:
        # Raft thread: cheap. Wake the driver when the timer topic grew on the leader.
        if not result.messages or not self.raftlog.is_leader:
            return
        cq = self.raftlog.store.max_offset(tm.TIMER_TOPIC, tm.TIMER_QUEUE)
        if cq != self._seen_cq:
            self._seen_cq = cq
            self._wake.set()

    def _on_applied(self, out: TimerOutcome) -> None:
        if self.machine.observed:
            self._wake.set()

    # ------------------------------------------------------------------ driver

    def _run(self) -> None:
        try:
            drive(self._stop, self._wake, self.step, self._step_failed, "timer driver")
        finally:
            self._leave_term()

    def _step_failed(self) -> None:
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
        self._scan_cursor = None
        self._resync = False

    def _take_term(self) -> TermToken | None:
        """The token the driver works for now: leave an ended term (resetting the in-flight
        state and telling the owner), then take up the one the owner handed over, if any."""
        token = self._token
        if token is not None and not token.is_current():
            self._leave_term()
        if self._token is None:
            with self._token_lock:
                token, self._next_token = self._next_token, None
            if token is not None:
                if not token.is_current() or self._stop.is_set():
                    token.exited(DRIVER_WORK)
                    return None
                token.enter_loop(DRIVER_WORK, DRIVER_LOOP)
                self._token = token
                self._become_leader()
        return self._token

    def _leave_term(self) -> None:
        """Stop the leader work: drop what is in flight (the next term plans from the committed
        cursor) and tell the owner."""
        token, self._token = self._token, None
        with self._token_lock:
            pending, self._next_token = self._next_token, None
        if pending is not None:
            pending.exited(DRIVER_WORK)
        if token is None:
            return
        self._reset()
        self.leader_since_ms = None
        log.info("timer driver stopped: term %d ended", token.term)
        token.exit_loop(DRIVER_LOOP)
        token.exited(DRIVER_WORK)

    def _current(self) -> bool:
        token = self._token
        return token is not None and token.is_current() and not self._stop.is_set()

    def _step(self) -> float:
        """One turn of the driver; returns how long it may sleep (a wake cuts it short)."""
        if self._take_term() is None:
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
        stop_enq = self._switch(committed.stop_enqueue, self.stop_enqueue_default)
        stop_deq = self._switch(committed.stop_dequeue, self.stop_dequeue_default)
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
            self._scan_cursor = batch.cursor
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

    def _enqueue_expected(self, committed: int) -> int:
        """Where the enqueue offset will be once the commands in flight apply: each enqueues
        at most ``MAX_ENQUEUE_PER_COMMAND``, whatever offset it asked for."""
        asked = [f.enq for f in self._inflight if f.enq is not None]
        if not asked:
            return committed
        return min(max(asked), committed + MAX_ENQUEUE_PER_COMMAND * len(asked))

    @staticmethod
    def _switch(replicated: bool | None, default: bool) -> bool:
        return default if replicated is None else replicated

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

    # ------------------------------------------------------------------ produce

    def _slot(self, time_ms: int) -> Slot | None:
        """The wheel slot of ``time_ms``, read without the lock (advisory: flow control)."""
        try:
            return self.machine.files.wheel.get(time_ms)
        except Exception:  # being rewritten or realigned right now: no opinion
            return None

    def produce_hook(
        self,
        topic: str,
        body: bytes,
        queue: int | None,
        props: Mapping[str, str],
        field_name: str,
        value: Any,
        store_ms: int,
        prefix: str,
        extra: dict[str, Any],
    ) -> NewMessage:
        """Rewrite one produced message with ``delay_ms``/``deliver_at_ms`` into the timer
        topic; the broker's ``timer_hook``. Raises caller errors naming the field."""
        field = f"{prefix}.{field_name}"
        if topic == tm.TIMER_TOPIC:
            raise InvalidInput(f"cannot produce to the internal topic {tm.TIMER_TOPIC}", "topic")
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidDeliverTime(f"{field_name} must be an integer, got {value!r}", field=field)
        if value < 0:
            raise InvalidDeliverTime(f"{field_name} must not be negative, got {value}", field=field)
        deliver_ms = store_ms + value if field_name == "delay_ms" else value
        check_deliver_time(deliver_ms, store_ms, self.config, field=field)
        deliver_ms = max(deliver_ms, store_ms)  # a time in the past means now
        count = self.raftlog.store.queue_count(topic)
        if count is None:
            if not self.auto_create_topics:
                raise UnknownTopic(f"topic {topic} does not exist", "topic")
            count = self.default_topic_queues
        if queue is None:
            rr = self._rr.get(topic)
            if rr is None:
                rr = self._rr[topic] = itertools.count()
            queue = next(rr) % count
        elif queue >= count:
            raise UnknownQueue(
                f"topic {topic} has queues 0..{count - 1}, not {queue}", f"{prefix}.queue"
            )
        slot = self._slot(deliver_ms)
        if slot is not None:
            try:
                check_congestion(
                    slot, self.config.timer_congest_num_each_slot, self._rng.random(), field=field
                )
            except Exception:
                self.rejected += 1
                raise
        extra["deliver_ms"] = deliver_ms
        return NewMessage(
            tm.TIMER_TOPIC,
            body,
            queue_id=tm.TIMER_QUEUE,
            properties=tm.timer_properties(
                props, real_topic=topic, real_queue=queue, deliver_ms=deliver_ms
            ),
            tags_code=deliver_ms,
            msg_id=tm.new_timer_id(deliver_ms, self._rng),
        )

    # ------------------------------------------------------------------ cancel, switches

    async def _command(self, payload: dict[str, Any]) -> TimerOutcome:
        fut = self.raftlog.propose_extension(NAME, payload)
        # asyncio.timeout, not wait_for: a cancel arriving as the commit completes is kept.
        async with asyncio.timeout(self.commit_timeout_s + 1):
            result = await asyncio.shield(asyncio.wrap_future(fut))
        out = result.ext
        if not isinstance(out, TimerOutcome):
            raise TimerStateError(f"timer command answered {out!r}")
        return out

    async def cancel(self, msg_id_text: str) -> dict[str, Any]:
        """``DELETE /v1/timers/{msg_id}``: ``cancelled``, ``delivered`` or ``unknown``."""
        msg_id = record.parse_msg_id(msg_id_text, "msg_id")
        hex_id = record.msg_id_hex(msg_id)
        deliver_ms = tm.timer_id_deliver_ms(msg_id)
        if deliver_ms is None:
            return {"msg_id": hex_id, "status": "unknown", "reason": "not a timer message id"}
        slot = self._slot(deliver_ms)
        if slot is not None:
            check_cancel_room(slot, self.config.timer_max_tombstones_each_slot)
        payload: dict[str, Any] = {"cancel": [[hex_id, deliver_ms]]}
        cq = self.raftlog.store.max_offset(tm.TIMER_TOPIC, tm.TIMER_QUEUE)
        if cq:
            payload["enq"] = cq
        out = await self._command(payload)
        answer = out.cancels[0]
        return {
            "msg_id": hex_id,
            "status": answer.status,
            "reason": answer.reason,
            "deliver_ms": deliver_ms,
        }

    async def set_switches(
        self, *, stop_enqueue: bool | None = None, stop_dequeue: bool | None = None
    ) -> dict[str, bool]:
        """Replicated runtime switches: every node, and every later leader, sees them."""
        changes = {
            k: v
            for k, v in (("stop_enqueue", stop_enqueue), ("stop_dequeue", stop_dequeue))
            if v is not None
        }
        if changes:
            await self._command({"switch": changes})
            self._wake.set()
        return self.switches()

    def switches(self) -> dict[str, bool]:
        st = self.machine.committed()
        return {
            "stop_enqueue": self._switch(st.stop_enqueue, self.stop_enqueue_default),
            "stop_dequeue": self._switch(st.stop_dequeue, self.stop_dequeue_default),
        }

    # ------------------------------------------------------------------ peers' TimerLog

    def read_log(self, start: int, end: int) -> tuple[bytes, int]:
        """Records ``[start, end)`` of this node's TimerLog (at most :data:`FETCH_MAX_RECORDS`)
        for a peer completing its own; any thread."""
        files = self.machine.files
        have = files.log.end_pos
        if end > have:
            raise TimerStateError(f"this node's TimerLog ends at {have}, before {end}")
        return read_records(
            files.log.directory, files.log.segment_bytes, start, end, FETCH_MAX_RECORDS
        )

    def _fetch(self, start: int, end: int, sink: Callable[[bytes], None]) -> None:
        """Complete the local TimerLog from peers over their HTTP API (blocking; runs where the
        files are aligned: registration or a snapshot install)."""
        pos = start
        deadline = time.monotonic() + 300
        while pos < end:
            progressed = False
            for url in self.peer_urls():
                query = f"{url}/v1/admin/timer/log?from={pos}&to={end}"
                try:
                    with self.open_url(query, 10) as r:
                        data = r.read()
                        nxt = int(r.headers["X-Timer-Next"])
                except (OSError, ValueError, KeyError, TypeError, urllib.error.URLError) as exc:
                    log.info("TimerLog fetch from %s failed: %s", url, exc)
                    continue
                if nxt <= pos or not data:
                    continue
                sink(data)
                pos = nxt
                progressed = True
                break
            if not progressed:
                if time.monotonic() > deadline:
                    raise TimerStateError(f"no peer could send TimerLog [{pos}, {end})")
                self._stop.wait(0.5)

    # ------------------------------------------------------------------ figures

    def locate(self, msg_id: bytes) -> dict[str, Any] | None:
        """Where the timer message ``msg_id`` stands in this node's wheel (any thread, under
        the machine's lock): ``waiting``, ``delivered`` (its slot has been read past it),
        ``cancelled`` or ``unknown`` (not in its slot: rolling, a lap old, or not enqueued
        yet), with its deliver time and, when found, where its stored record is.
        ``None`` when ``msg_id`` is not a timer message id."""
        deliver_ms = tm.timer_id_deliver_ms(msg_id)
        if deliver_ms is None:
            return None
        key_hash = uniq_key_hash(record.msg_id_hex(msg_id))
        machine = self.machine
        with machine.lock:
            cursor = machine.committed().cursor
            wheel, log_ = machine.files.wheel, machine.files.log
            slot = wheel.get(deliver_ms)
            pos = find_message(log_, slot, key_hash) if slot.count else None
            found = None if pos is None else log_.read(pos)
            cancelled = bool(slot.tomb_count) and key_hash in tombstone_keys(log_, slot)
        answer: dict[str, Any] = {"deliver_ms": deliver_ms, "slot_ms": slot.slot_ms}
        if found is not None:
            answer["stored_at"] = [found.cl_offset, found.cl_size]
        if cancelled:
            status = "cancelled"
        elif pos is None:
            status = "unknown"
        elif (
            cursor is None
            or slot.slot_ms > cursor.slot_ms
            or (slot.slot_ms == cursor.slot_ms and not cursor.has_read(pos))
        ):
            status = "waiting"
        else:
            status = "delivered"
        answer["status"] = status
        return answer

    def due_histogram(self, span_ms: int, buckets: int) -> dict[str, Any]:
        """What falls due in the next ``span_ms`` by bucket, from this node's wheel (any
        thread: each slot is read under the machine's lock, so apply waits at most one read).
        See :mod:`chronomq.timer.histogram`."""
        machine = self.machine

        class _Locked:
            def get(self, time_ms: int) -> Slot:
                with machine.lock:
                    return machine.files.wheel.get(time_ms)

        cursor = machine.committed().cursor
        hist = due_histogram(
            _Locked(),
            self.geometry,
            now_ms=self.raftlog.clock.now_ms(),
            span_ms=span_ms,
            buckets=buckets,
            cursor_slot_ms=None if cursor is None else cursor.slot_ms,
        )
        return {**hist.as_json(), "precision_ms": self.geometry.precision_ms}

    def stats(self) -> dict[str, Any]:
        """What ``GET /v1/admin/timer`` shows (this node's view)."""
        st: TimerState = self.machine.committed()
        store = self.raftlog.store
        now = self.raftlog.clock.now_ms()
        cq = store.max_offset(tm.TIMER_TOPIC, tm.TIMER_QUEUE)
        cursor = st.cursor
        read_behind = 0
        cursor_slot: Slot | None = None
        if cursor is not None:
            # On the leader, reading has got as far as its last plan (empty slots are passed
            # without a command until idle_advance_ms); elsewhere as far as the committed
            # cursor.
            scan = self._scan_cursor if self.raftlog.is_leader else None
            reading = scan if scan is not None and scan.slot_ms > cursor.slot_ms else cursor
            read_behind = max(0, now - self.geometry.slot_last_ms(reading.slot_ms))
            cursor_slot = self._slot(cursor.slot_ms)
        files = self.machine.files
        cp = files.checkpoint
        return {
            "role": "leader" if self.raftlog.is_leader else "follower",
            "active": self._current() and self._thread is not None,
            "backlog": {"total": st.backlog_total, "by_topic": dict(sorted(st.backlog.items()))},
            "read_behind_ms": read_behind,
            "offset_behind": max(0, cq - st.enqueue_offset),
            "cursor": None
            if cursor is None
            else dict(
                zip(("slot_ms", "head_pos", "stop_pos", "next_pos"), cursor.as_tuple(), strict=True)
            ),
            "enqueue_offset": st.enqueue_offset,
            "timer_topic_max_offset": cq,
            "congestion": {
                "limit_each_slot": self.config.timer_congest_num_each_slot,
                "rejected": self.rejected,
                "cursor_slot_messages": cursor_slot.count if cursor_slot else 0,
                "cursor_slot_cancels": cursor_slot.tomb_count if cursor_slot else 0,
            },
            "rates": {
                "enqueue_per_s": round(self.machine.enqueue_meter.rate_per_s(now), 1),
                "dequeue_per_s": round(self.machine.dequeue_meter.rate_per_s(now), 1),
            },
            "totals": dict(sorted(st.counters.items())),
            "checkpoint": None
            if cp is None
            else {
                "applied_index": cp.applied_index,
                "enqueue_offset": cp.enqueue_offset,
                "timerlog_flush_pos": cp.timerlog_flush_pos,
                "cursor_slot_ms": cp.cursor.slot_ms,
                "last_delivered_ms": cp.last_delivered_ms,
            },
            "timerlog_end": files.log.end_pos,
            "wheel_dirty_slots": files.wheel.dirty_slots,
            "switches": self.switches(),
            "last_delivered_ms": st.last_delivered_ms,
            "inflight_commands": len(self._inflight),
            "commands": self.commands,
            "resyncs": self.resyncs,
            "takeover": dict(self.takeover),
            "leader_since_ms": self.leader_since_ms,
            "last_align": None
            if files.last_align is None
            else {
                "target_end": files.last_align.target_end,
                "truncated_bytes": files.last_align.truncated_bytes,
                "fetched_records": files.last_align.fetched_records,
                "local_records": files.last_align.local_records,
                "rebuilt": files.last_align.rebuilt,
                "linked": files.last_align.linked,
                "seconds": files.last_align.seconds,
            },
            "observer_dropped": self.machine.observed_dropped,
            "config": {
                "timer_precision_ms": self.config.timer_precision_ms,
                "timer_wheel_slots": self.config.timer_wheel_slots,
                "timer_roll_window_slots": self.config.timer_roll_window_slots,
                "timer_max_delay_sec": self.config.timer_max_delay_sec,
                "timer_congest_num_each_slot": self.config.timer_congest_num_each_slot,
                "timer_dequeue_batch_max": self.config.timer_dequeue_batch_max,
            },
        }


def timer_config_from(values: Mapping[str, Any]) -> TimerConfig:
    """The :class:`TimerConfig` of a node from its ``timer_*`` keys.

    The wheel holds ``max(2 days at 100 ms, 2 x roll window)`` slots, so a read cursor lagging
    behind ``now`` still has an unread lap in front of it for everything inside the window.
    """
    roll = int(values["timer_roll_window_slots"])
    slots = max(DEFAULT_WHEEL_SLOTS, 2 * roll)
    return TimerConfig(
        timer_precision_ms=int(values["timer_precision_ms"]),
        timer_wheel_slots=min(slots, 50_000_000),
        timer_roll_window_slots=roll,
        timer_max_delay_sec=int(values["timer_max_delay_sec"]),
        timer_congest_num_each_slot=min(int(values["timer_congest_num_each_slot"]), 2**31 - 1),
        timer_stop_enqueue=bool(values["timer_stop_enqueue"]),
        timer_stop_dequeue=bool(values["timer_stop_dequeue"]),
    )
