"""Pre-vote and leader stickiness (Raft thesis 4.2.3, 9.6): the decision core, then the
hooks in :class:`ReplicatedLog` driven message by message with a fake transport."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pysyncobj.monotonic import monotonic
from pysyncobj.transport import TCPNode

from chronomq.raftlog import machine as machine_module
from chronomq.raftlog import machine_campaign as campaign_module
from chronomq.raftlog.config import RaftConfig, RaftPeer
from chronomq.raftlog.machine import ReplicatedLog
from chronomq.raftlog.prevote import (
    LeaderWatch,
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


# ---------------------------------------------------------------------- a leader's connection closed


def test_a_fast_prevote_is_granted_only_by_a_member_that_lost_the_leader_too() -> None:
    connected = VoterState(5, LogPosition(5, 100), False, 10.0, 0.95, leader_connected=True)
    lost = VoterState(5, LogPosition(5, 100), False, 10.0, 0.95, leader_connected=False)
    leader = VoterState(5, LogPosition(5, 100), True, None, 0.95, leader_connected=True)
    at = 10.02  # the leader was heard 20 ms ago by both
    assert prevote_refusal(connected, at, 6, LogPosition(5, 100), leader_lost=True) is not None
    assert prevote_refusal(lost, at, 6, LogPosition(5, 100), leader_lost=True) is None
    assert prevote_refusal(leader, at, 6, LogPosition(5, 100), leader_lost=True) is not None
    # Without the mark, the lost connection changes nothing: stickiness holds.
    assert prevote_refusal(lost, at, 6, LogPosition(5, 100)) is not None
    # The log check still applies.
    assert prevote_refusal(lost, at, 6, LogPosition(5, 99), leader_lost=True) is not None
    assert ignores_vote_request(connected, at, transfer=False, leader_lost=True)
    assert not ignores_vote_request(lost, at, transfer=False, leader_lost=True)
    assert ignores_vote_request(lost, at, transfer=False)


def test_the_watch_waits_a_window_and_asks_again_each_window() -> None:
    watch = LeaderWatch(0.1)
    assert not watch.due(0.0, leader_connected=False)  # no leader lost
    watch.closed(1.0, jitter_s=0.03)
    assert not watch.due(1.125, leader_connected=False)
    assert watch.due(1.135, leader_connected=False)
    assert not watch.due(1.135, leader_connected=True)  # it came back
    watch.round_started(1.135)
    assert not watch.due(1.2, leader_connected=False)
    assert watch.due(1.24, leader_connected=False)
    watch.granted_another(1.24)  # another asked: let it go first
    assert not watch.due(1.3, leader_connected=False)
    assert watch.due(1.35, leader_connected=False)
    watch.heard()
    assert not watch.due(9.0, leader_connected=False)
    off = LeaderWatch(0.0)
    off.closed(1.0, jitter_s=0.0)
    assert not off.due(9.0, leader_connected=False)


@pytest.mark.parametrize("seed", range(20))
def test_a_closed_connection_never_deposes_a_live_leader(seed: int) -> None:
    """Three members on a fake clock and a fake network with random delays: leader L is live
    and sends heartbeats to B, its connection to A is down. A asks for fast pre-votes each
    window for 10 s (simulated); it never gets a majority, whatever the delays."""
    rng = random.Random(seed)
    window, stickiness, heartbeat = 0.1, 0.95, 0.05
    now = 0.0
    b_heard = 0.0
    a_watch = LeaderWatch(window)
    a_watch.closed(now, rng.uniform(0, window))
    leader = VoterState(5, LogPosition(5, 100), True, None, stickiness)
    rounds = 0
    next_heartbeat = 0.0
    in_flight: list[tuple[float, str]] = []  # (arrives at, to whom) of A's pre-votes
    while now < 10.0:
        if now >= next_heartbeat:
            # B hears L after a random delay under the window, never later than stickiness.
            b_heard = now + rng.uniform(0, 0.04)
            next_heartbeat = now + heartbeat
        if a_watch.due(now, leader_connected=False):
            a_watch.round_started(now)
            rounds += 1
            rnd = PreVoteRound(6, frozenset({"L", "B"}), expires_s=a_watch.next_s)
            in_flight = [(now + rng.uniform(0, 0.2), "L"), (now + rng.uniform(0, 0.2), "B")]
            for arrives, who in sorted(in_flight):
                if who == "L":
                    refusal = prevote_refusal(
                        leader, arrives, 6, LogPosition(5, 100), leader_lost=True
                    )
                else:
                    b = VoterState(5, LogPosition(5, 100), False, min(b_heard, arrives), stickiness)
                    refusal = prevote_refusal(b, arrives, 6, LogPosition(5, 100), leader_lost=True)
                rnd.record(who, 6, refusal is None)
            assert not rnd.won, f"seed {seed}: a live leader lost a pre-vote at {now:.2f} s"
        now += rng.uniform(0.001, 0.02)
    assert rounds >= 10, f"seed {seed}: only {rounds} fast rounds in 10 s"


class FakeClock:
    def __init__(self) -> None:
        self.now = monotonic()

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(machine_module, "_pso_monotonic", fake)
    monkeypatch.setattr(campaign_module, "_pso_monotonic", fake)
    return fake


def _lose_leader(machine: ReplicatedLog) -> tuple[TCPNode, TCPNode, int]:
    """``machine`` follows its first peer, whose connection then closes: that leader, the
    other peer and the term."""
    leader, other = _peers(machine)
    term = machine.raftCurrentTerm
    _follow(machine, leader)
    machine._SyncObj__onNodeDisconnected(leader)
    return leader, other, term


def _marked(kind: str, term: int) -> dict[str, Any]:
    """A ``pre_vote`` or ``request_vote`` of a candidate that lost the leader's connection."""
    return {
        "type": kind,
        "term": term,
        "last_log_index": 99,
        "last_log_term": 99,
        "leader_lost": True,
    }


