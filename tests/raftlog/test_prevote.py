"""Pre-vote and leader stickiness (Raft thesis 4.2.3, 9.6): the decision core, then the
hooks in :class:`ReplicatedLog` driven message by message with a fake transport."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pysyncobj.monotonic import monotonic
from pysyncobj.transport import TCPNode

from chronomq.raftlog.config import RaftConfig, RaftPeer
from chronomq.raftlog.machine import ReplicatedLog
from chronomq.raftlog.prevote import (
    LogPosition,
    PreVoteRound,
    VoterState,
    ignores_vote_request,
    prevote_refusal,
    stickiness_s,
)
from chronomq.raftlog.removal import RemovalFile, RemovalNotice
from chronomq.raftlog.store import Store

from ._util import free_port


def voter(
    term: int = 5, log: tuple[int, int] = (5, 100), heard: float | None = None, leads: bool = False
) -> VoterState:
    return VoterState(term, LogPosition(*log), leads, heard, stickiness_s=0.95)


# ---------------------------------------------------------------------- the core


def test_a_member_that_hears_a_live_leader_refuses_a_prevote() -> None:
    """9.6 with 4.2.3: within the minimum election timeout of the leader's last message."""
    v = voter(heard=10.0)
    assert (
        prevote_refusal(v, 10.5, 6, LogPosition(5, 100)) == "this member hears from a live leader"
    )
    assert prevote_refusal(v, 11.0, 6, LogPosition(5, 100)) is None
    assert prevote_refusal(voter(leads=True), 99.0, 6, LogPosition(5, 100)) is not None


def test_a_candidate_whose_log_is_behind_is_refused() -> None:
    """3.6.1: the later last term wins; with equal terms, the longer log."""
    v = voter(log=(5, 100))
    assert prevote_refusal(v, 0.0, 6, LogPosition(5, 99)) is not None
    assert prevote_refusal(v, 0.0, 6, LogPosition(4, 500)) is not None
    assert prevote_refusal(v, 0.0, 6, LogPosition(5, 100)) is None
    assert prevote_refusal(v, 0.0, 6, LogPosition(6, 1)) is None


def test_a_proposed_term_behind_the_members_is_refused() -> None:
    assert prevote_refusal(voter(term=9), 0.0, 6, LogPosition(9, 500)) is not None


def test_stickiness_is_skipped_for_a_transfer() -> None:
    """3.10: the leader asked for the election (TimeoutNow); its vote request is heard."""
    v = voter(heard=10.0)
    assert ignores_vote_request(v, 10.1, transfer=False)
    assert not ignores_vote_request(v, 10.1, transfer=True)
    assert not ignores_vote_request(v, 20.0, transfer=False)


def test_stickiness_window_leaves_a_heartbeat_of_slack() -> None:
    assert stickiness_s(1.0, 0.05) == pytest.approx(0.95)
    assert stickiness_s(0.2, 0.15) == pytest.approx(0.1)


def test_a_round_is_won_by_a_majority_counting_the_candidate() -> None:
    five = PreVoteRound(6, frozenset({"a", "b", "c", "d"}), expires_s=10.0)
    five.record("a", 6, True)
    assert not five.won
    five.record("x", 6, True)  # not asked
    five.record("b", 5, True)  # another round's term
    five.record("c", 6, False)
    assert not five.won
    five.record("b", 6, True)
    assert five.won
    assert PreVoteRound(1, frozenset(), expires_s=0.0).won  # alone
    assert five.expired(10.0) and not five.expired(9.9)


# ---------------------------------------------------------------------- the machine


