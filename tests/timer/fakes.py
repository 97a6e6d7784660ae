"""An in-process Raft group for driver tests: real Stores and timer machines, one shared log of
proposed commands, a fake clock, and commits, elections and lost proposals under the test's
control. No threads, no sockets, no sleeps."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from chronomq.raftlog import command as cmdcodec
from chronomq.raftlog import record
from chronomq.raftlog.clock import FakeClock
from chronomq.raftlog.errors import NotLeader
from chronomq.raftlog.node import NewMessage
from chronomq.raftlog.store import ApplyResult, Store
from chronomq.timer import message as tm
from chronomq.timer.config import TimerConfig
from chronomq.timer.service import TimerService
from chronomq.timer.timerlog import read_records

T0 = 1_700_000_000_000


@dataclass
class Entry:
    data: bytes
    future: Future[Any] | None
    proposer: int
    term: int


class FakeRaftLog:
    """What :class:`TimerService` uses of :class:`chronomq.raftlog.node.RaftLog`, for one replica."""

    def __init__(self, group: Group, i: int, root: Path) -> None:
        self.group = group
        self.i = i
        self.root = root
        self.clock = group.clock
        self.store = Store(root / "store", segment_bytes=group.segment_bytes)
        self._leader_listeners: list[Callable[[bool, int], None]] = []

    @property
    def is_leader(self) -> bool:
        return self.group.leader == self.i

    def register_extension(self, ext: Any) -> None:
        self.store.register_extension(ext)

    def add_leader_listener(self, fn: Callable[[bool, int], None]) -> None:
        self._leader_listeners.append(fn)

    def add_apply_listener(self, fn: Callable[[ApplyResult], None]) -> None:
        self.store.listeners.append(fn)

    def _submit(self, cmd: cmdcodec.Command) -> Future[Any]:
        if not self.is_leader:
            raise NotLeader("fake: not the leader")
        fut: Future[Any] = Future()
        self.group.pending.append(Entry(cmdcodec.encode(cmd), fut, self.i, self.group.term))
        return fut

    def propose_extension(self, name: str, payload: object) -> Future[Any]:
        return self._submit(
            cmdcodec.Command(
                cmdcodec.Kind.EXTENSION, self.clock.now_ms(), extra={"e": name, "p": payload}
            )
        )

    def create_topic(self, topic: str, queues: int) -> Future[Any]:
        return self._submit(
            cmdcodec.Command(
                cmdcodec.Kind.APPEND,
                self.clock.now_ms(),
                batches=(cmdcodec.Batch(f"create-{topic}", 0, None, None, {topic: queues}),),
            )
        )

    def append(self, messages: list[NewMessage], creates: dict[str, int]) -> Future[Any]:
        """Encode messages as the leader's ``prepare`` would and propose them."""
        now = self.clock.now_ms()
        topics: list[str] = []
        metas: list[tuple[int, int, int]] = []
        parts: list[bytes] = []
        for m in messages:
            data = record.encode(
                topic=m.topic,
                queue_id=m.queue_id or 0,
                msg_id=m.msg_id or next(self.group.ids).to_bytes(16, "big"),
                body=m.body,
                properties=m.properties,
                born_ms=now,
                store_ms=now,
                tags_code=m.tags_code or 0,
            )
            if m.topic not in topics:
                topics.append(m.topic)
            metas.append((topics.index(m.topic), m.queue_id or 0, len(data)))
            parts.append(bytes(data))
        batch = cmdcodec.Batch(f"b{next(self.group.ids)}", len(messages), None, None, creates)
        return self._submit(
            cmdcodec.Command(
                cmdcodec.Kind.APPEND,
                now,
                batches=(batch,),
                topics=tuple(topics),
                messages=tuple(metas),
                blob=b"".join(parts),
            )
        )

    def fire_leader(self, leader: bool) -> None:
        for fn in self._leader_listeners:
            fn(leader, self.group.term)


