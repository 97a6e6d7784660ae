"""The Raft state machine: a pysyncobj ``SyncObj`` whose state is a :class:`Store`.

pysyncobj calls :meth:`ReplicatedLog._apply_cmd` on its own thread, in log order, on every
node. Snapshots are thin (see :mod:`chronomq.raftlog.store`); with a custom serializer pysyncobj calls
``serializer(path, (entry_S, entry_S-1, cluster))`` on the same thread as apply, so the store's
state is exactly that at index S, and ``deserializer(path)`` must give the three back.

Facts this relies on (pysyncobj 0.3.17):

* on restart pysyncobj loads the snapshot, then re-applies the journal after it: the store is
  made exactly the snapshot's state first (CommitLog truncated to its length), and with no
  snapshot the store is emptied before ``SyncObj`` starts, since the whole journal replays;
* a received snapshot is not checked by pysyncobj: ours carries its own length and hash;
* an exception in the deserializer at start leaves the node wedged: we exit instead;
* pysyncobj's journal is replaced by :class:`chronomq.raftlog.journal.DurableJournal` (CRC per record,
  term and vote synced); with ``flush="sync"`` the entries appended in a tick are synced with
  one ``fdatasync`` before this node counts them towards a commit (leader) or acknowledges them
  (follower: its answers wait in :class:`chronomq.raftlog.transport.GuardedTransport` until the sync);
* with either setting the CommitLog is synced before a snapshot that covers it is written, and
  the snapshot is durable (file and directory) before the journal entries it covers are
  dropped: between snapshots the CommitLog is rebuilt from the journal on restart;
* pysyncobj's wire, admin commands and unpickling are replaced or closed as listed in
  :mod:`chronomq.raftlog.transport`.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pysyncobj.syncobj as _syncobj_module
from pysyncobj import FAIL_REASON, SyncObj, SyncObjConf, replicated
from pysyncobj.monotonic import monotonic as _pso_monotonic
from pysyncobj.syncobj import _RAFT_STATE
from pysyncobj.transport import TCPNode

from chronomq.raftlog import catchup, durable, prevote, transport
from chronomq.raftlog.config import RaftConfig
from chronomq.raftlog.errors import StoreCorruption
from chronomq.raftlog.journal import DurableJournal
from chronomq.raftlog.journalcheck import check_journal, journal_advice
from chronomq.raftlog.prevote import LogPosition, PreVoteRound, VoterState
from chronomq.raftlog.removal import RemovalFile, RemovalNotice
from chronomq.raftlog.snapshot import FetchTarget, decode_entry, encode_entry
from chronomq.raftlog.store import Store
from chronomq.raftlog.ticks import TickWatch
from chronomq.raftlog.transfer import LeaderView

log = logging.getLogger(__name__)

_RAFT_STATE_LEADER = _RAFT_STATE.LEADER

EXIT_STORE_FAULT = durable.EXIT_STORE_FAULT


def _fatal(message: str) -> None:
    log.critical("%s: exiting so the node restarts from its files", message)
    logging.shutdown()
    os._exit(EXIT_STORE_FAULT)


def _refuse(message: str) -> None:
    """This node's own files cannot be started from: say which and what to do, and exit."""
    log.critical("refusing to start: %s", message)
    logging.shutdown()
    os._exit(EXIT_STORE_FAULT)


def _fault_message(exc: BaseException, data_dir: str | os.PathLike[str]) -> str:
    """What stopped apply on this node, naming the file when known, and what to do."""
    if isinstance(exc, OSError):
        return _storage_fault(exc, data_dir)
    return (
        f"apply failed: {exc}. This node's files under {data_dir} are damaged or its settings "
        "differ from the cluster's: fix the setting named above, or stop the node, move the "
        "data directory aside and restart it to copy everything from its peers"
    )


