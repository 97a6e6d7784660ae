"""Pop consumption on three in-process nodes with real pysyncobj, the real timer and the wall
clock: a receive, the leader stopped, an ack with a handle from before the failover, the
unacked message revived by the timer on the new leader, and the survivors' state identical."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import pytest

from chronomq.pop.core import AckStatus
from chronomq.pop.service import Popped, PopService
from chronomq.raftlog.config import RaftConfig
from chronomq.raftlog.errors import RaftLogError
from chronomq.raftlog.node import NewMessage, RaftLog
from chronomq.raftlog.store import Store
from chronomq.timer.service import TimerService
from tests.raftlog._util import free_port, trio_configs, wait_until
from tests.timer.test_service import config as timer_config

T = TypeVar("T")
SECRET = b"pop raft test secret"
INV = 2_000
# Invisible time of the messages popped before a failover or a restart: the fault (an election,
# a snapshot written and read) must fit in it with room on a loaded machine, or they are due
# again before the test looks.
ACROSS_FAULT_INV = 10_000


@dataclass
class Node:
    log: RaftLog
    timer: TimerService
    pop: PopService
    closed: bool = False

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.pop.close()
            self.timer.close()
            self.log.close()


@pytest.fixture
def trio(tmp_path: Path) -> Iterator[list[Node]]:
    nodes: list[Node] = []
    try:
        for i, cfg in enumerate(trio_configs(tmp_path)):
            log = RaftLog(cfg, extensions=("timer", "pop"))
            timer = TimerService(log, timer_config(), tmp_path / f"n{i}" / "timer")
            pop = PopService(log, SECRET, runtime=timer.runtime)
            timer.start()
            pop.start()
            nodes.append(Node(log, timer, pop))
        for n in nodes:
            problem = n.log.wait_listening(10)
            assert problem is None, problem
        yield nodes
    finally:
        for n in nodes:
            n.close()


def leader(nodes: list[Node]) -> Node | None:
    found = [n for n in nodes if not n.closed and n.log.is_leader]
    return found[0] if len(found) == 1 else None


def call(nodes: list[Node], fn: str, *args: object, timeout_s: float = 15.0) -> object:
    """Call ``PopService.fn`` on whoever leads, retrying while leadership moves."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        n = leader(nodes)
        if n is None:
            time.sleep(0.02)
            continue
        try:
            fut: Future[object] = getattr(n.pop, fn)(*args)
            return fut.result(timeout=5)
        except (RaftLogError, TimeoutError):
            time.sleep(0.02)
    raise AssertionError(f"{fn} found no leader to answer within {timeout_s} s")


def test_a_failover_keeps_invisible_messages_and_old_handles_ack(trio: list[Node]) -> None:
    wait_until(lambda: leader(trio) is not None, 15)
    first = leader(trio)
    assert first is not None
    msgs = [NewMessage("orders", f"m{i}".encode(), queue_id=0) for i in range(3)]
    first.log.append(msgs, creates={"orders": 1}).result(timeout=10)

    got = call(trio, "receive", "g1", "orders", 3, ACROSS_FAULT_INV)
    assert isinstance(got, list) and len(got) == 3
    popped: list[Popped] = got
    acks = call(trio, "ack", [popped[0].receipt_handle])
    assert [a.status for a in acks] == [AckStatus.ACKED]  # type: ignore[attr-defined]

    old = leader(trio)
    assert old is not None
    old.close()
    wait_until(lambda: leader(trio) is not None, 20)

    # The new leader hands out nothing that is invisible, and takes an old handle.
    assert call(trio, "receive", "g1", "orders", 3, INV) == []
    acks = call(trio, "ack", [popped[1].receipt_handle, popped[0].receipt_handle])
    assert [a.status for a in acks] == [  # type: ignore[attr-defined]
        AckStatus.ACKED,
        AckStatus.ALREADY_ACKED,
    ]

    # The third comes back once its invisible time passed, never before, with attempt 2.
    again: list[Popped] = []

    def revived() -> bool:
        nonlocal again
        got = call(trio, "receive", "g1", "orders", 3, INV)
        assert isinstance(got, list)
        if got:
            assert time.time() * 1000 >= popped[2].invisible_until_ms
        again = got
        return bool(got)

    wait_until(revived, 30)
    assert [(p.offset, p.delivery_attempt) for p in again] == [(popped[2].offset, 2)]
    stale = call(trio, "ack", [popped[2].receipt_handle])
    assert [a.status for a in stale] == [AckStatus.EXPIRED]  # type: ignore[attr-defined]
    done = call(trio, "ack", [again[0].receipt_handle])
    assert [a.status for a in done] == [AckStatus.ACKED]  # type: ignore[attr-defined]

    live = [n for n in trio if not n.closed]

    def same() -> bool:
        digests = {str(n.log.digest()) for n in live}
        return len(digests) == 1 and len({n.pop.machine.digest() for n in live}) == 1

    wait_until(same, 10)