def _follow(machine: ReplicatedLog, leader: TCPNode) -> None:
    """``machine`` connected to ``leader`` and taking its heartbeats; no timer of its own."""
    machine._SyncObj__connectedNodes.add(leader)
    machine._SyncObj__onMessageReceived(
        leader, {"type": "append_entries", "term": machine.raftCurrentTerm, "commit_index": 0}
    )
    machine._SyncObj__raftElectionDeadline = float("inf")  # (an append re-arms it)


def test_a_closed_leader_connection_starts_a_marked_election_at_once(
    member: tuple[ReplicatedLog, FakeWire], clock: FakeClock
) -> None:
    machine, wire = member
    leader, other, term = _lose_leader(machine)
    machine._onTick(0.0)
    assert not wire.of("pre_vote")  # not before the window
    clock.now += 0.2 + 0.001  # the window and its largest random part
    machine._onTick(0.0)
    prevotes = wire.of("pre_vote")
    assert len(prevotes) == 2 and all(m["leader_lost"] is True for _, m in prevotes)
    assert machine._SyncObj__raftElectionDeadline == float("inf")  # the timer is left alone
    machine._SyncObj__onMessageReceived(
        other, {"type": "pre_vote_response", "term": term + 1, "granted": True}
    )
    machine._onTick(0.0)
    assert machine.raftCurrentTerm == term + 1
    votes = wire.of("request_vote")
    assert len(votes) == 2 and all(m["leader_lost"] is True for _, m in votes)
    assert machine.campaign == (term + 1, "connection_closed")


def test_a_refused_fast_prevote_is_asked_again_a_window_later(
    member: tuple[ReplicatedLog, FakeWire], clock: FakeClock
) -> None:
    machine, wire = member
    leader, other, term = _lose_leader(machine)
    clock.now += 0.201
    machine._onTick(0.0)
    for node in (leader, other):
        machine._SyncObj__onMessageReceived(
            node, {"type": "pre_vote_response", "term": term + 1, "granted": False}
        )
    machine._onTick(0.0)
    assert machine.raftCurrentTerm == term and len(wire.of("pre_vote")) == 2
    clock.now += 0.101
    machine._onTick(0.0)
    assert len(wire.of("pre_vote")) == 4
    # The leader is heard again (the connection came back): no more rounds.
    _follow(machine, leader)
    clock.now += 1.0
    machine._onTick(0.0)
    assert len(wire.of("pre_vote")) == 4
    assert machine.raftCurrentTerm == term


