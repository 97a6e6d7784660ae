"""Raft pre-vote and leader stickiness, without I/O (Raft thesis sections 4.2.3 and 9.6).

A follower whose election timer fires does not raise its term at once. It first asks every
other member whether it *would* vote for it at ``term + 1`` (a ``pre_vote`` message carrying
the proposed term and the candidate's last log entry); only with a majority of yes, itself
counted, does it start the real election. A member answers no when

* it heard from a live leader less than the stickiness window ago (the minimum election
  timeout, less one heartbeat period of slack), or leads itself;
* the candidate's log is behind its own (last term lower, or same term and shorter);
* the proposed term is lower than its own.

**A leader whose connection closed** (its process died: the kernel closes its sockets at once)
need not be waited for an election timeout. A follower whose connection to its leader closed,
and that heard nothing from it since, for :attr:`LeaderWatch.window_s` (plus half a window per
member before it in the order of the members' ids, and a little at random, so that one asks
first and the others hear it), sends a pre-vote marked ``"leader_lost": True`` at once, and
again each window while the leader stays lost, until its election timer takes over. A
candidate of such an election that is not elected within a window (two asked at once and split
the vote) asks again, not after an election timeout. A member grants such a pre-vote only when *it* does not hear that leader either: its
own connection to it is down, or the leader has been silent for the stickiness window (as for
any pre-vote). A member still connected to a leader it heard within the window refuses, and the
leader refuses (it leads): a closed connection between one follower and a live leader never
deposes it. The election that follows is marked ``"leader_lost": True`` too, and voters apply
the same rule to it. A member that grants such a pre-vote or vote holds back its own for a
window (the asker will most likely win; two candidates at once would split the vote).

Neither side changes its term or its vote for a pre-vote. A node that cannot win (cut off,
or removed from the cluster and not told yet) therefore keeps its term, and does not force
an election when it comes back.

Leader stickiness also applies to the real ``request_vote``: a member that heard from a
live leader within the window ignores it (does not even adopt its term). An election started
by a leadership transfer (pysyncobj's ``timeout_now``) skips pre-vote and its
``request_vote`` carries ``"transfer": True``; voters do not apply stickiness to it (the
current leader asked for it), section 3.10.

Messages (dicts on the authenticated Raft wire, as pysyncobj's own)::

    {"type": "pre_vote", "term": proposed, "last_log_index": i, "last_log_term": t,
     "leader_lost": bool}  # the last field only on a fast pre-vote
    {"type": "pre_vote_response", "term": proposed, "granted": bool}

Every member runs this: nodes of different versions do not form a cluster (the Raft hello
refuses a peer of another wire version, :mod:`chronomq.raftlog.wireproto`). Everything here
takes ``now_s`` as an argument.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PRE_VOTE = "pre_vote"
PRE_VOTE_RESPONSE = "pre_vote_response"


@dataclass(frozen=True, slots=True)
class LogPosition:
    """The last entry of a log: its term, then its index."""

    term: int
    index: int

    def at_least(self, other: LogPosition) -> bool:
        """True when a log ending here is at least as up to date as one ending at ``other``
        (section 3.6.1: the later last term wins; with equal terms, the longer log)."""
        return (self.term, self.index) >= (other.term, other.index)


@dataclass(frozen=True, slots=True)
class VoterState:
    """What a member knows when it is asked for a (pre-)vote."""

    current_term: int
    last_log: LogPosition
    leads: bool
    leader_heard_s: float | None  # monotonic time of the last message from a leader
    stickiness_s: float
    leader_connected: bool = True  # its connection to that leader is up

    def leader_is_live(self, now_s: float, *, leader_lost: bool = False) -> bool:
        """True when this member hears a live leader: it leads, or heard one within the
        stickiness window; for a candidate that lost the leader's connection
        (``leader_lost``), only while this member's own connection to it is up as well."""
        if self.leads:
            return True
        heard = self.leader_heard_s is not None and now_s - self.leader_heard_s < self.stickiness_s
        return heard and (self.leader_connected or not leader_lost)


