"""The pysyncobj state machine's own rules, driven message by message (no Raft thread)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pysyncobj.pickle as pso_pickle
import pytest
from pysyncobj.transport import TCPNode

from chronomq.raftlog.config import RaftConfig, RaftPeer
from chronomq.raftlog.machine import ReplicatedLog
from chronomq.raftlog.snapshot import FetchTarget, encode_entry
from chronomq.raftlog.store import Store

from ._util import B, barrier, command, free_port

NO_OP = b"\x01"  # pysyncobj's no-op command


def _start(cfg: RaftConfig) -> ReplicatedLog:
    store = Store(Path(cfg.data_dir) / "store", segment_bytes=1 << 20)
    machine = ReplicatedLog(cfg, store, auto_tick=False)
    # These tests apply what is committed in one call. The real budget (one heartbeat period
    # per tick) is time-based: on a loaded machine it applied 5 of 20 entries and the test
    # failed. The test that checks the budget sets its own.
    machine.apply_budget_s = 60.0
    return machine


def _stop(machine: ReplicatedLog) -> None:
    machine.destroy()
    machine._store.close()


@pytest.fixture
def running() -> Iterator[list[ReplicatedLog]]:
    """Machines a test started, stopped after it."""
    machines: list[ReplicatedLog] = []
    yield machines
    for machine in machines:
        _stop(machine)


@pytest.fixture
def follower(tmp_path: Path, running: list[ReplicatedLog]) -> ReplicatedLog:
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
    machine = _start(cfg)
    running.append(machine)
    return machine


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


# ---------------------------------------------------------------------- snapshot installs

TERM = 2


def _journal_entry(machine: ReplicatedLog, data: bytes, index: int) -> tuple[bytes, int, int]:
    """The journal entry pysyncobj makes of ``_apply_cmd(data)`` at ``index``."""
    func_id = machine._methodToID[machine._getFuncName("_apply_cmd")]
    return (bytes([0]) + pso_pickle.dumps((func_id, (data,))), index, TERM)


class _Leader:
    """A leader's store and journal: the commands, applied, and their journal entries."""

    def __init__(self, store: Store, follower: ReplicatedLog, commands: list[bytes]) -> None:
        self.store = store
        # Index 1 is pysyncobj's first no-op on every node.
        self.entries: list[tuple[bytes, int, int]] = [(NO_OP, 1, 0)]
        for i, data in enumerate(commands, start=2):
            self.entries.append(_journal_entry(follower, data, i))
        self.applied = 1

    def apply_to(self, index: int) -> None:
        while self.applied < index:
            self.applied += 1
            cmd = pso_pickle.loads(self.entries[self.applied - 1][0][1:])
            self.store.apply(cmd[1][0], self.applied)

    def entry(self, index: int) -> tuple[bytes, int, int]:
        return self.entries[index - 1]

    def snapshot(self, index: int, cluster: list[str]) -> bytes:
        """The dump the leader would send, taken once it applied ``index``."""
        self.apply_to(index)
        raft = {
            "s": encode_entry(self.entry(index)),
            "s1": encode_entry(self.entry(index - 1)),
            "cluster": sorted(cluster),
        }
        return self.store.snapshot(raft)


def _append(leader: _Leader, prev: int, last: int, commit: int) -> dict[str, object]:
    return _append_entries(leader.entry(prev), leader.entries[prev:last], commit)


def _append_entries(
    prev: tuple[bytes, int, int], entries: list[tuple[bytes, int, int]], commit: int
) -> dict[str, object]:
    return {
        "type": "append_entries",
        "term": TERM,
        "commit_index": commit,
        "prevLogIdx": prev[1],
        "prevLogTerm": prev[2],
        "entries": entries,
    }


def _send_snapshot(follower: ReplicatedLog, node: TCPNode, dump: bytes, commit: int) -> None:
    """Send ``dump`` in chunks the way pysyncobj's leader does (the last one empty)."""
    chunks = [dump[i : i + 4096] for i in range(0, len(dump), 4096)] + [b""]
    for i, data in enumerate(chunks):
        message = {
            "type": "append_entries",
            "term": TERM,
            "commit_index": commit,
            "serialized": (data, i == 0, i == len(chunks) - 1),
        }
        follower._SyncObj__onMessageReceived(node, message)


