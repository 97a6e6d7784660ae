"""A small in-process timer used by the tests: real files, fake time, no threads."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from chronomq.timer.cancel import CancelDecision, decide_cancel
from chronomq.timer.cursor import ReadCursor
from chronomq.timer.dequeue import DequeueBatch, DequeuePlanner, ItemAction, ReplayResult
from chronomq.timer.enqueue import EnqueueAction, EnqueueResult, TimerMessage, enqueue
from chronomq.timer.slots import SlotGeometry
from chronomq.timer.timerlog import TimerLog, uniq_key_hash
from chronomq.timer.wheel import TimerWheel

T0 = 1_700_000_000_000
GEOMETRY = SlotGeometry(precision_ms=100, slot_count=64, roll_window_slots=32)


@dataclass
class Delivery:
    key: str
    deliver_ms: int
    at_ms: int


@dataclass
class Harness:
    """Enqueue, plan, replay and cancel the way a driver would, all on one thread."""

    root: Path
    geometry: SlotGeometry = GEOMETRY
    segment_bytes: int = 4096
    max_records: int = 512
    max_slots: int = 1000
    start_ms: int = T0
    log: TimerLog = field(init=False)
    wheel: TimerWheel = field(init=False)
    cursor: ReadCursor = field(init=False)
    planner: DequeuePlanner = field(init=False)
    keys: dict[int, str] = field(default_factory=dict)
    deliver_at: dict[str, int] = field(default_factory=dict)
    delivered: list[Delivery] = field(default_factory=list)
    suppressed: list[str] = field(default_factory=list)
    reput: int = 0
    _next_offset: int = 0

    def __post_init__(self) -> None:
        self.log = TimerLog.open(self.root / "timerlog", segment_bytes=self.segment_bytes)
        self.wheel = TimerWheel.open(self.root / "timerwheel", self.geometry)
        self.cursor = ReadCursor.at(self.geometry.slot_ms(self.start_ms))
        self.planner = DequeuePlanner(
            self.geometry, max_records=self.max_records, max_slots=self.max_slots
        )

    def close(self) -> None:
        self.log.close()
        self.wheel.close()

    def _offset(self, key: str) -> int:
        offset = self._next_offset
        self._next_offset += 100
        self.keys[offset] = key
        return offset

    def produce(
        self, key: str, deliver_ms: int, now_ms: int, *, roll_count: int = 0
    ) -> EnqueueResult:
        """Store a timer message at ``now_ms`` and enqueue it; DUE_NOW is delivered at once."""
        self.deliver_at[key] = deliver_ms
        message = TimerMessage(
            cl_offset=self._offset(key),
            cl_size=100,
            deliver_ms=deliver_ms,
            store_ms=now_ms,
            key_hash=uniq_key_hash(key),
            roll_count=roll_count,
        )
        result = enqueue(
            message, cursor_slot_ms=self.cursor.slot_ms, log=self.log, wheel=self.wheel
        )
        if result.plan.action is EnqueueAction.DUE_NOW:
            self.delivered.append(Delivery(key, deliver_ms, now_ms))
        return result

    def cancel(self, key: str, now_ms: int, *, roll_count: int = 0) -> CancelDecision:
        """Apply a cancel of ``key`` at ``now_ms``: decide, then store its tombstone."""
        deliver_ms = self.deliver_at[key]
        decision = decide_cancel(
            target_deliver_ms=deliver_ms,
            key_hash=uniq_key_hash(key),
            committed=self.cursor,
            wheel=self.wheel,
            log=self.log,
            geometry=self.geometry,
        )
        if decision.write_tombstone:
            self._enqueue_tombstone(key, deliver_ms, now_ms, roll_count)
        return decision

    def _enqueue_tombstone(self, key: str, deliver_ms: int, now_ms: int, roll_count: int) -> None:
        message = TimerMessage(
            cl_offset=self._offset("cancel:" + key),
            cl_size=80,
            deliver_ms=deliver_ms,
            store_ms=now_ms,
            key_hash=uniq_key_hash(key),
            roll_count=roll_count,
            tombstone=True,
        )
        enqueue(message, cursor_slot_ms=self.cursor.slot_ms, log=self.log, wheel=self.wheel)

    def plan(self, now_ms: int, cursor: ReadCursor | None = None) -> DequeueBatch:
        return self.planner.plan(cursor or self.cursor, now_ms, self.wheel, self.log)

    def apply(self, batch: DequeueBatch, now_ms: int) -> ReplayResult:
        """Apply a delivery command carrying ``batch.span``, stamped ``now_ms``."""
        result = self.planner.replay(batch.span, self.cursor, self.wheel, self.log)
        if result.stale:
            return result
        self.cursor = result.cursor
        for item in result.items:
            key = self.keys[item.record.cl_offset]
            if item.action is ItemAction.DELIVER:
                self.delivered.append(Delivery(key, item.record.deliver_ms, now_ms))
            elif item.action is ItemAction.SUPPRESS:
                self.suppressed.append(key)
        for item in result.reputs:
            self.reput += 1
            key = self.keys[item.record.cl_offset]
            if item.record.is_tombstone:
                target = key.removeprefix("cancel:")
                self._enqueue_tombstone(
                    target, item.record.deliver_ms, now_ms, item.record.roll_count + 1
                )
            else:
                self.produce(
                    key, item.record.deliver_ms, now_ms, roll_count=item.record.roll_count + 1
                )
        return result

    def run_until(self, now_ms: int) -> None:
        """Plan and apply batches until nothing is left due at ``now_ms``."""
        for _ in range(100_000):
            batch = self.plan(now_ms)
            if batch.is_noop:
                return
            self.apply(batch, now_ms)
        raise AssertionError("dequeue did not settle")

    def delivered_keys(self) -> list[str]:
        return [d.key for d in self.delivered]
