"""The pysyncobj state machine's own rules, driven message by message (no Raft thread)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from pysyncobj.transport import TCPNode

from raftlog.config import RaftConfig, RaftPeer
from raftlog.machine import ReplicatedLog
from raftlog.store import Store

from ._util import B, barrier, command, free_port

NO_OP = b"\x01"  # pysyncobj's no-op command


@pytest.fixture
def follower(tmp_path: Path) -> Iterator[ReplicatedLog]:
    """A member of a 3-node group whose peers are not running: it never ticks on its own."""
    peers = tuple(
        RaftPeer(f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}") for _ in range(2)
    )
    cfg = RaftConfig(
        data_dir=str(tmp_path),
        raft_address=f"127.0.0.1:{free_port()}",
        fetch_address=f"127.0.0.1:{free_port()}",
        peers=peers,
    )
    store = Store(tmp_path / "store", segment_bytes=1 << 20)
    machine = ReplicatedLog(cfg, store, auto_tick=False)
    yield machine
    machine.destroy()
    store.close()


@pytest.fixture
def alone(tmp_path: Path) -> Iterator[ReplicatedLog]:
    """A group of one, ticked by the test: it leads at once and commits what it appends."""
    cfg = RaftConfig(
        data_dir=str(tmp_path),
        raft_address=f"127.0.0.1:{free_port()}",
        fetch_address=f"127.0.0.1:{free_port()}",
        log_compaction_min_entries=1_000_000,
        log_compaction_min_time_s=86_400,
        log_compaction_max_bytes=1 << 20,
    )
    store = Store(tmp_path / "store", segment_bytes=16 << 20)
    machine = ReplicatedLog(cfg, store, auto_tick=False)
    _tick_until(machine, machine._isLeader, "leadership")
    yield machine
    machine.destroy()
    store.close()


def _tick_until(machine: ReplicatedLog, done: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 10
    while not done():
        assert time.monotonic() < deadline, f"no {what} within 10 s"
        machine._onTick(0.0)


def _propose(machine: ReplicatedLog, commands: list[bytes]) -> None:
    """Queue ``commands`` and tick until all are committed (each tick may apply)."""
    target = machine.raftLastApplied + len(commands)
    for data in commands:
        machine._apply_cmd(data, callback=lambda *_: None)
    _tick_until(machine, lambda: machine.raftCommitIndex >= target, "commit")


def test_apply_stops_when_the_tick_budget_is_spent(alone: ReplicatedLog) -> None:
    """A tick applies committed entries only while its budget lasts, so heartbeats and the
    network are served between heavy commands; the rest is applied in the next ticks."""
    alone.apply_budget_s = 0.0  # every tick applies exactly one entry
    _propose(alone, [barrier() for _ in range(5)])
    behind = alone.raftCommitIndex - alone.raftLastApplied
    assert behind >= 2
    for _ in range(behind):
        before = alone.raftLastApplied
        alone._onTick(0.0)
        assert alone.raftLastApplied == before + 1
    assert alone.raftLastApplied == alone.raftCommitIndex
    assert alone._SyncObj__raftCommitIndex == alone.raftCommitIndex  # restored after each call


def test_large_commands_are_compacted_by_size(alone: ReplicatedLog, tmp_path: Path) -> None:
    """pysyncobj compacts after so many entries; a few large commands must be enough."""
    body = b"x" * (300 * 1024)
    create = command([B("init", [], creates={"t": 1})])
    big = [command([B(f"k{i}", [("t", 0, body, i)])]) for i in range(5)]
    _propose(alone, [create, *big])
    _tick_until(alone, lambda: (tmp_path / "raft" / "snapshot").exists(), "snapshot after 1.5 MB")
    _tick_until(alone, lambda: alone.status()["log_len"] < 5, "compaction of the log")


def _chunk(commit_index: int, *, first: bool, last: bool) -> dict[str, object]:
    return {
        "type": "append_entries",
        "term": 7,
        "commit_index": commit_index,
        "serialized": (b"part of a snapshot", first, last),
    }


def test_a_snapshot_chunk_does_not_commit_entries_the_leader_never_checked(
    follower: ReplicatedLog,
) -> None:
    """A former leader holds entries it appended while cut off (never committed). The new
    leader's snapshot chunks carry a commit index far beyond them; the follower must not
    commit, and so apply, them before the snapshot replaces its log."""
    log = follower._SyncObj__raftLog
    for index in (2, 3, 4):
        log.add(NO_OP, index, 3)
    committed = follower._SyncObj__raftCommitIndex
    assert committed < 4
    leader = TCPNode(follower._cfg.peers[0].raft)
    follower._SyncObj__onMessageReceived(leader, _chunk(1_000, first=True, last=False))
    follower._SyncObj__onMessageReceived(leader, _chunk(1_000, first=False, last=False))
    assert follower._SyncObj__raftCommitIndex == committed
    assert follower._getLeader() == leader
    assert follower.raftLastApplied == 1


def test_a_checked_append_still_moves_the_commit_index(follower: ReplicatedLog) -> None:
    log = follower._SyncObj__raftLog
    log.add(NO_OP, 2, 1)
    leader = TCPNode(follower._cfg.peers[0].raft)
    message = {
        "type": "append_entries",
        "term": 1,
        "commit_index": 3,
        "prevLogIdx": 2,
        "prevLogTerm": 1,
        "entries": [(NO_OP, 3, 1)],
    }
    follower._SyncObj__onMessageReceived(leader, message)
    assert follower._SyncObj__raftCommitIndex == 3