def _storage_fault(exc: OSError, data_dir: object) -> str:
    """What the operator reads when apply hits a local storage fault."""
    where = exc.filename or data_dir
    if exc.errno == errno.ENOSPC:
        return (
            f"no space left on device writing {where}: this node stops; the other nodes "
            f"keep serving. Free space on the disk of {data_dir} (or lower "
            "file_reserved_time_h, or grow the disk), then start this node again: it "
            "catches up from the leader"
        )
    return (
        f"storage fault writing {where} ({exc.strerror or exc}): this node stops; the other "
        f"nodes keep serving. Check the disk of {data_dir}, then start this node again"
    )


def _addr(hostport: str) -> tuple[str, int]:
    host, _, port = hostport.rpartition(":")
    return host, int(port)


class ReplicatedLog(SyncObj):
    # pysyncobj's private state that the hooks below read and write.
    _SyncObj__raftCommitIndex: int
    _SyncObj__raftLastApplied: int
    _SyncObj__raftState: int
    _SyncObj__otherNodes: set[Any]
    _SyncObj__lastResponseTime: dict[Any, float]
    _SyncObj__raftCurrentTerm: int
    _SyncObj__raftElectionDeadline: float
    _SyncObj__raftLeader: Any
    _SyncObj__raftMatchIndex: dict[Any, int]
    _SyncObj__connectedNodes: set[Any]
    _SyncObj__commandsQueue: Any
    _SyncObj__transport: Any

    def __init__(
        self,
        config: RaftConfig,
        store: Store,
        *,
        on_state_changed: Callable[[int, int], None] | None = None,
        auto_tick: bool = True,
    ) -> None:
        """``auto_tick=False``: no Raft thread; the caller drives it with ``_onTick``."""
        self._cfg = config
        self._store = store
        store.want_results = self._isLeader
        store.peer_bytes = self._peer_bytes
        self._started = False
        raft_dir = Path(config.data_dir) / "raft"
        durable.make_dirs(raft_dir)
        self._dump_path = str(raft_dir / "snapshot")
        # Pre-vote and leader stickiness (raftlog/prevote.py), and this node's removal.
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
        if self.removal is not None:
            log.warning(
                "this node was removed from the cluster (%s): it does not campaign and answers "
                "410 removed_from_cluster until an operator adds it back",
                self.removal.describe(),
            )
        # Half the shortest election timeout: a tick that long is one heartbeat from an election.
        self.ticks = TickWatch(config.raft_min_timeout_ms / 2)
        # Apply no longer than a heartbeat period in one tick (see _SyncObj__applyLogEntries).
        self.apply_budget_s = config.append_entries_period_ms / 1000
        self._apply_behind = False
        self._commit_target = 0
        self._applied_bytes = 0
        # Leadership transfer (raftlog/transfer.py): on the leader, what the Raft thread
        # reports each tick while a transfer watches, the hold on proposals and the armed
        # TimeoutNow; on the target, the election TimeoutNow asked for.
        self._transfer_watch = False
        self.transfer_view: LeaderView | None = None
        self._proposals_held_until: float | None = None
        self._timeout_now_to: str | None = None
        self._timeout_now_term: int | None = None
        self._transfer_election_term: int | None = None
        journal_path = str(raft_dir / "journal")
        damaged = check_journal(journal_path)
        if damaged is not None:
            _refuse(
                f"{damaged.describe(journal_path)}. {journal_advice(journal_path, config.data_dir)}"
            )
        if not os.path.exists(self._dump_path):
            # No snapshot: pysyncobj will replay the journal from its first entry.
            store.reset()
        else:
            # pysyncobj loads the snapshot on its first tick; until then the store's tables
            # are empty and an extension registering must not align its files to them.
            store.settled = False
        conf = SyncObjConf(
            journalFile=journal_path,
            fullDumpFile=self._dump_path,
            serializer=self._serialize,
            deserializer=self._deserialize,
            appendEntriesPeriod=config.append_entries_period_ms / 1000,
            appendEntriesUseBatch=config.append_entries_use_batch,
            raftMinTimeout=config.raft_min_timeout_ms / 1000,
            raftMaxTimeout=config.raft_max_timeout_ms / 1000,
            connectionTimeout=config.connection_timeout_ms / 1000,
            connectionRetryTime=config.connection_retry_ms / 1000,
            leaderFallbackTimeout=config.leader_fallback_timeout_ms / 1000,
            logCompactionMinEntries=config.log_compaction_min_entries,
            logCompactionMinTime=config.log_compaction_min_time_s,
            commandsQueueSize=100_000,
            appendEntriesBatchSizeBytes=config.append_entries_batch_bytes,
            dynamicMembershipChange=True,
            # Listen on raft_host only, not on every interface.
            bindAddress=config.raft_address,
            onStateChanged=on_state_changed,
            autoTick=auto_tick,
        )
        # The authenticated wire and restricted unpickling (see raftlog/transport.py).
        transport.install()
        transport_class = functools.partial(
            transport.GuardedTransport, settings=transport.settings_for(config)
        )
        self._group_sync = config.flush == "sync"
        self._journal: DurableJournal | None = None
        # pysyncobj builds its journal through this module-level name.
        original = _syncobj_module.createJournal
        _syncobj_module.createJournal = self._create_journal
        try:
            super().__init__(
                config.raft_address,
                [p.raft for p in config.peers],
                conf,
                transportClass=transport_class,
            )
        finally:
            _syncobj_module.createJournal = original
        if self._group_sync:
            journal = self._journal
            assert journal is not None
            self._SyncObj__transport.ack_gate = lambda: journal.dirty

    def raft_listening(self) -> bool:
        """True once the Raft listener is bound (pysyncobj binds it on the tick thread)."""
        return bool(self._SyncObj__transport.ready)

    def _create_journal(self, path: str | None) -> Any:
        assert path is not None
        self._journal = DurableJournal(
            path,
            flush=self._cfg.flush,
            flush_interval_ms=self._cfg.flush_interval_ms,
        )
        return self._journal

    def _sync_journal(self) -> None:
        """Group commit (``flush="sync"``): one fdatasync for every entry appended since the
        last, then the acknowledgements that waited for it are sent."""
        journal = self._journal
        if not self._group_sync or journal is None:
            return
        journal.sync()
        self._SyncObj__transport.release_acks()

    # ------------------------------------------------------------------ pysyncobj hooks

    def _onTick(self, timeToWait: float = 0.0) -> None:  # noqa: N802, N803 - pysyncobj's names
        self.ticks.begin()
        # Committed entries still to apply: read the network and go on at once.
        try:
            if self._SyncObj__raftState != _RAFT_STATE_LEADER:
                # pysyncobj checks the election deadline before it reads the network. After
                # a long tick of this node's own work (a large entry received, journaled,
                # applied) the leader's heartbeats wait unread in the socket: a follower reads
                # them first, so that being busy is not taken for the leader's silence.
                self._poller.poll(0)
            # The leader counts its own entries towards a commit at the start of the tick: they
            # are durable first.
            self._sync_journal()
            self._campaign_gate()
            marking = self._transfer_election_term is not None
            if marking:
                self._SyncObj__transport.vote_fields = {"transfer": True}
            try:
                super()._onTick(0.0 if self._apply_behind else timeToWait)
            finally:
                if marking:
                    self._SyncObj__transport.vote_fields = None
                    self._end_transfer_election()
            # Entries received in this tick's poll: synced, then acknowledged.
            self._sync_journal()
            if self._transfer_watch:
                self._transfer_tick()
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EIO, errno.EDQUOT):
                raise
            # pysyncobj's journal could not be written: logging and ticking on would leave
            # the node wedged, neither serving nor saying why.
            log.exception("the Raft journal could not be written")
            _fatal(_storage_fault(exc, self._store.data_dir))
        report = self.ticks.end()
        if report is not None:
            log.warning("%s", report.describe(self.ticks.slow_ms))

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
            return
        now = _pso_monotonic()
        if self.removal is not None:
            self._SyncObj__raftElectionDeadline = now + self._cfg.raft_max_timeout_ms / 1000
            self._SyncObj__raftLeader = None
            return
        if self._SyncObj__raftElectionDeadline >= now:
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
        self._SyncObj__raftElectionDeadline = now + self._SyncObj__generateRaftTimeout()
        # The leader went silent for an election timeout: forget it, as an election would.
        self._SyncObj__raftLeader = None
        self._prevote = PreVoteRound(
            term + 1,
            frozenset(n.id for n in others),
            expires_s=self._SyncObj__raftElectionDeadline,
        )
        self.prevotes_started += 1
        message = {
            "type": prevote.PRE_VOTE,
            "term": term + 1,
            "last_log_index": self._SyncObj__getCurrentLogIndex(),
            "last_log_term": self._SyncObj__getCurrentLogTerm(),
        }
        for node in others:
            self._SyncObj__transport.send(node, message)

    def _voter_state(self) -> VoterState:
        return VoterState(
            current_term=self._SyncObj__raftCurrentTerm,
            last_log=LogPosition(
                self._SyncObj__getCurrentLogTerm(), self._SyncObj__getCurrentLogIndex()
            ),
            leads=self._SyncObj__raftState == _RAFT_STATE_LEADER,
            leader_heard_s=self._leader_heard_s,
            stickiness_s=self._stickiness_s,
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
        refusal = (
            "this node was removed from the cluster"
            if self.removal is not None
            else prevote.prevote_refusal(
                self._voter_state(), _pso_monotonic(), term, LogPosition(last_term, index)
            )
        )
        if refusal is not None:
            log.debug("pre-vote for term %d from %s refused: %s", term, node.id, refusal)
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
            self._SyncObj__raftElectionDeadline = 0

    def _ignores_vote_request(self, message: dict[str, Any]) -> bool:
        if self.removal is not None:
            return True
        ignore = prevote.ignores_vote_request(
            self._voter_state(), _pso_monotonic(), transfer=message.get("transfer") is True
        )
        if ignore:
            self.votes_ignored += 1
        return ignore

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

    def _SyncObj__doChangeCluster(self, request: Any, reverse: bool = False) -> bool:  # noqa: N802
        """pysyncobj's membership change, logged when it changes this node's peers (on the
        leader when proposed, on a follower when appended, undone when truncated)."""
        done = bool(super()._SyncObj__doChangeCluster(request, reverse))
        if done:
            kind = request[0] if isinstance(request, list | tuple) and request else "?"
            node = request[1] if isinstance(request, list | tuple) and len(request) > 1 else "?"
            action = {"add": "added", "rem": "removed"}.get(str(kind), str(kind))
            if reverse:
                action = f"undid {'adding' if kind == 'add' else 'removing'}"
            log.info(
                "Raft membership: %s %s (members now: %s)",
                action,
                node,
                ", ".join(sorted([self.selfNode.id, *(n.id for n in self._SyncObj__otherNodes)])),
            )
        return done

    def _SyncObj__applyLogEntries(self) -> bool:  # noqa: N802
        """Apply committed entries for at most ``apply_budget_s`` per tick.

        pysyncobj applies every committed entry in one go, on the thread that also sends
        heartbeats and reads the network. A leader with a few dozen heavy commands to apply
        would stay silent longer than an election timeout and be deposed although healthy.
        The commit index is lowered to one entry past the last applied for each call, and
        restored after; what is left is applied in the next ticks, which then do not wait.
        """
        target = self._commit_target = self._SyncObj__raftCommitIndex
        deadline = time.monotonic() + self.apply_budget_s
        need_send = False
        try:
            while (applied := self._SyncObj__raftLastApplied) < target:
                self._SyncObj__raftCommitIndex = applied + 1
                need_send = super()._SyncObj__applyLogEntries() or need_send
                if self._SyncObj__raftLastApplied == applied or time.monotonic() >= deadline:
                    break  # no progress (pysyncobj logged why), or this tick's time is up
        finally:
            self._SyncObj__raftCommitIndex = target
            self._commit_target = 0
        self._apply_behind = self._SyncObj__raftLastApplied < target
        return need_send

    def quorum_silence_s(self) -> float:
        """Seconds since a majority of the members last answered this leader (0 when this
        node is alone; a large value when it does not lead). Read from other threads."""
        if self._SyncObj__raftState != _RAFT_STATE_LEADER:
            return float("inf")
        for _ in range(3):
            try:
                others = list(self._SyncObj__otherNodes)
                seen = self._SyncObj__lastResponseTime
                times = sorted((seen.get(n, 0.0) for n in others), reverse=True)
                break
            except RuntimeError:  # changed size while read (membership change)
                continue
        else:
            return float("inf")
        needed = (len(others) + 1) // 2  # others that must answer, with this node, a majority
        if needed == 0:
            return 0.0
        return max(0.0, _pso_monotonic() - times[needed - 1])

    @property
    def raftCommitIndex(self) -> int:  # noqa: N802 - pysyncobj's name
        """The commit index, also while :meth:`_SyncObj__applyLogEntries` lowers it (read by
        other threads for status and logs)."""
        return max(self._SyncObj__raftCommitIndex, self._commit_target)

    def _SyncObj__onMessageReceived(self, node: Any, message: Any) -> None:  # noqa: N802
        """Two corrections to pysyncobj's message handling, and the mark of a TimeoutNow.

        A snapshot chunk does not move this follower's commit index (:meth:`_hold_commit_index`).

        A follower's ``nextIndex`` does not move back on an in-order acknowledgement.
        pysyncobj sets ``nextIndex`` to the acknowledged index on every successful answer.
        With several append messages in flight that moves it back over entries already sent,
        which are then sent again, and the follower truncates and re-appends them (logging
        "truncating already-applied log entries"). A follower that really misses entries
        answers with ``reset``, which still rewinds ``nextIndex`` as before.
        """
        if not isinstance(message, dict):
            super()._SyncObj__onMessageReceived(node, message)
            return
        kind = message.get("type")
        if kind == prevote.PRE_VOTE:
            self._on_prevote(node, message)
            return
        if kind == prevote.PRE_VOTE_RESPONSE:
            self._on_prevote_answer(node, message)
            return
        if kind == "request_vote" and self._ignores_vote_request(message):
            return
        if kind == "timeout_now":
            if self.removal is not None:
                return
            self._note_timeout_now(node, message)
        if kind == "apply_command":
            self._refuse_forwarded(node, message)
            return
        if kind == "append_entries" and message.get("term", -1) >= self._SyncObj__raftCurrentTerm:
            self._leader_heard_s = _pso_monotonic()
            if self.removal is not None:
                self._readmitted(node)
        if kind == "append_entries" and "serialized" in message and "prevLogIdx" not in message:
            message = self._hold_commit_index(message)
        if kind == "next_node_idx" and message.get("success") and not message.get("reset"):
            next_index = self._SyncObj__raftNextIndex
            before = next_index.get(node)
            super()._SyncObj__onMessageReceived(node, message)
            after = next_index.get(node)
            if before is not None and after is not None and after < before:
                next_index[node] = before
            return
        super()._SyncObj__onMessageReceived(node, message)

    def _refuse_forwarded(self, node: Any, message: dict[str, Any]) -> None:
        """A command another node's pysyncobj forwards is never appended here.

        Our writes are proposed only by a confirmed leader (:mod:`chronomq.raftlog.node`); pysyncobj
        forwards a command to the leader it knows when the node that got it does not lead.
        That happens only in the moment after a leader steps down and before its leadership
        watch notices: committed here, in the new term, such a command (a schedule range, a
        produce) would outlive the term it was proposed for. The sender's callback hears
        NOT_LEADER, so the write fails as never proposed and its client retries.
        """
        request_id = message.get("request_id")
        if request_id is None:
            return
        self._SyncObj__transport.send(
            node,
            {
                "type": "apply_command_response",
                "request_id": request_id,
                "error": FAIL_REASON.NOT_LEADER,
            },
        )

    def _hold_commit_index(self, message: dict[str, Any]) -> dict[str, Any]:
        """A snapshot chunk must not move this follower's commit index.

        pysyncobj takes ``commit_index`` from every append message, including the chunks
        of a snapshot, which carry no ``prevLogIdx``: nothing checks that this follower's
        log matches the leader's. A follower that was a leader cut off from the majority
        still holds the entries it appended then, never committed; it would commit and apply
        them, diverging its CommitLog, before the last chunk replaces its log. The commit
        index moves again on the first append message checked against the log.
        """
        held = min(message.get("commit_index", 0), self._SyncObj__raftCommitIndex)
        return {**message, "commit_index": held}

    # ------------------------------------------------------------------ leadership transfer

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

    def _checkCommandsToApply(self) -> None:  # noqa: N802 - pysyncobj's name
        until = self._proposals_held_until
        if until is not None:
            if self._SyncObj__raftState != _RAFT_STATE_LEADER:
                self._fail_queued()
                self._proposals_held_until = None
                return
            if _pso_monotonic() < until:
                return
            self._proposals_held_until = None
        super()._checkCommandsToApply()
        # One fdatasync for every command proposed in this tick (while the last sync ran,
        # more arrived: RocketMQ's GroupCommitService), on the group-commit thread while
        # this one polls for the followers' answers; the tick waits for it before counting
        # this node towards a commit.
        journal = self._journal
        if self._group_sync and journal is not None:
            journal.start_sync()

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

    # ------------------------------------------------------------------ apply

    @replicated
    def _apply_cmd(self, data: bytes) -> Any:
        # pysyncobj counts entries, not bytes, before compacting: a burst of large commands
        # would hold log_compaction_min_entries of them in memory.
        self._applied_bytes += len(data)
        if self._applied_bytes > self._cfg.log_compaction_max_bytes:
            self._applied_bytes = 0
            self.forceLogCompaction()
        started = time.monotonic()
        try:
            return self._store.apply(data, self.raftLastApplied + 1)
        except OSError as exc:
            log.exception("apply failed at index %d", self.raftLastApplied + 1)
            _fatal(_storage_fault(exc, self._store.data_dir))
        except Exception as exc:  # a failed apply would leave this replica diverged
            # Store.apply rejects whatever a command does wrong; what reaches here is a fault
            # of this node's files or settings.
            log.exception("apply failed at index %d", self.raftLastApplied + 1)
            _fatal(_fault_message(exc, self._cfg.data_dir))
        finally:
            self.ticks.applied(time.monotonic() - started)

    # ------------------------------------------------------------------ snapshots

    def _serialize(self, path: str, data: tuple[Any, Any, Any]) -> None:
        entry_s, entry_s1, cluster = data
        started = time.monotonic()
        try:
            self._write_dump(path, entry_s, entry_s1, sorted(node.id for node in cluster))
        finally:
            self.ticks.snapshotted(time.monotonic() - started)

    def _write_dump(self, path: str, entry_s: Any, entry_s1: Any, cluster: list[str]) -> None:
        """Write the store's state as the snapshot ending at ``entry_s``.

        The store has applied every entry up to it (entries that are not commands, such as
        pysyncobj's no-ops, leave the store as it was).
        """
        self._store.applied_index = entry_s[1]
        raft = {"s": encode_entry(entry_s), "s1": encode_entry(entry_s1), "cluster": cluster}
        blob = self._store.snapshot(raft)
        # pysyncobj renames it into place (transport.durable_replace), or _keep_applied does.
        with open(path, "wb") as f:
            f.write(blob)
            f.flush()
            durable.fsync(f.fileno(), path)

    def _deserialize(self, path: str) -> tuple[Any, Any, Any]:
        starting = not self._started
        self._started = True
        try:
            with open(path, "rb") as f:
                snap = Store.parse_snapshot(f.read())
        except (OSError, StoreCorruption) as exc:
            if starting:
                _refuse(
                    f"the local snapshot {path} cannot be read ({exc}). "
                    f"{journal_advice(path, self._cfg.data_dir)}"
                )
            log.error("rejecting a received snapshot: %s", exc)
            raise
        if not starting:
            kept = self._keep_applied(path, snap)
            if kept is not None:
                return kept
        try:
            self._store.restore(snap, self._fetch, self._peer_bytes)
            # pysyncobj clears the journal next: what the snapshot covers is on disk first.
            self._store.sync()
        except Exception as exc:
            log.exception("restoring snapshot at index %s failed", snap.get("index"))
            _fatal(f"restoring a snapshot failed: {exc}")
        if not starting:
            # The fetch may have taken longer than an election timeout; without this the node
            # would start an election the moment it returns.
            self._SyncObj__raftElectionDeadline = (
                _pso_monotonic() + self._cfg.raft_max_timeout_ms / 1000
            )
        raft = snap["raft"]
        assert isinstance(raft, dict)
        cluster = [TCPNode(n) for n in raft["cluster"]]
        log.info("restored snapshot at index %s, CommitLog %s bytes", snap["index"], snap["length"])
        last, before = decode_entry(raft["s"]), decode_entry(raft["s1"])
        if starting:
            self._drop_covered_entries(before, last)
        return last, before, cluster

    def _drop_covered_entries(
        self, before: tuple[bytes, int, int], last: tuple[bytes, int, int]
    ) -> None:
        """Let the journal begin with the snapshot's last two entries when it holds them.

        pysyncobj keeps the journal at start only if its first two entries are the snapshot's
        last two, and otherwise clears it. A node stopped after its snapshot was in place but
        before the journal was compacted (the next tick does that) would lose every entry it
        held after the snapshot, and when every node stopped in that window at once (they
        snapshot at the same index), committed ones: the entries the snapshot covers are
        dropped here first, as the compaction would have."""
        journal = self._journal
        if journal is None or len(journal) < 2:
            return
        k = before[1] - journal[0][1]
        if k <= 0 or k + 1 >= len(journal):
            return
        if tuple(journal[k]) != before or tuple(journal[k + 1]) != last:
            return
        log.info(
            "the Raft journal still held %d entries that the snapshot at index %d covers (the "
            "node stopped before compacting it): dropping them, keeping the %d after it",
            k,
            last[1],
            len(journal) - k - 2,
        )
        journal.deleteEntriesTo(k)

    def _keep_applied(self, path: str, snap: dict[str, Any]) -> tuple[Any, Any, Any] | None:
        """Keep what this follower applied past a snapshot it is sent; None to restore it.

        A leader sends a snapshot while its view of a follower lies before its compacted log.
        A follower's answers to append messages sent before it caught up move that view back
        after it has installed the snapshot and applied entries past it, so it is sent the
        same snapshot again, sometimes several times. Restoring it took the store back to the
        snapshot (CommitLog truncated, ConsumeQueues cut) until the leader sent the later
        entries once more: meanwhile this node's reads lacked messages it had already served.
        Raft keeps such a follower's state (InstallSnapshot, step 6 in section 7 of the paper).

        Only a store that holds the snapshot's state and whose CommitLog past it ends as a
        peer's does is kept (:meth:`Store.holds`): the entries it applied are then the
        committed ones, which the leader holds too, and it answers as if the snapshot ended at
        its last applied entry. pysyncobj keeps the two entries returned as its journal and
        applies from the next; the dump file is rewritten to end there too, so that a restart
        finds the journal starting where the dump ends.
        """
        raft = snap["raft"]
        index_s, term_s = decode_entry(raft["s"])[1:]
        applied = self.raftLastApplied
        if applied <= index_s:
            return None
        ours = self._SyncObj__getEntries(index_s, 1)
        if ours and ours[0][2] != term_s:
            return None  # not the same history
        last = self._SyncObj__getEntries(applied - 1, 2)
        if len(last) != 2 or not self._store.holds(snap, self._peer_bytes):
            return None
        entry_s1, entry_s = last
        try:
            tmp = path + ".keep.tmp"
            self._write_dump(tmp, entry_s, entry_s1, list(raft["cluster"]))
            durable.replace(tmp, path)
        except OSError as exc:
            log.warning(
                "writing a snapshot at index %d failed (%s): restoring instead", applied, exc
            )
            return None
        log.info(
            "kept the state at index %d: already past the snapshot at index %d it was sent",
            applied,
            index_s,
        )
        return entry_s, entry_s1, [TCPNode(n) for n in raft["cluster"]]

    def _fetch_peers(self) -> list[tuple[str, int]]:
        """Catch-up addresses of the other members, the leader's first."""
        leader_id = getattr(self._getLeader(), "id", None)
        ordered = sorted(self._cfg.peers, key=lambda p: p.raft != leader_id)
        return [_addr(p.fetch) for p in ordered]

    def _peer_bytes(self, start: int, end: int) -> bytes | None:
        """``[start, end)`` of the first peer's CommitLog that has all of it; None if none has."""
        for address in self._fetch_peers():
            try:
                data = catchup.fetch_bytes(address, start, end, secret=self._cfg.cluster_secret)
            except (OSError, ConnectionError) as exc:
                log.warning(
                    "reading CommitLog [%d, %d) from %s failed: %s", start, end, address, exc
                )
                continue
            if len(data) == end - start:
                return data
        return None

    def _fetch(self, target: FetchTarget) -> None:
        """Fill ``target`` from the peers, checked against the snapshot's hash chain; after
        ``catchup_deadline_s`` without success, :class:`catchup.FetchFailed` (logged as an
        ERROR naming the range and every peer's answer) and the restore fails."""
        catchup.fetch_range(
            self._fetch_peers,
            target,
            secret=self._cfg.cluster_secret,
            deadline_s=self._cfg.catchup_deadline_s,
        )

    def mark_started(self) -> None:
        self._started = True

    # ------------------------------------------------------------------ status

    def durability(self) -> dict[str, Any]:
        """This node's journal syncs: how many, and the longest an entry waited for one (under
        ``flush="async"``, what a power cut of every node could lose)."""
        journal = self._journal
        return {
            "flush": self._cfg.flush,
            "journal_syncs": journal.syncs if journal else 0,
            "journal_unsynced_ms_max": round(journal.max_unsynced_s * 1000, 1) if journal else 0,
        }

    def status(self) -> dict[str, Any]:
        st = self.getStatus()
        leader = st.get("leader")
        state = st.get("state")
        return {
            "role": {0: "follower", 1: "candidate", 2: "leader"}.get(state, str(state)),
            "leader": getattr(leader, "id", None),
            "term": st.get("raft_term", 0),
            "commit_index": st.get("commit_idx", 0),
            "applied_index": st.get("last_applied", 0),
            "has_quorum": bool(st.get("has_quorum")),
            "log_len": st.get("log_len", 0),
            "match_index": {
                k[len("match_idx_server_") :]: v
                for k, v in st.items()
                if k.startswith("match_idx_server_")
            },
            "peers_connected": {
                k[len("partner_node_status_server_") :]: v == 2
                for k, v in st.items()
                if k.startswith("partner_node_status_server_")
            },
            "uptime_s": st.get("uptime", 0),
            "ticks": self.ticks.ticks,
            "slow_ticks": self.ticks.slow_ticks,
            "max_tick_ms": round(self.ticks.max_ms, 1),
            "removed": self.removal is not None,
            "prevotes_started": self.prevotes_started,
            "prevotes_won": self.prevotes_won,
            "votes_ignored": self.votes_ignored,
        }