class Group:
    """``n`` replicas applying one command log; replica ``leader`` proposes."""

    def __init__(
        self,
        root: Path,
        config: TimerConfig,
        *,
        n: int = 3,
        start_ms: int = T0,
        segment_bytes: int = 1 << 20,
        max_inflight: int = 4,
        on_delivered: Any = None,
    ) -> None:
        self.root = root
        self.config = config
        self.clock = FakeClock(start_ms)
        self.segment_bytes = segment_bytes
        self.pending: list[Entry] = []
        self.applied: list[bytes] = []  # every committed command, in order (for replays)
        self.index = 0
        self.term = 1
        self.leader: int | None = None
        self.ids = itertools.count(1)
        self.logs = [FakeRaftLog(self, i, root / f"r{i}") for i in range(n)]
        self.services = [
            self._service(i, max_inflight=max_inflight, on_delivered=on_delivered) for i in range(n)
        ]
        for s in self.services:
            s.register()

    def _service(self, i: int, **kw: Any) -> TimerService:
        return TimerService(
            self.logs[i],  # type: ignore[arg-type]
            self.config,
            self.root / f"r{i}" / "timer",
            peer_urls=list,
            commit_timeout_ms=60_000,
            **kw,
        )

    # ------------------------------------------------------------------ Raft

    def elect(self, i: int) -> None:
        """``i`` becomes the confirmed leader of a new term; pending proposals stay in the log
        (the test commits or drops them)."""
        old = self.leader
        self.term += 1
        self.leader = i
        if old is not None and old != i:
            self.logs[old].fire_leader(False)
        self.logs[i].fire_leader(True)

    def commit(self, count: int | None = None) -> int:
        """Apply the oldest ``count`` pending commands (all by default) on every replica."""
        n = len(self.pending) if count is None else min(count, len(self.pending))
        for _ in range(n):
            entry = self.pending.pop(0)
            self.index += 1
            results = [log.store.apply(entry.data, self.index) for log in self.logs]
            self.applied.append(entry.data)
            if entry.future is not None and not entry.future.done():
                entry.future.set_result(results[entry.proposer])
        return n

    def drop_pending(self) -> int:
        """Lose every pending proposal (a leader that lost its quorum)."""
        dropped = self.pending
        self.pending = []
        for entry in dropped:
            if entry.future is not None and not entry.future.done():
                entry.future.set_exception(NotLeader("fake: dropped"))
        return len(dropped)

    # ------------------------------------------------------------------ helpers

    @property
    def service(self) -> TimerService:
        assert self.leader is not None
        return self.services[self.leader]

    def produce(
        self, topic: str, deliver_ms: int, body: bytes = b"x", field: str = "deliver_at_ms"
    ) -> str:
        """Produce one timer message through the leader's hook; returns its msg id (hex)."""
        log = self.logs[self.leader or 0]
        extra: dict[str, Any] = {}
        value = deliver_ms if field == "deliver_at_ms" else deliver_ms - self.clock.now_ms()
        msg = self.service.produce_hook(
            topic, body, None, {}, field, value, self.clock.now_ms(), "messages[0]", extra
        )
        creates = {}
        if log.store.queue_count(topic) is None:
            creates[topic] = 4
        if log.store.queue_count(tm.TIMER_TOPIC) is None:
            creates[tm.TIMER_TOPIC] = 1
        log.append([msg], creates)
        assert msg.msg_id is not None
        return record.msg_id_hex(msg.msg_id)

    def run(self, until_ms: int, *, tick_ms: int = 7, commit_every: int = 1) -> None:
        """Advance time to ``until_ms`` in ticks, stepping the leader's driver and committing."""
        steps = 0
        while self.clock.now_ms() < until_ms:
            self.clock.set(min(until_ms, self.clock.now_ms() + tick_ms))
            self.step_leader()
            steps += 1
            if steps % commit_every == 0:
                self.commit()
        self.step_leader()
        self.commit()

    def step_leader(self, rounds: int = 8) -> None:
        """Step the leader's driver until it has nothing more to propose right now."""
        if self.leader is None:
            return
        for _ in range(rounds):
            before = len(self.pending)
            self.service.step()
            if len(self.pending) == before:
                return

    def delivered(self, topic: str, replica: int = 0) -> list[record.Message]:
        store = self.logs[replica].store
        out: list[record.Message] = []
        for q in range(store.queue_count(topic) or 0):
            out.extend(store.read_messages(topic, q, 0, 1_000_000))
        return out

    def fetcher(self, source: int) -> Callable[[int, int, Callable[[bytes], None]], None]:
        """A ``fetch`` for :class:`chronomq.timer.files.TimerFiles` reading replica ``source``'s log."""
        files = self.services[source].machine.files

        def fetch(start: int, end: int, sink: Callable[[bytes], None]) -> None:
            pos = start
            while pos < end:
                data, pos = read_records(
                    files.log.directory, files.log.segment_bytes, pos, end, 1000
                )
                sink(data)

        return fetch

    def close(self) -> None:
        for log in self.logs:
            log.store.close()