class FakeWire:
    """Records what the machine sends instead of sending it."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, dict[str, Any]]] = []

    def send(self, node: Any, message: Any) -> bool:
        self.sent.append((node.id, dict(message)))
        return True

    def of(self, kind: str) -> list[tuple[str, dict[str, Any]]]:
        return [(n, m) for n, m in self.sent if m.get("type") == kind]


@pytest.fixture
def member(tmp_path: Path) -> Iterator[tuple[ReplicatedLog, FakeWire]]:
    """A follower of a 3-node group, its peers not running; everything it sends is kept."""
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
    wire = FakeWire()
    transport = machine._SyncObj__transport
    transport.send = lambda node, message: wire.send(node, transport.marked(message))
    # pysyncobj elects only while connected to someone (its peers do not run): say it is.
    machine._SyncObj__connectedToAnyone = lambda: True
    yield machine, wire
    machine.destroy()
    store.close()


def _fire_timer(machine: ReplicatedLog) -> None:
    machine._SyncObj__raftElectionDeadline = 0
    machine._onTick(0.0)


def _peers(machine: ReplicatedLog) -> list[TCPNode]:
    return sorted(machine._SyncObj__otherNodes, key=lambda n: n.id)


def test_an_unanswered_node_keeps_its_term(member: tuple[ReplicatedLog, FakeWire]) -> None:
    """A node cut off from the others (or removed and not told) asks for pre-votes every
    election timeout and never raises its term."""
    machine, wire = member
    term = machine.raftCurrentTerm
    for _ in range(10):
        _fire_timer(machine)
    assert machine.raftCurrentTerm == term
    assert machine.status()["role"] == "follower"
    prevotes = wire.of("pre_vote")
    assert len(prevotes) == 20  # two peers, ten rounds
    assert {m["term"] for _, m in prevotes} == {term + 1}
    assert not wire.of("request_vote")


def test_a_won_prevote_starts_the_election(member: tuple[ReplicatedLog, FakeWire]) -> None:
    machine, wire = member
    term = machine.raftCurrentTerm
    _fire_timer(machine)
    first = _peers(machine)[0]
    machine._SyncObj__onMessageReceived(
        first, {"type": "pre_vote_response", "term": term + 1, "granted": True}
    )
    machine._onTick(0.0)
    assert machine.raftCurrentTerm == term + 1
    votes = wire.of("request_vote")
    assert len(votes) == 2 and all("transfer" not in m for _, m in votes)


def test_a_refused_prevote_does_not(member: tuple[ReplicatedLog, FakeWire]) -> None:
    machine, _wire = member
    term = machine.raftCurrentTerm
    _fire_timer(machine)
    for node in _peers(machine):
        machine._SyncObj__onMessageReceived(
            node, {"type": "pre_vote_response", "term": term + 1, "granted": False}
        )
    machine._onTick(0.0)
    assert machine.raftCurrentTerm == term


def test_a_member_hearing_its_leader_refuses_prevotes_and_ignores_votes(
    member: tuple[ReplicatedLog, FakeWire],
) -> None:
    machine, wire = member
    leader, candidate = _peers(machine)
    term = machine.raftCurrentTerm
    heartbeat = {"type": "append_entries", "term": term, "commit_index": 0}
    machine._SyncObj__onMessageReceived(leader, heartbeat)
    machine._SyncObj__onMessageReceived(
        candidate, {"type": "pre_vote", "term": term + 1, "last_log_index": 99, "last_log_term": 99}
    )
    assert wire.of("pre_vote_response")[-1][1] == {
        "type": "pre_vote_response",
        "term": term + 1,
        "granted": False,
    }
    vote = {"type": "request_vote", "term": term + 5, "last_log_index": 99, "last_log_term": 99}
    machine._SyncObj__onMessageReceived(candidate, vote)
    assert machine.raftCurrentTerm == term  # not even the term was taken
    assert not wire.of("response_vote")
    # A transfer's vote request is heard although the leader is live.
    machine._SyncObj__onMessageReceived(candidate, {**vote, "transfer": True})
    assert machine.raftCurrentTerm == term + 5
    assert wire.of("response_vote")


def test_a_silent_leader_lets_a_prevote_through(member: tuple[ReplicatedLog, FakeWire]) -> None:
    machine, wire = member
    _leader, candidate = _peers(machine)
    term = machine.raftCurrentTerm
    machine._leader_heard_s = monotonic() - 10
    machine._SyncObj__onMessageReceived(
        candidate, {"type": "pre_vote", "term": term + 1, "last_log_index": 99, "last_log_term": 99}
    )
    assert wire.of("pre_vote_response")[-1][1]["granted"] is True
    assert machine.raftCurrentTerm == term  # a pre-vote changes nothing


def test_an_election_after_timeout_now_skips_prevote_and_is_marked(
    member: tuple[ReplicatedLog, FakeWire],
) -> None:
    machine, wire = member
    leader = _peers(machine)[0]
    term = machine.raftCurrentTerm
    machine._SyncObj__onMessageReceived(
        leader, {"type": "append_entries", "term": term, "commit_index": 0}
    )
    machine._SyncObj__onMessageReceived(leader, {"type": "timeout_now", "term": term})
    machine._onTick(0.0)
    assert machine.raftCurrentTerm == term + 1
    assert not wire.of("pre_vote")
    votes = wire.of("request_vote")
    assert len(votes) == 2 and all(m["transfer"] is True for _, m in votes)


def test_a_removed_node_never_campaigns_until_a_leader_sends_it_entries(
    member: tuple[ReplicatedLog, FakeWire], tmp_path: Path
) -> None:
    machine, wire = member
    term = machine.raftCurrentTerm
    notice = RemovalNotice(0, machine.selfNode.id, 10, term, 1, 1)
    assert machine.mark_removed(notice)
    assert not machine.mark_removed(notice)  # once
    assert RemovalFile(tmp_path / "raft").load() == notice
    for _ in range(5):
        _fire_timer(machine)
    assert not wire.sent
    assert machine.raftCurrentTerm == term
    leader = _peers(machine)[0]
    machine._SyncObj__onMessageReceived(
        leader, {"type": "append_entries", "term": term + 3, "commit_index": 0}
    )
    assert machine.removal is None
    assert RemovalFile(tmp_path / "raft").load() is None
