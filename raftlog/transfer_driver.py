"""The leadership transfer driver: runs a :class:`~chronomq.raftlog.transfer.TransferCore` on
the leader's asyncio loop against a real :class:`chronomq.raftlog.node.RaftLog`.

Every few milliseconds it feeds the core the Raft thread's latest
:class:`~chronomq.raftlog.transfer.LeaderView` and carries out the step it answers: hold the
group committer, hold proposals at the Raft machine and arm TimeoutNow, release, or finish.
Whatever happens, it leaves nothing held: what the committer held while this node stopped
leading fails with :class:`~chronomq.raftlog.errors.NotLeader` (never proposed), not forwarded.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from typing import Protocol

from chronomq.raftlog.errors import CommitOutcomeUnknown, NotLeader
from chronomq.raftlog.node import RaftLog
from chronomq.raftlog.transfer import (
    Action,
    LeaderView,
    TransferCore,
    TransferOutcome,
    TransferResult,
    pick_target,
)

log = logging.getLogger(__name__)

#: Longest wait a caller may ask for.
MAX_TIMEOUT_MS = 60_000
DEFAULT_TIMEOUT_MS = 5_000
#: How often the driver looks at the Raft thread's view.
POLL_S = 0.005


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
