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

The driver (:func:`transfer_leadership`) runs it on the asyncio loop against a real
:class:`chronomq.raftlog.node.RaftLog`; what the holds mean for writers is in
:meth:`chronomq.raftlog.committer.GroupCommitter.hold` and :meth:`chronomq.raftlog.machine.ReplicatedLog.hold_proposals`.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from chronomq.raftlog.errors import CommitOutcomeUnknown, NotLeader

if TYPE_CHECKING:
    from chronomq.raftlog.node import RaftLog

log = logging.getLogger(__name__)

#: How far behind the leader's last index the target may be before proposals are held: about
#: what the group committer keeps in flight (``max_inflight_commands``), so holding lasts a
#: round trip or two, not a catch-up.
CATCH_UP_GAP_ENTRIES = 64
#: How long a target that is not connected at all is waited for before the answer is
#: "unreachable" (pysyncobj reconnects every ``connection_retry_ms``, 1 s).
CONNECT_GRACE_MS = 2_500
#: Hand-over attempts within one request (each holds proposals at most ``hold_ms``).
MAX_ATTEMPTS = 3
#: Longest wait a caller may ask for.
MAX_TIMEOUT_MS = 60_000
DEFAULT_TIMEOUT_MS = 5_000
#: How often the driver looks at the Raft thread's view.
POLL_S = 0.005


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


# ---------------------------------------------------------------------- driver


class _Member(Protocol):
    @property
    def id(self) -> int: ...

    @property
    def raft(self) -> str: ...


class _NodeConfig(Protocol):
    @property
    def node_id(self) -> int: ...


class BrokerLike(Protocol):
    """What the driver needs of a broker: its log and its members (ids and Raft addresses)."""

    @property
    def raftlog(self) -> RaftLog: ...

    @property
    def config(self) -> _NodeConfig: ...

    def peers(self) -> Sequence[_Member]: ...


_busy: weakref.WeakSet[RaftLog] = weakref.WeakSet()
_busy_lock = threading.Lock()


async def transfer_leadership(
    broker_or_raftlog: BrokerLike | RaftLog, target_id: int | None, timeout_s: float
) -> TransferResult:
    """Hand this node's leadership to member ``target_id`` (None: the most caught-up
    connected follower) and wait, at most ``timeout_s``, until it leads.

    Run on the leader's asyncio loop. Given a broker, ids are its members' (runtime-added
    ones included); given a bare :class:`RaftLog`, ``target_id`` must be None. One transfer
    runs at a time per node (:attr:`TransferOutcome.IN_PROGRESS` otherwise). Never raises for
    a refusal: the result says what happened.
    """
    from chronomq.raftlog.node import RaftLog  # here: raftlog.node imports this module's types

    if isinstance(broker_or_raftlog, RaftLog):
        raftlog = broker_or_raftlog
        members: dict[int, str] = {}
        self_id: int | None = None
        if target_id is not None:
            raise ValueError("a target id needs a broker's member list")
    else:
        raftlog = broker_or_raftlog.raftlog
        members = {p.id: p.raft for p in broker_or_raftlog.peers()}
        self_id = int(broker_or_raftlog.config.node_id)
    timeout_ms = max(0, min(int(timeout_s * 1000), MAX_TIMEOUT_MS))
    ids = {a: i for i, a in members.items()}
    if self_id is not None:
        ids[raftlog.config.raft_address] = self_id

    result = _with_ids(await _transfer(raftlog, members, self_id, target_id, timeout_ms), ids)
    log.info(
        "leadership transfer to %s: %s after %d ms (catch-up %s ms, proposals held %d ms, "
        "%d attempts, term %d): %s",
        _label(target_id if target_id is not None else result.target_id, result.target_address),
        result.outcome.value,
        result.waited_ms,
        result.catch_up_ms,
        result.held_ms,
        result.attempts,
        result.term,
        result.message,
    )
    return result


async def _transfer(
    raftlog: RaftLog,
    members: Mapping[int, str],
    self_id: int | None,
    target_id: int | None,
    timeout_ms: int,
) -> TransferResult:
    self_address = raftlog.config.raft_address
    if target_id is not None and target_id == self_id:
        if raftlog.is_leader:
            return TransferResult(
                TransferOutcome.ALREADY_LEADER,
                "this node is the target and already leads",
                self_address,
                self_address,
                self_address,
                raftlog.machine.raftCurrentTerm,
            )
        return _refused(TransferOutcome.NOT_LEADER, "this node does not lead", raftlog)
    if target_id is not None and target_id not in members:
        return _refused(TransferOutcome.UNKNOWN_MEMBER, f"no member has id {target_id}", raftlog)
    with _busy_lock:
        if raftlog in _busy:
            return _refused(
                TransferOutcome.IN_PROGRESS,
                "another leadership transfer is running on this node",
                raftlog,
            )
        _busy.add(raftlog)
    try:
        target = members.get(target_id) if target_id is not None else None
        return await _run(raftlog, target, timeout_ms)
    finally:
        with _busy_lock:
            _busy.discard(raftlog)


