"""Raft pre-vote and leader stickiness, without I/O (Raft thesis sections 4.2.3 and 9.6).

A follower whose election timer fires does not raise its term at once. It first asks every
other member whether it *would* vote for it at ``term + 1`` (a ``pre_vote`` message carrying
the proposed term and the candidate's last log entry); only with a majority of yes, itself
counted, does it start the real election. A member answers no when

* it heard from a live leader less than the stickiness window ago (the minimum election
  timeout, less one heartbeat period of slack), or leads itself;
* the candidate's log is behind its own (last term lower, or same term and shorter);
* the proposed term is lower than its own.

Neither side changes its term or its vote for a pre-vote. A node that cannot win (cut off,
or removed from the cluster and not told yet) therefore keeps its term, and does not force
an election when it comes back.

Leader stickiness also applies to the real ``request_vote``: a member that heard from a
live leader within the window ignores it (does not even adopt its term). An election started
by a leadership transfer (pysyncobj's ``timeout_now``) skips pre-vote and its
``request_vote`` carries ``"transfer": True``; voters do not apply stickiness to it (the
current leader asked for it), section 3.10.

Messages (dicts on the authenticated Raft wire, as pysyncobj's own)::

    {"type": "pre_vote", "term": proposed, "last_log_index": i, "last_log_term": t}
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

    def leader_is_live(self, now_s: float) -> bool:
        if self.leads:
            return True
        return self.leader_heard_s is not None and now_s - self.leader_heard_s < self.stickiness_s


def prevote_refusal(
    voter: VoterState,
    now_s: float,
    proposed_term: int,
    candidate_log: LogPosition,
) -> str | None:
    """Why ``voter`` would not vote for a candidate at ``proposed_term``; None: it would."""
    if proposed_term < voter.current_term:
        return f"term {proposed_term} is behind this member's {voter.current_term}"
    if voter.leader_is_live(now_s):
        return "this member hears from a live leader"
    if not candidate_log.at_least(voter.last_log):
        return (
            f"the candidate's log (term {candidate_log.term}, index {candidate_log.index}) is "
            f"behind this member's (term {voter.last_log.term}, index {voter.last_log.index})"
        )
    return None


def ignores_vote_request(voter: VoterState, now_s: float, *, transfer: bool) -> bool:
    """Leader stickiness on a real ``request_vote``: True to drop it unanswered, term kept."""
    return not transfer and voter.leader_is_live(now_s)


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