def test_a_leader_heard_again_within_the_window_starts_nothing(
    member: tuple[ReplicatedLog, FakeWire], clock: FakeClock
) -> None:
    machine, wire = member
    leader, _other = _peers(machine)
    _follow(machine, leader)
    machine._SyncObj__onNodeDisconnected(leader)
    clock.now += 0.05
    _follow(machine, leader)
    clock.now += 1.0
    machine._onTick(0.0)
    assert not wire.of("pre_vote")


def test_a_member_still_connected_to_its_leader_refuses_the_fast_path(
    member: tuple[ReplicatedLog, FakeWire], clock: FakeClock
) -> None:
    machine, wire = member
    leader, candidate = _peers(machine)
    term = machine.raftCurrentTerm
    _follow(machine, leader)
    ask = _marked("pre_vote", term + 1)
    machine._SyncObj__onMessageReceived(candidate, ask)
    assert wire.of("pre_vote_response")[-1][1]["granted"] is False
    vote = _marked("request_vote", term + 1)
    machine._SyncObj__onMessageReceived(candidate, vote)
    assert machine.raftCurrentTerm == term and not wire.of("response_vote")
    # Its own connection to the leader closes: it grants, and holds back its own round.
    machine._SyncObj__onNodeDisconnected(leader)
    clock.now += 0.19
    machine._SyncObj__onMessageReceived(candidate, ask)
    assert wire.of("pre_vote_response")[-1][1]["granted"] is True
    clock.now += 0.05  # past its own round's latest start, within a window of the grant
    machine._onTick(0.0)
    assert not wire.of("pre_vote")  # it let the candidate go first
    machine._SyncObj__onMessageReceived(candidate, vote)
    assert machine.raftCurrentTerm == term + 1
    assert wire.of("response_vote")


def test_members_ask_in_the_order_of_their_ids(member: tuple[ReplicatedLog, FakeWire]) -> None:
    """Every member computes the same order (the lost leader left out): the first asks a
    window after the close, the next half a window later, so that they do not split the vote."""
    machine, _wire = member
    peers = _peers(machine)
    ids = sorted([machine.selfNode.id, *(p.id for p in peers)])
    for lost in peers:
        order = [i for i in ids if i != lost.id]
        rank = order.index(machine.selfNode.id)
        stagger = machine._stagger_s(lost, 0.1)
        assert 0.05 * rank <= stagger < 0.05 * rank + 0.01


def test_a_fast_candidate_not_elected_asks_again_within_a_window(
    member: tuple[ReplicatedLog, FakeWire], clock: FakeClock
) -> None:
    """Two members asked at once and split the vote: the candidate asks again (term + 2)
    a window or two later, not after an election timeout."""
    machine, wire = member
    leader, other, term = _lose_leader(machine)
    clock.now += 0.201
    machine._onTick(0.0)
    machine._SyncObj__onMessageReceived(
        other, {"type": "pre_vote_response", "term": term + 1, "granted": True}
    )
    machine._onTick(0.0)
    assert machine.raftCurrentTerm == term + 1  # a candidate; the other voted for itself
    assert len(wire.of("pre_vote")) == 2
    clock.now += 0.201  # a window and its random part
    machine._onTick(0.0)
    again = wire.of("pre_vote")[2:]
    assert len(again) == 2 and all(m["term"] == term + 2 and m["leader_lost"] for _, m in again)


def test_a_member_that_voted_in_a_fast_election_lets_it_finish(
    member: tuple[ReplicatedLog, FakeWire], clock: FakeClock
) -> None:
    machine, wire = member
    leader, candidate, term = _lose_leader(machine)
    clock.now += 0.19
    vote = _marked("request_vote", term + 1)
    machine._SyncObj__onMessageReceived(candidate, vote)
    assert machine.raftCurrentTerm == term + 1 and wire.of("response_vote")
    machine._SyncObj__raftElectionDeadline = float("inf")  # (a vote re-arms it)
    clock.now += 0.05  # past its own round's latest start, within a window of the vote
    machine._onTick(0.0)
    assert not wire.of("pre_vote")