async def _run(raftlog: RaftLog, target: str | None, timeout_ms: int) -> TransferResult:
    machine = raftlog.machine
    committer = raftlog.committer
    if not raftlog.is_leader:
        return _refused(TransferOutcome.NOT_LEADER, "this node does not lead", raftlog)
    started = time.monotonic()

    def now_ms() -> int:
        return int((time.monotonic() - started) * 1000)

    hold_ms = raftlog.config.raft_max_timeout_ms
    machine.watch_transfer(True)
    try:
        view = await _first_view(raftlog, started + 2.0)
        if target is None:
            target = pick_target(view) if view is not None else None
            if target is None:
                return _refused(
                    TransferOutcome.NO_TARGET, "no connected follower to hand over to", raftlog
                )
        core = TransferCore(
            self_address=raftlog.config.raft_address,
            target=target,
            start_ms=0,
            timeout_ms=timeout_ms,
            hold_ms=hold_ms,
        )
        while True:
            step = core.step(machine.transfer_view, now_ms(), committer.inflight_commands)
            if step.action is Action.HOLD_COMMITTER:
                # The core releases it after hold_ms while this node leads; once it does not,
                # the writes held stay held until they are failed with NotLeader (below), not
                # proposed to a follower. The committer's own bound is for a driver that died.
                committer.hold(started + timeout_ms / 1000 + 1.0)
            elif step.action is Action.HAND_OVER:
                machine.hold_proposals(time.monotonic() + hold_ms / 1000)
                machine.arm_timeout_now(target)
            elif step.action is Action.RELEASE:
                machine.arm_timeout_now(None)
                machine.hold_proposals(None)
                committer.release()
            elif step.action is Action.FINISH:
                assert step.result is not None
                return step.result
            await asyncio.sleep(POLL_S)
    finally:
        try:
            machine.watch_transfer(False)
            machine.arm_timeout_now(None)
            # Released at once while this node leads; otherwise the Raft thread fails what it
            # held (NotLeader) and releases it itself.
            machine.hold_proposals(None)
            await _settle(raftlog)
            if not machine._isLeader():
                # What the committer held was never proposed: the writers hear NotLeader (and
                # go to the new leader) rather than have it forwarded by a follower's Raft.
                committer.fail_all(
                    NotLeader(
                        "leadership handed over; the write was not proposed",
                        raftlog.leader_address(),
                    ),
                    CommitOutcomeUnknown(
                        "leadership handed over after the write was proposed; it may have "
                        "committed: retry with the same idempotency key"
                    ),
                )
        finally:
            committer.release()


async def _first_view(raftlog: RaftLog, until_s: float) -> LeaderView | None:
    while time.monotonic() < until_s:
        view = raftlog.machine.transfer_view
        if view is not None:
            return view
        await asyncio.sleep(POLL_S)
    return None


async def _settle(raftlog: RaftLog) -> None:
    """When this node no longer leads in Raft, wait (at most a second) until the leadership
    watch has failed the batches the committer held (NotLeader: never proposed), so that
    releasing it cannot propose them to a follower."""
    until = time.monotonic() + 1.0
    while raftlog.is_leader and not raftlog.machine._isLeader() and time.monotonic() < until:
        await asyncio.sleep(POLL_S)


def _refused(outcome: TransferOutcome, message: str, raftlog: RaftLog) -> TransferResult:
    return TransferResult(
        outcome,
        message,
        raftlog.config.raft_address,
        leader_address=raftlog.leader_address(),
        term=raftlog.machine.raftCurrentTerm,
    )


def _with_ids(result: TransferResult, ids: Mapping[str, int]) -> TransferResult:
    import dataclasses

    message = result.message
    for address, node_id in sorted(ids.items(), key=lambda kv: -len(kv[0])):
        message = message.replace(address, f"node {node_id}")
    return dataclasses.replace(
        result,
        message=message,
        from_id=ids.get(result.from_address),
        target_id=None if result.target_address is None else ids.get(result.target_address),
        leader_id=None if result.leader_address is None else ids.get(result.leader_address),
    )


def _label(node_id: int | None, address: str | None) -> str:
    if node_id is None:
        return str(address or "the most caught-up follower")
    return f"node {node_id}" if address is None else f"node {node_id} ({address})"