def _readable(store: Store) -> dict[tuple[str, int], list[bytes]]:
    """Every message id readable through the ConsumeQueues, per queue."""
    return {
        (topic, q): [m.msg_id for m in store.read_messages(topic, q, 0, 1_000_000)]
        for topic, queues in store.topics.items()
        for q in range(len(queues))
    }


@pytest.fixture
def replies(follower: ReplicatedLog) -> list[dict[str, object]]:
    """What the follower answers its leader (its peers are not running: nothing is sent)."""
    sent: list[dict[str, object]] = []
    transport = follower._SyncObj__transport
    transport.send = lambda node, message: sent.append(message)
    return sent


@pytest.fixture
def leader(follower: ReplicatedLog, tmp_path: Path) -> Iterator[_Leader]:
    """A leader of 80 commands after the topic's creation, whose CommitLog the follower
    fetches from (a fake peer)."""
    store = Store(tmp_path / "leader", segment_bytes=follower._store.commitlog.segment_bytes)
    commands = [command([B("init", [], creates={"t": 4})])]
    for c in range(80):
        messages = [("t", (c * 3 + k) % 4, b"x" * (40 + c % 7), c * 3 + k) for k in range(3)]
        commands.append(command([B(f"b{c}", messages)]))
    leader = _Leader(store, follower, commands)

    def fetch(target: FetchTarget) -> None:
        target.write(store.commitlog.read_range(target.start, target.end))

    def peer_bytes(start: int, end: int) -> bytes | None:
        if end > store.commitlog.length:
            return None
        return store.commitlog.read_range(start, end)

    follower._fetch = fetch  # type: ignore[method-assign]
    follower._peer_bytes = peer_bytes  # type: ignore[method-assign]
    yield leader
    store.close()


def _install_from_behind(follower: ReplicatedLog, leader: _Leader) -> tuple[TCPNode, bytes]:
    """Entries to 20, then the leader's snapshot at 60, as a follower that was away receives
    them. Returns the leader's node and the snapshot it sent."""
    node = TCPNode(follower._cfg.peers[0].raft)
    cluster = [follower._cfg.raft_address, *(p.raft for p in follower._cfg.peers)]
    follower._SyncObj__onMessageReceived(node, _append(leader, 1, 20, 20))
    follower._SyncObj__applyLogEntries()
    assert follower.raftLastApplied == 20
    dump = leader.snapshot(60, cluster)
    _send_snapshot(follower, node, dump, 60)
    assert follower.raftLastApplied == 60
    return node, dump


def _past_the_snapshot(follower: ReplicatedLog, leader: _Leader) -> tuple[TCPNode, bytes]:
    """Bring the follower from behind to past the leader's snapshot at 60: entries to 20, the
    snapshot, entries to 75. Returns the leader's node and the snapshot it sent."""
    node, dump = _install_from_behind(follower, leader)
    follower._SyncObj__onMessageReceived(node, _append(leader, 60, 75, 75))
    follower._SyncObj__applyLogEntries()
    assert follower.raftLastApplied == 75
    leader.apply_to(75)
    assert _readable(follower._store) == _readable(leader.store)
    assert follower._store.digest() == leader.store.digest()
    return node, dump


