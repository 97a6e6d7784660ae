"""The pysyncobj state machine's own rules, driven message by message (no Raft thread)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from pysyncobj.transport import TCPNode

from raftlog.config import RaftConfig, RaftPeer
from raftlog.machine import ReplicatedLog
from raftlog.store import Store

from ._util import free_port

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
