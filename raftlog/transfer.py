"""Leadership transfer: hand the leadership to a caught-up member, and say whether it moved.

Raft's transfer (section 3.10 of Ongaro's thesis) has the leader bring the target up to date,
stop taking new commands, and send it TimeoutNow; the target starts an election at once and
wins it because its log is as long as anyone's. pysyncobj's ``transferLeadership`` only sends
TimeoutNow, and only when the target's matchIndex equals the leader's last index at that
instant: under load that is rarely true, and the leader goes on appending after it, so the
target's log is shorter by the time it asks for votes and the old leader wins again.

:class:`TransferCore` decides, from what the Raft thread reports each tick
(:class:`LeaderView`) and a clock in milliseconds, what to do next:

1. **catch up** (not holding anything): wait until the target is connected and within
   :data:`CATCH_UP_GAP_ENTRIES` of the leader's last index;
2. **drain**: hold the group committer (new client batches wait in its queue, unproposed)
   until the commands already proposed have committed;
3. **hand over**: hold every proposal at the Raft machine too (timer deliveries, barriers),
   and have the Raft thread send TimeoutNow the tick the target's matchIndex equals the last
   index; holding lasts at most ``hold_ms`` (the longest election timeout);
4. **watch**: the target leads at a higher term, and has committed in it: transferred. Another
   node leads: the election was lost. Still leading when the hold ends: release, and try
   again while time remains.

The driver (:func:`chronomq.raftlog.transfer_driver.transfer_leadership`) runs it on the
asyncio loop against a real :class:`chronomq.raftlog.node.RaftLog`; what the holds mean for
writers is in :meth:`chronomq.raftlog.committer.GroupCommitter.hold` and
:meth:`chronomq.raftlog.machine.ReplicatedLog.hold_proposals`. This module does no I/O and
reads no clock: the Raft machine imports its :class:`LeaderView`, and the driver imports the
machine (through the node), so the decisions and the driving live apart.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field

#: How far behind the leader's last index the target may be before proposals are held: about
#: what the group committer keeps in flight (``max_inflight_commands``), so holding lasts a
#: round trip or two, not a catch-up.
CATCH_UP_GAP_ENTRIES = 64
#: How long a target that is not connected at all is waited for before the answer is
#: "unreachable" (pysyncobj reconnects every ``connection_retry_ms``, 250 ms).
CONNECT_GRACE_MS = 2_500
#: Hand-over attempts within one request (each holds proposals at most ``hold_ms``).
MAX_ATTEMPTS = 3


class TransferOutcome(enum.Enum):
    TRANSFERRED = "transferred"  # the target leads, at a higher term
    ALREADY_LEADER = "already_leader"  # the target is this node, which leads: nothing to do
    NOT_LEADER = "not_leader"  # this node does not lead (any more)
    UNKNOWN_MEMBER = "unknown_member"  # no member has that id
    NOT_MEMBER = "target_not_member"  # a listed member that is not in the Raft group
    UNREACHABLE = "target_unreachable"  # the leader has no connection to the target
    NO_TARGET = "no_target"  # no connected follower to pick
    NOT_CAUGHT_UP = "not_caught_up"  # the target did not catch up in time
    ELECTION_LOST = "election_lost"  # TimeoutNow was sent, another node won
    TIMEOUT = "timeout"  # the leadership did not move in time
    IN_PROGRESS = "in_progress"  # another transfer is running on this node

    @property
    def moved(self) -> bool:
        return self is TransferOutcome.TRANSFERRED


@dataclass(frozen=True, slots=True)
class TransferResult:
    """What one transfer did. Addresses are Raft addresses; ids are set when a broker's
    member list knows them."""

    outcome: TransferOutcome
    message: str
    from_address: str
    target_address: str | None = None
    leader_address: str | None = None
    term: int = 0
    waited_ms: int = 0
    catch_up_ms: int | None = None  # until TimeoutNow was sent (None: it never was)
    held_ms: int = 0  # how long proposals were held, over every attempt
    attempts: int = 0
    from_id: int | None = None
    target_id: int | None = None
    leader_id: int | None = None

    @property
    def moved(self) -> bool:
        return self.outcome.moved


@dataclass(frozen=True, slots=True)
class LeaderView:
    """What the Raft thread saw at the end of one tick (see
    :meth:`chronomq.raftlog.machine.ReplicatedLog.watch_transfer`)."""

    at_s: float
    leading: bool
    term: int
    leader: str | None  # Raft address of the leader this node knows, None if none
    last_index: int
    commit_term: int  # term of the entry at the commit index
    match_index: Mapping[str, int] = field(default_factory=dict)
    connected: frozenset[str] = frozenset()
    members: frozenset[str] = frozenset()  # the other members' Raft addresses
    timeout_now_term: int | None = None  # term in which TimeoutNow was sent (since armed)


class Action(enum.Enum):
    WAIT = "wait"
    HOLD_COMMITTER = "hold_committer"  # hold new client batches
    HAND_OVER = "hand_over"  # hold every proposal and arm TimeoutNow
    RELEASE = "release"  # stop holding (the hand-over did not happen); keep going
    FINISH = "finish"  # done: see result (holds to release unless it moved)


class _Phase(enum.Enum):
    CATCH_UP = 1
    DRAIN = 2
    HAND_OVER = 3
    DONE = 4


@dataclass(frozen=True, slots=True)
class Step:
    action: Action
    result: TransferResult | None = None


class TransferCore:
    """The decisions of one transfer, fed views and the time; no I/O, no clock of its own.

    ``start_ms``: when the request began; ``deadline_ms``: when to give up; ``hold_ms``: the
    longest one hand-over may hold proposals (the election timeout).
    """

    def __init__(
        self,
        *,
        self_address: str,
        target: str,
        start_ms: int,
        timeout_ms: int,
        hold_ms: int,
        gap_entries: int = CATCH_UP_GAP_ENTRIES,
        connect_grace_ms: int = CONNECT_GRACE_MS,
        max_attempts: int = MAX_ATTEMPTS,
    ) -> None:
        self.self_address = self_address
        self.target = target
        self._start_ms = start_ms
        self._deadline_ms = start_ms + timeout_ms
        self._hold_ms = hold_ms
        self._gap = gap_entries
        self._connect_grace_ms = min(connect_grace_ms, timeout_ms)
        self._max_attempts = max_attempts
        self._phase = _Phase.CATCH_UP
        self._start_term: int | None = None
        self._hold_started_ms: int | None = None
        self._hold_until_ms = 0
        self._held_ms = 0
        self._attempts = 0
        self._sent_ms: int | None = None
        self._sent_term: int | None = None
        self._ever_connected = False
        self._last_gap: int | None = None
        self._last_now_ms = start_ms

    @property
    def holding(self) -> bool:
        return self._hold_started_ms is not None

    @property
    def phase(self) -> str:
        return self._phase.name.lower()

    def step(self, view: LeaderView | None, now_ms: int, committer_inflight: int) -> Step:
        """What to do now. ``committer_inflight``: group-commit commands proposed and not
        yet answered."""
        if now_ms < self._last_now_ms:
            raise ValueError(f"the clock went back: {now_ms} < {self._last_now_ms}")
        self._last_now_ms = now_ms
        if self._phase is _Phase.DONE:
            raise RuntimeError("the transfer is over")
        if view is None:  # the Raft thread has not reported yet
            return self._timed_out(now_ms) or Step(Action.WAIT)
        if self._start_term is None:
            self._start_term = view.term
        if view.timeout_now_term is not None and self._sent_ms is None:
            # Kept by the Raft thread until disarmed: seen even if the tick that sent it was not.
            self._sent_ms = now_ms
            self._sent_term = view.timeout_now_term
        moved = self._moved(view, now_ms)
        if moved is not None:
            return moved
        if not view.leading:
            if self._sent_term is None:
                return self._finish(
                    TransferOutcome.NOT_LEADER,
                    "this node lost the leadership before handing it over",
                    view,
                    now_ms,
                )
            return self._timed_out(now_ms, view) or Step(Action.WAIT)  # an election is on
        if self.target not in view.members:
            return self._finish(
                TransferOutcome.NOT_MEMBER,
                f"{self.target} is not a member of the Raft group",
                view,
                now_ms,
            )
        connected = self.target in view.connected
        self._ever_connected = self._ever_connected or connected
        if self._phase is _Phase.CATCH_UP:
            return self._catch_up(view, now_ms, connected)
        if self._phase is _Phase.DRAIN:
            if now_ms >= self._hold_until_ms or not connected:
                return self._release(view, now_ms)
            if committer_inflight == 0:
                self._phase = _Phase.HAND_OVER
                return Step(Action.HAND_OVER)
            return Step(Action.WAIT)
        # _Phase.HAND_OVER
        if now_ms >= self._hold_until_ms:
            return self._release(view, now_ms)
        return Step(Action.WAIT)

    # ------------------------------------------------------------------ phases

    def _catch_up(self, view: LeaderView, now_ms: int, connected: bool) -> Step:
        if not connected:
            if not self._ever_connected and now_ms - self._start_ms >= self._connect_grace_ms:
                return self._finish(
                    TransferOutcome.UNREACHABLE,
                    f"this leader has no connection to {self.target}",
                    view,
                    now_ms,
                )
            return self._timed_out(now_ms, view) or Step(Action.WAIT)
        gap = view.last_index - view.match_index.get(self.target, 0)
        self._last_gap = gap
        if gap > self._gap:
            return self._timed_out(now_ms, view) or Step(Action.WAIT)
        if self._attempts >= self._max_attempts:
            return self._timed_out(now_ms, view, force=True) or Step(Action.WAIT)
        remaining_ms = self._deadline_ms - now_ms
        if remaining_ms <= 0:
            return self._timed_out(now_ms, view, force=True) or Step(Action.WAIT)
        self._attempts += 1
        self._phase = _Phase.DRAIN
        self._hold_started_ms = now_ms
        self._hold_until_ms = now_ms + min(self._hold_ms, remaining_ms)
        return Step(Action.HOLD_COMMITTER)

    def _release(self, view: LeaderView, now_ms: int) -> Step:
        self._end_hold(now_ms)
        self._phase = _Phase.CATCH_UP
        timed_out = self._timed_out(now_ms, view)
        if timed_out is not None:
            return timed_out
        if self._attempts >= self._max_attempts:
            return self._timed_out(now_ms, view, force=True) or Step(Action.RELEASE)
        return Step(Action.RELEASE)

    def _moved(self, view: LeaderView, now_ms: int) -> Step | None:
        """The end, once the term has moved on: None while it has not (or an election is on)."""
        start_term = self._start_term if self._start_term is not None else view.term
        if view.term <= start_term:
            return None
        if view.leader == self.target and not view.leading:
            if view.commit_term < view.term and now_ms < self._deadline_ms:
                return Step(Action.WAIT)  # the new leader has not committed in its term yet
            return self._finish(
                TransferOutcome.TRANSFERRED,
                f"{self.target} leads in term {view.term}",
                view,
                now_ms,
            )
        if view.leader is None and not view.leading:
            return None  # an election is on
        winner = "this node" if view.leading else view.leader
        if self._sent_term is None:
            return self._finish(
                TransferOutcome.NOT_LEADER,
                f"the leadership changed before the hand-over: {winner} leads in term {view.term}",
                view,
                now_ms,
            )
        return self._finish(
            TransferOutcome.ELECTION_LOST,
            f"{self.target} did not win the election: {winner} leads in term {view.term}",
            view,
            now_ms,
        )

    def _timed_out(
        self, now_ms: int, view: LeaderView | None = None, *, force: bool = False
    ) -> Step | None:
        if not force and now_ms < self._deadline_ms:
            return None
        if self._sent_term is not None:
            outcome, message = (
                TransferOutcome.TIMEOUT,
                "TimeoutNow was sent but no new leader was known in time",
            )
        elif not self._ever_connected:
            outcome, message = (
                TransferOutcome.UNREACHABLE,
                f"this leader had no connection to {self.target}",
            )
        elif self._attempts == 0:
            gap = "" if self._last_gap is None else f" ({self._last_gap} entries behind)"
            outcome, message = (
                TransferOutcome.NOT_CAUGHT_UP,
                f"{self.target} did not come within {self._gap} entries of the leader in time{gap}",
            )
        else:
            outcome, message = (
                TransferOutcome.NOT_CAUGHT_UP,
                f"{self.target} did not reach the leader's last index while proposals were "
                f"held ({self._attempts} attempts)",
            )
        return self._finish(outcome, message, view, now_ms)

    def _end_hold(self, now_ms: int) -> None:
        if self._hold_started_ms is not None:
            self._held_ms += now_ms - self._hold_started_ms
            self._hold_started_ms = None

    def _finish(
        self, outcome: TransferOutcome, message: str, view: LeaderView | None, now_ms: int
    ) -> Step:
        self._end_hold(now_ms)
        self._phase = _Phase.DONE
        result = TransferResult(
            outcome=outcome,
            message=message,
            from_address=self.self_address,
            target_address=self.target,
            leader_address=None if view is None else view.leader,
            term=0 if view is None else view.term,
            waited_ms=now_ms - self._start_ms,
            catch_up_ms=None if self._sent_ms is None else self._sent_ms - self._start_ms,
            held_ms=self._held_ms,
            attempts=self._attempts,
        )
        return Step(Action.FINISH, result)


def pick_target(view: LeaderView) -> str | None:
    """The most caught-up connected follower (ties: the lowest address), None if none."""
    candidates = [
        (view.match_index.get(a, 0), a) for a in sorted(view.members) if a in view.connected
    ]
    if not candidates:
        return None
    best = max(m for m, _ in candidates)
    return next(a for m, a in candidates if m == best)
