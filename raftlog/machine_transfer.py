"""The Raft machine's part in a leadership transfer, on pysyncobj's tick thread.

The decisions are :class:`chronomq.raftlog.transfer.TransferCore`'s and the driver
(:mod:`chronomq.raftlog.transfer_driver`) carries them out from the asyncio loop through the
calls here, which any thread may make: publish a :class:`~chronomq.raftlog.transfer.LeaderView`
each tick while a transfer watches, hold proposals, arm TimeoutNow. On the target, a TimeoutNow
from its leader marks the election it starts as a transfer's (no pre-vote, stickiness ignored).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from pysyncobj import FAIL_REASON, SyncObj
from pysyncobj.monotonic import monotonic as _pso_monotonic
from pysyncobj.syncobj import _RAFT_STATE

from chronomq.raftlog.transfer import LeaderView

# One component, one logger: these lines are the Raft machine's.
log = logging.getLogger("chronomq.raftlog.machine")

_RAFT_STATE_LEADER = _RAFT_STATE.LEADER


class TransferHooks(SyncObj):
    """Leadership transfer on the Raft thread, mixed into the Raft machine."""

    # pysyncobj's private state read and written here.
    _SyncObj__raftCommitIndex: int
    _SyncObj__raftState: int
    _SyncObj__otherNodes: set[Any]
    _SyncObj__raftCurrentTerm: int
    _SyncObj__raftLeader: Any
    _SyncObj__raftMatchIndex: dict[Any, int]
    _SyncObj__connectedNodes: set[Any]
    _SyncObj__commandsQueue: Any

    def _init_transfer(self) -> None:
        """Called by the machine before pysyncobj starts. On the leader: what the Raft thread
        reports each tick while a transfer watches, the hold on proposals and the armed
        TimeoutNow; on the target, the election TimeoutNow asked for."""
        self._transfer_watch = False
        self.transfer_view: LeaderView | None = None
        self._proposals_held_until: float | None = None
        self._timeout_now_to: str | None = None
        self._timeout_now_term: int | None = None
        self._transfer_election_term: int | None = None

    def watch_transfer(self, on: bool) -> None:
        """While on, the Raft thread publishes a :class:`LeaderView` as ``transfer_view`` at
        the end of every tick (any thread)."""
        self._transfer_watch = on
        if not on:
            self.transfer_view = None

    def hold_proposals(self, until_s: float | None) -> None:
        """Append no command to the log until ``until_s`` (``time.monotonic``), or release
        with None (any thread).

        Commands proposed meanwhile wait in pysyncobj's queue. A node that stops leading while
        holding fails them with ``NOT_LEADER`` (they were never in the log) instead of
        forwarding them to the new leader, and releases; releasing on a node that no longer
        leads is left to that (the Raft thread's next tick).
        """
        if until_s is not None:
            self._proposals_held_until = until_s - time.monotonic() + _pso_monotonic()
        elif self._SyncObj__raftState == _RAFT_STATE_LEADER:
            self._proposals_held_until = None

    def arm_timeout_now(self, address: str | None) -> None:
        """Have the Raft thread send TimeoutNow to ``address`` the first tick on which this
        node leads, holds proposals, is connected to it and its matchIndex equals the last
        index; None disarms. ``transfer_view.timeout_now_term`` tells when it was sent."""
        self._timeout_now_term = None
        self._timeout_now_to = address

    @property
    def transfer_election_pending(self) -> bool:
        """This follower was sent TimeoutNow by its leader and has not started the election
        yet: the election it starts is a transfer's (no pre-vote; its request_vote carries
        ``"transfer": True``)."""
        return self._transfer_election_term is not None

    def _note_timeout_now(self, node: Any, message: dict[str, Any]) -> None:
        # pysyncobj's own condition for acting on it (see its __onMessageReceived).
        if (
            message.get("term", -1) >= self._SyncObj__raftCurrentTerm
            and node == self._SyncObj__raftLeader
            and self._SyncObj__raftState != _RAFT_STATE_LEADER
        ):
            self._transfer_election_term = self._SyncObj__raftCurrentTerm
            log.info("TimeoutNow from the leader in term %d: starting an election", message["term"])

    def _end_transfer_election(self) -> None:
        """The transfer's election has started (the term moved on), or cannot."""
        term = self._transfer_election_term
        if term is not None and (
            self._SyncObj__raftCurrentTerm > term or self._SyncObj__raftState == _RAFT_STATE_LEADER
        ):
            self._transfer_election_term = None

    def _proposals_held(self) -> bool:
        """True while proposals are held: pysyncobj's queue of commands is left alone this
        tick. A node that stops leading while holding fails what waits (``NOT_LEADER``) and
        releases."""
        until = self._proposals_held_until
        if until is None:
            return False
        if self._SyncObj__raftState != _RAFT_STATE_LEADER:
            self._fail_queued()
            self._proposals_held_until = None
            return True
        if _pso_monotonic() < until:
            return True
        self._proposals_held_until = None
        return False

    def _fail_queued(self) -> None:
        queue = self._SyncObj__commandsQueue
        failed = 0
        while True:
            try:
                _command, callback = queue.get_nowait()
            except Exception:  # pysyncobj's Queue.Empty
                break
            failed += 1
            self._SyncObj__callErrCallback(FAIL_REASON.NOT_LEADER, callback)
        if failed:
            log.info("leadership handed over: %d held commands failed, not proposed", failed)

    def _transfer_tick(self) -> None:
        leading = self._SyncObj__raftState == _RAFT_STATE_LEADER
        last = self._SyncObj__raftLog[-1]
        last_index = last[1]
        match = {n.id: i for n, i in list(self._SyncObj__raftMatchIndex.items())}
        connected = frozenset(n.id for n in list(self._SyncObj__connectedNodes))
        members = list(self._SyncObj__otherNodes)
        target = self._timeout_now_to
        if (
            target is not None
            and leading
            and self._proposals_held_until is not None
            and target in connected
            and match.get(target) == last_index
        ):
            node = next((n for n in members if n.id == target), None)
            if node is not None:
                self._timeout_now_to = None
                sent: list[int] = []
                self.transferLeadership(node, lambda _r, err: sent.append(err))
                if sent == [FAIL_REASON.SUCCESS]:
                    self._timeout_now_term = self._SyncObj__raftCurrentTerm
                    log.info("TimeoutNow sent to %s at index %d", target, last_index)
                else:
                    self._timeout_now_to = target  # refused: try again next tick
        commit = self._SyncObj__raftCommitIndex
        entries = self._SyncObj__getEntries(commit, 1) if commit > 0 else []
        leader = self._SyncObj__raftLeader
        self.transfer_view = LeaderView(
            at_s=time.monotonic(),
            leading=leading,
            term=self._SyncObj__raftCurrentTerm,
            leader=getattr(leader, "id", None),
            last_index=last_index,
            commit_term=entries[0][2] if entries else 0,
            match_index=match,
            connected=connected,
            members=frozenset(n.id for n in members),
            timeout_now_term=self._timeout_now_term,
        )
