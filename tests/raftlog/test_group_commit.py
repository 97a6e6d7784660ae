"""Group commit of the Raft journal under ``flush="sync"`` (raftlog/machine.py,
raftlog/transport.py): one fdatasync for every entry appended in a tick, and no follower
acknowledges an entry before it is synced."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import Future, wait
from pathlib import Path
from typing import Any

import pytest
from pysyncobj.transport import TCPTransport

from chronomq.raftlog.errors import NotLeader
from chronomq.raftlog.node import NewMessage, RaftLog
from chronomq.raftlog.transport import GuardedTransport

from ._util import trio_configs, wait_until


def test_acknowledgements_wait_for_the_sync_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    sent: list[tuple[Any, Any]] = []
    monkeypatch.setattr(TCPTransport, "send", lambda self, node, msg: sent.append((node, msg)))
    t = object.__new__(GuardedTransport)
    dirty = [True]
    t.ack_gate = lambda: dirty[0]
    ack5 = {"type": "next_node_idx", "next_node_idx": 5, "success": True}
    ack6 = {"type": "next_node_idx", "next_node_idx": 6, "success": True}
    vote = {"type": "response_vote", "term": 3}
    assert t.send("leader", ack5)
    t.send("candidate", vote)  # a vote does not wait (term and vote are synced when cast)
    assert sent == [("candidate", vote)]
    dirty[0] = False
    t.send("leader", ack6)  # clean now, but behind the held one
    assert sent == [("candidate", vote)]
    t.release_acks()
    assert sent == [("candidate", vote), ("leader", ack5), ("leader", ack6)]
    t.send("leader", ack6)
    assert sent[-1] == ("leader", ack6) and t.held_acks is None


@pytest.fixture
def synced_trio(tmp_path: Path) -> Iterator[list[RaftLog]]:
    nodes = [RaftLog(cfg) for cfg in trio_configs(tmp_path, flush="sync")]
    try:
        yield nodes
    finally:
        for n in nodes:
            n.close()


def test_a_follower_acknowledges_only_synced_entries_and_syncs_are_grouped(
    synced_trio: list[RaftLog], monkeypatch: pytest.MonkeyPatch
) -> None:
    unsynced_acks: list[str] = []
    acks = 0
    send = TCPTransport.send

    def checking(self: Any, node: Any, message: Any) -> Any:
        nonlocal acks
        if isinstance(message, dict) and message.get("type") == "next_node_idx":
            acks += 1
            journal = self._syncObj._journal
            if journal.dirty:
                unsynced_acks.append(f"{self._selfNode.id} acked {message}")
        return send(self, node, message)

    monkeypatch.setattr(TCPTransport, "send", checking)
    wait_until(lambda: sum(n.is_leader for n in synced_trio) == 1, 20, "a leader")
    leader = next(n for n in synced_trio if n.is_leader)
    before = {id(n): n.machine._journal.syncs for n in synced_trio}  # type: ignore[union-attr]
    futures: list[Future[Any]] = []
    for k in range(300):
        try:
            futures.append(leader.append([NewMessage("t", f"m{k}".encode())]))
        except NotLeader:
            pytest.skip("leadership moved during the test")
    done, _ = wait(futures, timeout=60)
    assert len(done) == 300 and all(f.exception() is None for f in done)
    assert acks > 0 and unsynced_acks == []
    commands = leader.machine.raftCommitIndex
    syncs = leader.machine._journal.syncs - before[id(leader)]  # type: ignore[union-attr]
    # Proposals made while a sync ran share the next one.
    assert 0 < syncs < 300, (syncs, commands)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if all(not n.machine._journal.dirty for n in synced_trio):  # type: ignore[union-attr]
            break
        time.sleep(0.01)
    assert all(not n.machine._journal.dirty for n in synced_trio)  # type: ignore[union-attr]
