"""A virtual-time asyncio loop and a one-node fake Raft for driving :class:`ScheduleService`.

- :class:`VirtualLoop` never sleeps: when nothing is ready it jumps its clock to the next
  timer, so ``asyncio.sleep``, ``asyncio.timeout`` and the service's polls run in virtual time,
  deterministically, in one thread.
- :class:`FakeRaftLog` is what the schedule service uses of :class:`chronomq.raftlog.node.RaftLog`:
  an in-memory kv, the schedule topic's ConsumeQueues and records, proposals that the test
  commits, fails or lets race a leadership loss, and conditional updates applied like the real
  store (``expect`` / ``updates`` on ``sched/off/<level>``).
"""

from __future__ import annotations

import asyncio
import random
import selectors
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from chronomq.raftlog import record
from chronomq.raftlog.errors import CommitOutcomeUnknown, ConditionFailed, NotLeader
from chronomq.raftlog.node import NewMessage
from chronomq.raftlog.store import CONDITION_FAILED, OK, BatchOutcome
from chronomq.schedule.levels import SCHEDULE_TOPIC, DelayLevelTable
from chronomq.schedule.rewrite import place

T0 = 1_700_000_000_000
REAL_TOPIC = "orders"
REAL_QUEUES = 4


class _JumpSelector(selectors.DefaultSelector):
    """Polls without waiting; if nothing is ready, moves the loop's clock by the timeout."""

    loop: VirtualLoop

    def select(self, timeout: float | None = None) -> list[Any]:
        ready = super().select(0)
        if ready or timeout == 0:
            return ready
        if timeout is None:
            raise RuntimeError("virtual loop: nothing ready and nothing scheduled (deadlock)")
        self.loop.advance_s(timeout)
        return ready


class VirtualLoop(asyncio.SelectorEventLoop):
    def __init__(self) -> None:
        selector = _JumpSelector()
        super().__init__(selector)
        selector.loop = self
        self._now_s = 0.0

    def time(self) -> float:
        return self._now_s

    def advance_s(self, seconds: float) -> None:
        self._now_s += max(0.0, seconds)


def run_virtual(main: Coroutine[Any, Any, None], timeout_s: float = 3600) -> None:
    """Run ``main`` on a fresh :class:`VirtualLoop` (``timeout_s`` of virtual time); whatever
    still runs after it (a failed run) is cancelled so the loop closes quietly."""

    async def cancel_the_rest() -> None:
        left = asyncio.all_tasks() - {asyncio.current_task()}
        for task in left:
            task.cancel()
        await asyncio.gather(*left, return_exceptions=True)

    loop = VirtualLoop()
    try:
        loop.run_until_complete(asyncio.wait_for(main, timeout=timeout_s))
    finally:
        loop.run_until_complete(cancel_the_rest())
        loop.close()


class VirtualClock:
    """The log's clock (:class:`chronomq.raftlog.clock.Clock`) read from the loop's virtual time."""

    def __init__(self, loop: VirtualLoop, start_ms: int = T0) -> None:
        self.loop = loop
        self.start_ms = start_ms

    def now_ms(self) -> int:
        return self.start_ms + int(self.loop.time() * 1000)

    def monotonic_ms(self) -> float:
        return self.loop.time() * 1000


@dataclass(frozen=True, slots=True)
class Unit:
    queue_offset: int
    commitlog_offset: int
    size: int
    tags_code: int


@dataclass
class Proposal:
    term: int
    messages: list[NewMessage]
    expect: dict[str, Any]
    updates: dict[str, Any]
    store_ms: int
    future: Future[BatchOutcome]


@dataclass
class Delivery:
    msg_id: str
    topic: str
    store_ms: int
    applied_ms: int


class _CommitLog:
    min_offset = 0


class FakeStore:
    """Replicated state of the fake: kv, the schedule topic, and what was delivered."""

    def __init__(self, levels: DelayLevelTable) -> None:
        self.levels = levels
        self.kv: dict[str, Any] = {}
        self.commitlog = _CommitLog()
        self.records: list[bytes] = []
        self.units: dict[int, list[Unit]] = {lv - 1: [] for lv in levels.levels()}
        self.delivered: list[Delivery] = []

    def max_offset(self, topic: str, queue_id: int) -> int:
        assert topic == SCHEDULE_TOPIC
        return len(self.units[queue_id])

    def read_units(self, topic: str, queue_id: int, offset: int, limit: int) -> list[Unit]:
        assert topic == SCHEDULE_TOPIC
        return self.units[queue_id][offset : offset + limit]

    def read_record(self, offset: int, size: int) -> bytes:
        data = self.records[offset]
        assert len(data) == size
        return data

    def queue_count(self, topic: str) -> int | None:
        if topic == REAL_TOPIC:
            return REAL_QUEUES
        if topic == SCHEDULE_TOPIC:
            return len(self.units)
        return None

    def store_delayed(self, msg_id: bytes, level: int, queue: int, now_ms: int) -> int:
        """A committed produce of a delay-level message; returns its due time."""
        placement = place(REAL_TOPIC, queue, level, {}, self.levels)
        due_ms = placement.deliver_ms(now_ms)
        data = bytes(
            record.encode(
                topic=placement.topic,
                queue_id=placement.queue_id,
                msg_id=msg_id,
                body=b"x",
                properties=placement.properties,
                born_ms=now_ms,
                store_ms=now_ms,
                tags_code=due_ms,
            )
        )
        units = self.units[placement.queue_id]
        units.append(Unit(len(units), len(self.records), len(data), due_ms))
        self.records.append(data)
        return due_ms

    def apply(self, p: Proposal, now_ms: int) -> BatchOutcome:
        """Apply one command the way the real store does: all or nothing on its condition."""
        for key, want in p.expect.items():
            have = self.kv.get(key)
            if have != want:
                return BatchOutcome(
                    "k", CONDITION_FAILED, detail=f"{key} is {have!r}, expected {want!r}"
                )
        for m in p.messages:
            assert m.msg_id is not None
            self.delivered.append(
                Delivery(record.msg_id_hex(m.msg_id), m.topic, p.store_ms, now_ms)
            )
        self.kv.update(p.updates)
        return BatchOutcome("k", OK)


