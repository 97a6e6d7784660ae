"""The timer service: one node's timer, assembled, and what the API asks of it.

The deterministic part lives in :mod:`chronomq.timer.machine` (the apply extension every
replica runs); the rest is in modules of its own, and this one puts them together:

* :mod:`chronomq.timer.driver`: the leader's dequeue/enqueue driver, leader-only work owned by
  :class:`chronomq.raftlog.leadership.Leadership`, a loop of the node's
  :class:`chronomq.raftlog.leaderloop.LeaderRuntime`;
* :mod:`chronomq.timer.produce`: the produce rewrite (:meth:`TimerService.produce_hook`, on the
  HTTP loop of the leader) with its deliver-time and congestion checks;
* :mod:`chronomq.timer.peerlog`: the TimerLog served to peers and completed from them;
* :mod:`chronomq.timer.wheelview`: where a timer message stands, what falls due when.

**Cancel** and **switches** are one command each, answered from the apply outcome (here).

Pop revive plugs in the same way as the driver: a second stepped loop on the same runtime,
driven from the timer's apply of revive timers, proposing only while its token is current.
Nothing in the replicated command says which term proposed it: the token only decides whether
to propose.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from chronomq.raftlog import record
from chronomq.raftlog.leaderloop import LeaderRuntime
from chronomq.raftlog.leadership import Leadership
from chronomq.raftlog.node import RaftLog
from chronomq.timer import message as tm
from chronomq.timer.config import TimerConfig
from chronomq.timer.driver import OnDelivered, TimerDriver
from chronomq.timer.errors import TimerStateError
from chronomq.timer.flow import check_cancel_room
from chronomq.timer.machine import NAME, TimerMachine, TimerOutcome
from chronomq.timer.peerlog import OpenUrl, PeerLogFetch, read_log
from chronomq.timer.produce import TimerProducer, advisory_slot
from chronomq.timer.state import TimerState
from chronomq.timer.wheel import Slot
from chronomq.timer.wheelview import due_view, locate


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
        open_url: OpenUrl | None = None,
        on_delivered: OnDelivered | None = None,
        commit_timeout_ms: int = 10_000,
        max_inflight: int = 4,
        runtime: LeaderRuntime | None = None,
    ) -> None:
        self.raftlog = raftlog
        self.config = config
        self.geometry = config.geometry
        self.commit_timeout_s = commit_timeout_ms / 1000
        self._stop = threading.Event()
        self.peers = PeerLogFetch(peer_urls, open_url, self._stop)
        self.machine = TimerMachine(
            data_dir, config, fetch=self.peers.fetch, is_leader=lambda: raftlog.is_leader
        )
        self.driver = TimerDriver(
            raftlog,
            self.machine,
            config,
            stop=self._stop,
            auto_create_topics=auto_create_topics,
            on_delivered=on_delivered,
            commit_timeout_s=self.commit_timeout_s,
            max_inflight=max_inflight,
        )
        self.machine.on_applied = self.driver.on_applied
        self.producer = TimerProducer(
            raftlog,
            self.machine,
            config,
            default_topic_queues=default_topic_queues,
            auto_create_topics=auto_create_topics,
        )
        #: The broker's ``timer_hook``: see :meth:`TimerProducer.produce_hook`.
        self.produce_hook = self.producer.produce_hook
        self._own_runtime = runtime is None
        self.runtime = runtime or LeaderRuntime(Leadership(now_ms=raftlog.clock.monotonic_ms))
        self.leadership = self.runtime.leadership

    @property
    def rejected(self) -> int:
        """Produced messages refused because their slot was congested."""
        return self.producer.rejected

    # ------------------------------------------------------------------ lifecycle

    def _register(self) -> None:
        """Register the apply extension (aligning the files to the replicated state) and the
        apply listener. Timer commands the Raft thread met before this waited for it."""
        self.raftlog.register_extension(self.machine)
        self.raftlog.add_apply_listener(self.driver.on_apply)

    def register(self) -> None:
        """:meth:`_register`, with the driver turned by hand (:meth:`step`, tests with a fake
        clock) as the leadership owner's work."""
        self._register()
        self.leadership.register(self.driver.work)
        if self._own_runtime:
            self.raftlog.add_leader_listener(self.leadership.on_leader)

    def start(self) -> None:
        """:meth:`_register`, then run the driver on the leader runtime (the service's own,
        started here and fed by the log's leadership, if it was given none)."""
        self._register()
        self.runtime.add(self.driver.spec())
        if self._own_runtime:
            self.runtime.start()
            self.raftlog.add_leader_listener(self.leadership.on_leader)

    def step(self) -> float:
        """One turn of the driver turned by hand; tests call it with a fake clock."""
        return self.driver.turn()

    def close(self) -> None:
        """Stop the driver. The files stay open until the log closes (the Raft thread may still
        apply timer commands until then); :meth:`chronomq.raftlog.store.Store.close` closes them."""
        self.driver.close()
        if self._own_runtime:
            self.runtime.close()

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
        slot = advisory_slot(self.machine, deliver_ms)
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
            self.driver.wake()
        return self.switches()

    def switches(self) -> dict[str, bool]:
        return self.driver.switches()

    # ------------------------------------------------------------------ peers' TimerLog

    def read_log(self, start: int, end: int) -> tuple[bytes, int]:
        """Records ``[start, end)`` of this node's TimerLog for a peer completing its own
        (:func:`chronomq.timer.peerlog.read_log`); any thread."""
        return read_log(self.machine.files, start, end)

    # ------------------------------------------------------------------ figures

    def locate(self, msg_id: bytes) -> dict[str, Any] | None:
        """Where the timer message ``msg_id`` stands in this node's wheel
        (:func:`chronomq.timer.wheelview.locate`); any thread."""
        return locate(self.machine, msg_id)

    def due_histogram(self, span_ms: int, buckets: int) -> dict[str, Any]:
        """What falls due in the next ``span_ms`` by bucket
        (:func:`chronomq.timer.wheelview.due_view`); any thread."""
        return due_view(self.machine, self.geometry, self.raftlog.clock.now_ms(), span_ms, buckets)

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
            scan = self.driver.scan_cursor if self.raftlog.is_leader else None
            reading = scan if scan is not None and scan.slot_ms > cursor.slot_ms else cursor
            read_behind = max(0, now - self.geometry.slot_last_ms(reading.slot_ms))
            cursor_slot = advisory_slot(self.machine, cursor.slot_ms)
        files = self.machine.files
        cp = files.checkpoint
        return {
            "role": "leader" if self.raftlog.is_leader else "follower",
            "active": self.driver.active,
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
                "rejected": self.producer.rejected,
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
            "inflight_commands": self.driver.inflight,
            "commands": self.driver.commands,
            "resyncs": self.driver.resyncs,
            "takeover": dict(self.driver.takeover),
            "leader_since_ms": self.driver.leader_since_ms,
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
                "timer_max_delay_s": self.config.timer_max_delay_s,
                "timer_congest_num_each_slot": self.config.timer_congest_num_each_slot,
                "timer_dequeue_batch_max": self.config.timer_dequeue_batch_max,
            },
        }