def prevote_refusal(
    voter: VoterState,
    now_s: float,
    proposed_term: int,
    candidate_log: LogPosition,
    *,
    leader_lost: bool = False,
) -> str | None:
    """Why ``voter`` would not vote for a candidate at ``proposed_term``; None: it would.
    ``leader_lost``: the candidate's connection to the leader closed (a fast pre-vote)."""
    if proposed_term < voter.current_term:
        return f"term {proposed_term} is behind this member's {voter.current_term}"
    if voter.leader_is_live(now_s, leader_lost=leader_lost):
        return "this member hears from a live leader"
    if not candidate_log.at_least(voter.last_log):
        return (
            f"the candidate's log (term {candidate_log.term}, index {candidate_log.index}) is "
            f"behind this member's (term {voter.last_log.term}, index {voter.last_log.index})"
        )
    return None


def ignores_vote_request(
    voter: VoterState, now_s: float, *, transfer: bool, leader_lost: bool = False
) -> bool:
    """Leader stickiness on a real ``request_vote``: True to drop it unanswered, term kept."""
    return not transfer and voter.leader_is_live(now_s, leader_lost=leader_lost)


def stickiness_s(min_election_timeout_s: float, heartbeat_s: float) -> float:
    """The window after a leader's message within which a member refuses votes: the minimum
    election timeout, less a heartbeat period (the candidate may have heard that leader one
    heartbeat earlier than the voter), never below half the timeout."""
    return max(min_election_timeout_s / 2, min_election_timeout_s - heartbeat_s)


@dataclass(slots=True)
class PreVoteRound:
    """One pre-vote by this node: who was asked, who said yes, until when it counts."""

    proposed_term: int
    voters: frozenset[str]
    expires_s: float
    granted: set[str] = field(default_factory=set)
    refused: set[str] = field(default_factory=set)

    def record(self, voter: str, term: int, granted: bool) -> None:
        """An answer; ignored unless from a member asked, for this round's term."""
        if voter not in self.voters or term != self.proposed_term:
            return
        if granted:
            self.granted.add(voter)
        else:
            self.refused.add(voter)

    @property
    def won(self) -> bool:
        """A majority of the members (this node and every voter) would vote for it."""
        return len(self.granted) + 1 > (len(self.voters) + 1) / 2

    def expired(self, now_s: float) -> bool:
        return now_s >= self.expires_s


@dataclass(slots=True)
class LeaderWatch:
    """When a follower whose connection to its leader closed may start a fast pre-vote.

    :meth:`closed` when the connection to the leader closes (with a random ``jitter_s`` in
    ``[0, window_s)``), :meth:`heard` on any message from a leader; :meth:`due` says when a
    round may start: the leader still unheard and unconnected a window (plus the jitter) after
    the close, and a window after the previous round or after this member granted another's.
    """

    window_s: float
    lost_s: float | None = None  # when the leader's connection closed, None: not lost
    next_s: float = 0.0  # no round before this
    rounds: int = 0  # fast rounds started for this loss

    def closed(self, now_s: float, jitter_s: float) -> None:
        if self.window_s <= 0 or self.lost_s is not None:
            return
        self.lost_s = now_s
        self.next_s = now_s + self.window_s + jitter_s
        self.rounds = 0

    def heard(self) -> None:
        self.lost_s = None

    def due(self, now_s: float, leader_connected: bool) -> bool:
        return self.lost_s is not None and not leader_connected and now_s >= self.next_s

    def round_started(self, now_s: float) -> None:
        self.rounds += 1
        self.next_s = now_s + self.window_s

    def granted_another(self, now_s: float) -> None:
        """This member granted another's fast pre-vote: let that one go first."""
        self.next_s = max(self.next_s, now_s + self.window_s)
