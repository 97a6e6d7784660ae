"""When this node may start an election: pre-vote, leader stickiness and removal.

The Raft machine's (:class:`chronomq.raftlog.machine.ReplicatedLog`) part that runs on
pysyncobj's tick thread before its election timer is looked at, and on the pre-vote messages.
The decisions are :mod:`chronomq.raftlog.prevote`'s (no I/O); this mixin feeds them
pysyncobj's state and sends the answers. A node removed from the cluster
(:mod:`chronomq.raftlog.removal`) never campaigns, until a leader sends it entries again.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pysyncobj import SyncObj
from pysyncobj.monotonic import monotonic as _pso_monotonic
from pysyncobj.syncobj import _RAFT_STATE

from chronomq.raftlog import prevote
from chronomq.raftlog.config import RaftConfig
from chronomq.raftlog.prevote import LeaderWatch, LogPosition, PreVoteRound, VoterState
from chronomq.raftlog.removal import RemovalFile, RemovalNotice

# One component, one logger: these lines are the Raft machine's.
log = logging.getLogger("chronomq.raftlog.machine")

_RAFT_STATE_LEADER = _RAFT_STATE.LEADER
_RAFT_STATE_FOLLOWER = _RAFT_STATE.FOLLOWER


class CampaignHooks(SyncObj):
    """Pre-vote, leader stickiness and removal, mixed into the Raft machine."""

    # pysyncobj's private state read and written here.
    _SyncObj__raftState: int
    _SyncObj__otherNodes: set[Any]
    _SyncObj__raftCurrentTerm: int
    _SyncObj__raftElectionDeadline: float
    _SyncObj__raftLeader: Any
    _SyncObj__transport: Any
    _SyncObj__connectedNodes: set[Any]
    # The machine's.
    _cfg: RaftConfig
    _transfer_election_term: int | None

    def _init_campaign(self, config: RaftConfig, raft_dir: Path) -> None:
        """Called by the machine before pysyncobj starts."""
        self._removal_file = RemovalFile(raft_dir)
        self.removal: RemovalNotice | None = self._removal_file.load()
        self.on_removal_changed: Callable[[RemovalNotice | None], None] | None = None
        self._leader_heard_s: float | None = None
        self._prevote: PreVoteRound | None = None
        self._election_allowed_term: int | None = None  # pre-vote won from this term
        self._stickiness_s = prevote.stickiness_s(
            config.raft_min_timeout_ms / 1000, config.append_entries_period_ms / 1000
        )
        self.prevotes_started = 0
        self.prevotes_won = 0
        self.votes_ignored = 0
        # The fast path: a leader whose connection closed (prevote.LeaderWatch).
        self._leader_node: Any = None  # the member whose appends this node last took
        self._watch = LeaderWatch(config.raft_leader_lost_ms / 1000)
        self._prevote_fast = False  # the round in self._prevote is a fast one
        self._fast_election_term: int | None = None  # a fast pre-vote won from this term
        self.fast_prevotes_started = 0
        #: Why this node last started an election: (the election's term, "connection_closed"
        #: | "timeout" | "transfer"); None before its first.
        self.campaign: tuple[int, str] | None = None
        if self.removal is not None:
            log.warning(
                "this node was removed from the cluster (%s): it does not campaign and answers "
                "410 removed_from_cluster until an operator adds it back",
                self.removal.describe(),
            )

    # ------------------------------------------------------------------ the leader's connection

    def _SyncObj__onNodeDisconnected(self, node: Any) -> None:  # noqa: N802 - pysyncobj's name
        super()._SyncObj__onNodeDisconnected(node)
        if node is None or node != self._leader_node:
            return
        if self._SyncObj__raftState == _RAFT_STATE_LEADER or self.removal is not None:
            return
        window = self._watch.window_s
        if window <= 0 or self._watch.lost_s is not None:
            return
        self._watch.closed(_pso_monotonic(), self._stagger_s(node, window))
        log.info(
            "the connection to leader %s closed: a pre-vote follows in %.0f ms unless it is back",
            getattr(node, "id", node),
            (self._watch.next_s - _pso_monotonic()) * 1000,
        )

    def _stagger_s(self, lost: Any, window: float) -> float:
        """How much later than the window this member asks, after leader ``lost`` closed: half
        a window per member before it in the order of the members' ids (the leader left out),
        plus a little at random. Every member computes the same order, so the first asks
        alone and the others, hearing it, hold back (:meth:`LeaderWatch.granted_another`);
        two that asked at once would split the vote and wait out an election timeout."""
        ids = sorted(
            n.id for n in (self.selfNode, *self._SyncObj__otherNodes) if n is not None and n != lost
        )
        rank = ids.index(self.selfNode.id) if self.selfNode.id in ids else len(ids)
        return window * rank / 2 + random.uniform(0, window / 10)  # noqa: S311 - not a secret

    def _heard_leader(self, node: Any) -> None:
        """An append from ``node`` at this node's term or later: it leads (Raft thread)."""
        self._leader_node = node
        self._watch.heard()

    def _fast_round_due(self, now: float) -> bool:
        node = self._leader_node
        return (
            node is not None
            and self._transfer_election_term is None
            and self._watch.due(now, node in self._SyncObj__connectedNodes)
        )

    # ------------------------------------------------------------------ pre-vote

    def _campaign_gate(self) -> None:
        """Before pysyncobj's tick looks at the election timer: let an election start only
        after a won pre-vote or for a leadership transfer, and never on a removed node.

        pysyncobj starts an election (term + 1) when the timer has fired and it is connected
        to anyone. Here, when the timer has fired, a pre-vote round is sent instead and the
        timer re-armed; the round's majority of yes re-fires it (:meth:`_on_prevote_answer`)
        for this term only.
        """
        if self._SyncObj__raftState == _RAFT_STATE_LEADER:
            self._prevote = None
            self._watch.heard()
            return
        now = _pso_monotonic()
        if self.removal is not None:
            self._SyncObj__raftElectionDeadline = now + self._cfg.raft_max_timeout_ms / 1000
            self._SyncObj__raftLeader = None
            return
        fast = self._fast_round_due(now)
        if self._SyncObj__raftElectionDeadline >= now and not fast:
            return
        term = self._SyncObj__raftCurrentTerm
        if self._transfer_election_term is not None:
            # TimeoutNow from the leader: no pre-vote, and the request_vote carries the
            # transfer mark (the tick sets it) so that voters ignore leader stickiness.
            return
        if self._election_allowed_term == term:
            return  # pre-vote won: pysyncobj's tick starts the election
        if not self._SyncObj__connectedToAnyone():
            return  # pysyncobj would not start one either
        others = list(self._SyncObj__otherNodes)
        if not others:
            self._election_allowed_term = term
            return
        if fast and self._SyncObj__raftElectionDeadline >= now:
            # The leader's connection closed and it has not come back: ask now, and again
            # each window while it stays lost; the election timer stays armed meanwhile.
            self._watch.round_started(now)
            expires = self._watch.next_s
            self.fast_prevotes_started += 1
        else:
            self._SyncObj__raftElectionDeadline = now + self._SyncObj__generateRaftTimeout()
            # The leader went silent for an election timeout: forget it, as an election would.
            self._SyncObj__raftLeader = None
            expires = self._SyncObj__raftElectionDeadline
            fast = False
        self._prevote = PreVoteRound(
            term + 1,
            frozenset(n.id for n in others),
            expires_s=expires,
        )
        self._prevote_fast = fast
        self.prevotes_started += 1
        message: dict[str, Any] = {
            "type": prevote.PRE_VOTE,
            "term": term + 1,
            "last_log_index": self._SyncObj__getCurrentLogIndex(),
            "last_log_term": self._SyncObj__getCurrentLogTerm(),
        }
        if fast:
            message["leader_lost"] = True
        for node in others:
            self._SyncObj__transport.send(node, message)

    def _voter_state(self) -> VoterState:
        leader = self._leader_node
        return VoterState(
            current_term=self._SyncObj__raftCurrentTerm,
            last_log=LogPosition(
                self._SyncObj__getCurrentLogTerm(), self._SyncObj__getCurrentLogIndex()
            ),
            leads=self._SyncObj__raftState == _RAFT_STATE_LEADER,
            leader_heard_s=self._leader_heard_s,
            stickiness_s=self._stickiness_s,
            leader_connected=leader is None or leader in self._SyncObj__connectedNodes,
        )

    def _on_prevote(self, node: Any, message: dict[str, Any]) -> None:
        term = message.get("term")
        index = message.get("last_log_index")
        last_term = message.get("last_log_term")
        if not all(
            isinstance(v, int) and not isinstance(v, bool) for v in (term, index, last_term)
        ):
            return
        assert isinstance(term, int) and isinstance(index, int) and isinstance(last_term, int)
        leader_lost = message.get("leader_lost") is True
        now = _pso_monotonic()
        refusal = (
            "this node was removed from the cluster"
            if self.removal is not None
            else prevote.prevote_refusal(
                self._voter_state(),
                now,
                term,
                LogPosition(last_term, index),
                leader_lost=leader_lost,
            )
        )
        if refusal is not None:
            log.debug("pre-vote for term %d from %s refused: %s", term, node.id, refusal)
        elif leader_lost:
            self._watch.granted_another(now)
        self._SyncObj__transport.send(
            node, {"type": prevote.PRE_VOTE_RESPONSE, "term": term, "granted": refusal is None}
        )

    def _on_prevote_answer(self, node: Any, message: dict[str, Any]) -> None:
        rnd = self._prevote
        if rnd is None or self._SyncObj__raftState == _RAFT_STATE_LEADER:
            return
        term = self._SyncObj__raftCurrentTerm
        if rnd.proposed_term != term + 1 or rnd.expired(_pso_monotonic()):
            self._prevote = None
            return
        answer_term = message.get("term")
        if not isinstance(answer_term, int):
            return
        rnd.record(node.id, answer_term, message.get("granted") is True)
        if rnd.won:
            self._prevote = None
            self.prevotes_won += 1
            self._election_allowed_term = term
            self._fast_election_term = term if self._prevote_fast else None
            self._SyncObj__raftElectionDeadline = 0

    def _ignores_vote_request(self, message: dict[str, Any]) -> bool:
        if self.removal is not None:
            return True
        now = _pso_monotonic()
        leader_lost = message.get("leader_lost") is True
        ignore = prevote.ignores_vote_request(
            self._voter_state(),
            now,
            transfer=message.get("transfer") is True,
            leader_lost=leader_lost,
        )
        if ignore:
            self.votes_ignored += 1
        elif leader_lost:
            self._watch.granted_another(now)  # its election is under way: let it finish
        return ignore

    def _vote_fields(self) -> dict[str, Any] | None:
        """The mark of the ``request_vote`` messages this tick's election would send."""
        if self._transfer_election_term is not None:
            return {"transfer": True}
        if self._fast_election_term == self._SyncObj__raftCurrentTerm:
            return {"leader_lost": True}
        return None

    def _after_tick(self, term_before: int, fields: dict[str, Any] | None) -> None:
        """Note why this node started an election in this tick, if it did."""
        term = self._SyncObj__raftCurrentTerm
        if term == term_before or self._SyncObj__raftState == _RAFT_STATE_FOLLOWER:
            return  # no election of this node's: another's term was adopted, or nothing
        if fields is not None and fields.get("transfer"):
            cause = "transfer"
        elif fields is not None and fields.get("leader_lost"):
            cause = "connection_closed"
        else:
            cause = "timeout"
        self.campaign = (term, cause)
        self._fast_election_term = None
        if cause == "connection_closed" and self._SyncObj__raftState != _RAFT_STATE_LEADER:
            # Another member may have asked at the same instant and split the vote: unless a
            # leader is heard first, ask again a window (and a random part of one) from now
            # rather than after an election timeout.
            now = _pso_monotonic()
            self._watch.round_started(now)
            self._watch.next_s += random.uniform(0, self._watch.window_s)  # noqa: S311
        else:
            self._watch.heard()
        log.info("election for term %d started (%s)", term, cause.replace("_", " "))

    # ------------------------------------------------------------------ removal

    def mark_removed(self, notice: RemovalNotice) -> bool:
        """Record that this node was removed (any thread); False if it already knew."""
        if self.removal is not None:
            return False
        self._removal_file.save(notice)
        self.removal = notice
        log.warning(
            "this node was removed from the cluster (%s): it stops campaigning and answers "
            "410 removed_from_cluster until an operator adds it back",
            notice.describe(),
        )
        if self.on_removal_changed is not None:
            self.on_removal_changed(notice)
        return True

    def _readmitted(self, node: Any) -> None:
        """A leader sends this removed node entries: it is a member again."""
        notice = self.removal
        if notice is None:
            return
        self.removal = None
        try:
            self._removal_file.clear()
        except OSError as exc:
            log.error("could not delete %s: %s", self._removal_file.path, exc)
        log.info(
            "this node was added back to the cluster: leader %s sends it entries (it had been %s)",
            getattr(node, "id", node),
            notice.describe(),
        )
        if self.on_removal_changed is not None:
            self.on_removal_changed(None)