def start_single(cfg: RaftConfig, root: Path) -> Node:
    log = RaftLog(cfg, extensions=("timer", "pop"))
    timer = TimerService(log, timer_config(), root / "timer")
    pop = PopService(log, SECRET, runtime=timer.runtime)
    timer.start()
    pop.start()
    return Node(log, timer, pop)


def test_a_restart_from_a_snapshot_keeps_pop_state_and_old_handles(tmp_path: Path) -> None:
    cfg = RaftConfig(
        data_dir=str(tmp_path / "n"),
        raft_address=f"127.0.0.1:{free_port()}",
        fetch_address=f"127.0.0.1:{free_port()}",
        raft_min_timeout_ms=100,
        raft_max_timeout_ms=200,
        append_entries_period_ms=20,
        log_compaction_min_entries=10,
        log_compaction_min_time_s=3600,
    )
    node = start_single(cfg, tmp_path)
    nodes = [node]
    try:
        wait_until(lambda: node.log.is_leader, 15)
        msgs = [NewMessage("orders", f"m{i}".encode(), queue_id=0) for i in range(3)]
        node.log.append(msgs, creates={"orders": 1}).result(timeout=10)
        got = call(nodes, "receive", "g1", "orders", 3, ACROSS_FAULT_INV)
        assert isinstance(got, list) and len(got) == 3
        popped: list[Popped] = got
        call(nodes, "ack", [popped[0].receipt_handle])
        # Enough commands for a snapshot past the pop.
        for _ in range(15):
            node.log.append([NewMessage("other", b"x")], creates={"other": 1}).result(10)
        snapshot = tmp_path / "n" / "raft" / "snapshot"
        wait_until(snapshot.exists, 15, "a snapshot")
        snap = Store.parse_snapshot(snapshot.read_bytes())
        assert "pop/q/g1/orders/0" in snap["kv"]
        digest = node.pop.machine.digest()
        node.close()

        node = start_single(cfg, tmp_path)
        nodes[0] = node
        wait_until(lambda: node.log.is_leader, 15)
        wait_until(lambda: node.pop.machine.digest() == digest, 15, "the pop state back")
        assert call(nodes, "receive", "g1", "orders", 3, INV) == []
        acks = call(nodes, "ack", [popped[1].receipt_handle, popped[0].receipt_handle])
        assert [a.status for a in acks] == [  # type: ignore[attr-defined]
            AckStatus.ACKED,
            AckStatus.ALREADY_ACKED,
        ]
        back: list[Popped] = []

        def revived() -> bool:
            got = call(nodes, "receive", "g1", "orders", 3, INV)
            assert isinstance(got, list)
            back.extend(got)
            return bool(got)

        wait_until(revived, 30, "the unacked message to come back")
        assert [(p.offset, p.delivery_attempt) for p in back] == [(popped[2].offset, 2)]
    finally:
        for n in nodes:
            n.close()