@dataclass
class FakeRaftLog:
    """One node of a fake Raft group: it leads or follows; the test decides what commits."""

    clock: VirtualClock
    store: FakeStore
    term: int = 1
    leading: bool = False
    pending: list[Proposal] = field(default_factory=list)
    unknown: list[Proposal] = field(default_factory=list)
    """Proposals failed with an unknown outcome at a loss: the next leader may commit them."""
    forwarded: list[Proposal] = field(default_factory=list)
    """Proposals that reached the next leader as this node stepped down (pysyncobj forwards a
    command a former leader still sends): committed during the next term, among its own."""
    listeners: list[Callable[[bool, int], None]] = field(default_factory=list)
    check_proposal: Callable[[], str | None] = lambda: None
    """Called at every proposal; a non-None answer is recorded as a violation."""
    violations: list[str] = field(default_factory=list)
    proposals: int = 0

    # ------------------------------------------------------------------ RaftLog surface

    @property
    def is_leader(self) -> bool:
        return self.leading

    @property
    def leader_term(self) -> int | None:
        return self.term if self.leading else None

    def add_leader_listener(self, fn: Callable[[bool, int], None]) -> None:
        self.listeners.append(fn)

    def append(
        self,
        messages: list[NewMessage],
        *,
        expect: dict[str, Any] | None = None,
        updates: dict[str, Any] | None = None,
        store_ms: int | None = None,
    ) -> Future[BatchOutcome]:
        if not self.leading:
            self.violations.append(f"proposed while following (term {self.term})")
            raise NotLeader("this node is not the leader")
        problem = self.check_proposal()
        if problem is not None:
            self.violations.append(problem)
        self.proposals += 1
        fut: Future[BatchOutcome] = Future()
        self.pending.append(
            Proposal(
                self.term,
                list(messages),
                dict(expect or {}),
                dict(updates or {}),
                self.clock.now_ms() if store_ms is None else store_ms,
                fut,
            )
        )
        return fut

    def update(
        self, updates: dict[str, Any], *, expect: dict[str, Any] | None = None
    ) -> Future[BatchOutcome]:
        return self.append([], expect=expect, updates=updates)

    # ------------------------------------------------------------------ the test's levers

    def _resolve(self, p: Proposal) -> None:
        """Apply ``p`` and complete its future as the group committer does: a failed
        ``expect`` is a :class:`ConditionFailed`."""
        outcome = self.store.apply(p, self.clock.now_ms())
        if p.future.done():
            return
        if outcome.status == CONDITION_FAILED:
            p.future.set_exception(ConditionFailed(outcome.detail))
        else:
            p.future.set_result(outcome)

    def commit(self, count: int, rng: random.Random | None = None) -> None:
        for _ in range(min(count, len(self.pending))):
            if self.forwarded and rng is not None and rng.random() < 0.3:
                self.store.apply(self.forwarded.pop(0), self.clock.now_ms())
            self._resolve(self.pending.pop(0))

    def _fire(self, leader: bool, term: int) -> None:
        for fn in list(self.listeners):
            fn(leader, term)

    def lose(self, rng: random.Random) -> None:
        """Leadership lost: each proposal in flight commits right now (racing the loss), is
        refused, or ends with an unknown outcome (committed or not by the next leader); the
        listeners hear of the loss before or after the futures complete."""
        self.leading = False
        pending, self.pending = self.pending, []

        def settle() -> None:
            for p in pending:
                roll = rng.random()
                if roll < 0.35:
                    self._resolve(p)
                elif roll < 0.6:
                    p.future.set_exception(NotLeader("leadership lost; the write was not proposed"))
                else:
                    (self.unknown if roll < 0.85 else self.forwarded).append(p)
                    p.future.set_exception(
                        CommitOutcomeUnknown("leadership lost after the write was proposed")
                    )

        if rng.random() < 0.5:
            settle()
            self._fire(False, self.term)
        else:
            self._fire(False, self.term)
            settle()

    def gain(self, rng: random.Random) -> None:
        """Confirmed leader of a later term: what the last leaders left in the log is applied
        first (the barrier of the new term commits after it)."""
        for p in self.unknown:
            if rng.random() < 0.5:
                self.store.apply(p, self.clock.now_ms())
        self.unknown = []
        self.term += rng.choice([1, 1, 2, 5])
        self.leading = True
        self._fire(True, self.term)