def test_the_same_snapshot_again_does_not_take_back_what_a_follower_applied(
    follower: ReplicatedLog, leader: _Leader, replies: list[dict[str, object]]
) -> None:
    """A follower far behind is sent a snapshot, applies entries after it, and is sent the same
    snapshot again: its answers to append messages queued while it was away rewind the
    leader's view of it. Raft keeps the state and the log the follower has past the snapshot's
    last entry (InstallSnapshot, Raft paper section 7, step 6); rolling back to the snapshot hid
    messages this follower had already served until the leader sent the entries again.
    """
    store = follower._store
    node, dump = _past_the_snapshot(follower, leader)
    seen = _readable(store)
    digest = store.digest()

    replies.clear()
    _send_snapshot(follower, node, dump, 75)
    assert _readable(store) == seen, "messages the follower served went missing"
    assert store.digest() == digest
    assert follower.raftLastApplied == 75
    # It answers as if the snapshot ended at 75: the leader goes on from 76.
    assert replies[-1] == {
        "type": "next_node_idx",
        "next_node_idx": 76,
        "reset": False,
        "success": True,
    }
    follower._SyncObj__onMessageReceived(node, _append(leader, 75, 81, 81))
    follower._SyncObj__applyLogEntries()
    leader.apply_to(81)
    assert follower.raftLastApplied == 81
    assert store.digest() == leader.store.digest()
    assert _readable(store) == _readable(leader.store)


def test_a_kept_state_survives_a_restart(
    follower: ReplicatedLog, leader: _Leader, running: list[ReplicatedLog]
) -> None:
    """After keeping its state past a snapshot, the follower's dump and journal agree: a
    restart loads the state it kept, not the older snapshot it was sent."""
    node, dump = _past_the_snapshot(follower, leader)
    _send_snapshot(follower, node, dump, 75)
    digest = follower._store.digest()
    seen = _readable(follower._store)
    running.remove(follower)
    _stop(follower)

    again = _start(follower._cfg)
    running.append(again)
    again._onTick(0.0)  # loads the dump, then applies the journal after it
    assert again.raftLastApplied == 75
    assert again._store.digest() == digest
    assert _readable(again._store) == seen


def test_a_tail_the_cluster_never_committed_is_not_kept(
    follower: ReplicatedLog, leader: _Leader
) -> None:
    """A follower that applied entries past the snapshot that are not the leader's (what a
    former leader applying its uncommitted entries would hold) restores the snapshot, which
    replaces that tail, rather than keeping it."""
    node, dump = _install_from_behind(follower, leader)
    at_snapshot = follower._store.digest()
    rogue = [
        _journal_entry(follower, command([B(f"r{i}", [("t", 0, b"rogue", 10**6 + i)])]), i)
        for i in range(61, 76)
    ]
    follower._SyncObj__onMessageReceived(node, _append_entries(leader.entry(60), rogue, 75))
    follower._SyncObj__applyLogEntries()
    assert follower.raftLastApplied == 75
    leader.apply_to(75)
    assert follower._store.digest() != leader.store.digest()

    _send_snapshot(follower, node, dump, 75)
    assert follower.raftLastApplied == 60
    assert follower._store.digest() == at_snapshot


def _leader_seen(others: dict[str, float], state: int) -> ReplicatedLog:
    """A ReplicatedLog shell holding only what quorum_silence_s reads."""
    m = object.__new__(ReplicatedLog)
    m._SyncObj__raftState = state
    m._SyncObj__otherNodes = set(others)
    m._SyncObj__lastResponseTime = dict(others)
    return m


def test_quorum_silence_is_the_age_of_the_majoritys_latest_answer() -> None:
    from pysyncobj.monotonic import monotonic
    from pysyncobj.syncobj import _RAFT_STATE

    now = monotonic()
    # 3 members: one follower's answer makes a majority; the freshest counts.
    m = _leader_seen({"a": now - 5.0, "b": now - 0.5}, _RAFT_STATE.LEADER)
    assert 0.5 <= m.quorum_silence_s() < 1.5
    # 5 members: two followers needed; the second freshest counts.
    m = _leader_seen(
        {"a": now - 0.1, "b": now - 3.0, "c": now - 9.0, "d": now - 9.0}, _RAFT_STATE.LEADER
    )
    assert 3.0 <= m.quorum_silence_s() < 4.0
    assert _leader_seen({}, _RAFT_STATE.LEADER).quorum_silence_s() == 0.0
    assert _leader_seen({"a": now}, _RAFT_STATE.FOLLOWER).quorum_silence_s() == float("inf")
