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

The machine is one class in parts, each a mixin over ``SyncObj`` in a module of its own:

* this module: construction, the tick (journal syncs around pysyncobj's), apply within a time
  budget per tick, the corrections to pysyncobj's message handling, status;
* :mod:`chronomq.raftlog.machine_campaign`: pre-vote, leader stickiness, removal;
* :mod:`chronomq.raftlog.machine_transfer`: the Raft thread's part in a leadership transfer;
* :mod:`chronomq.raftlog.machine_snapshot`: thin snapshots written, installed or kept;
* :mod:`chronomq.raftlog.machine_faults`: how a fault of this node's own storage stops it.
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
from pysyncobj import FAIL_REASON, SyncObjConf, replicated
from pysyncobj.monotonic import monotonic as _pso_monotonic
from pysyncobj.syncobj import _RAFT_STATE

from chronomq.raftlog import durable, prevote, transport
from chronomq.raftlog.config import RaftConfig
from chronomq.raftlog.journal import DurableJournal
from chronomq.raftlog.journalcheck import check_journal, journal_advice
from chronomq.raftlog.machine_campaign import CampaignHooks
from chronomq.raftlog.machine_faults import fatal, fault_message, refuse, storage_fault
from chronomq.raftlog.machine_snapshot import SnapshotHooks
from chronomq.raftlog.machine_transfer import TransferHooks
from chronomq.raftlog.room import Room, RoomGauge, RoomWatch, resume_bytes
from chronomq.raftlog.store import Store
from chronomq.raftlog.ticks import TickWatch

log = logging.getLogger(__name__)

_RAFT_STATE_LEADER = _RAFT_STATE.LEADER
#: A follower's "paused" lasts this long after its last report saying so.
PAUSE_REPORT_S = 1.0


class ReplicatedLog(CampaignHooks, TransferHooks, SnapshotHooks):
    """pysyncobj's ``SyncObj`` applying committed commands to a :class:`Store`; the parts
    it mixes in are listed in this module's docstring."""

    # pysyncobj's private state that the hooks below read and write.
    _SyncObj__raftCommitIndex: int
    _SyncObj__raftLastApplied: int
    _SyncObj__raftState: int
    _SyncObj__otherNodes: set[Any]
    _SyncObj__lastResponseTime: dict[Any, float]
    _SyncObj__raftCurrentTerm: int
    _SyncObj__raftNextIndex: dict[Any, int]
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
        self._init_campaign(config, raft_dir)
        # Half the shortest election timeout: a tick that long is one heartbeat from an election.
        self.ticks = TickWatch(config.raft_min_timeout_ms / 2)
        # Apply no longer than a heartbeat period in one tick (see _SyncObj__applyLogEntries).
        self.apply_budget_s = config.append_entries_period_ms / 1000
        self._apply_behind = False
        self._commit_target = 0
        # What the leader's last append message said of its lease (raftlog/readiness.py).
        self.leader_lease = False
        # Disk room (raftlog/room.py): this node's, and what each follower last reported.
        self.room_gauge = RoomGauge(config.data_dir)
        self.room_watch = RoomWatch()
        # Raft address -> (its room, when it arrived, this node's CommitLog length then).
        self.peer_rooms: dict[str, tuple[Room, float, int]] = {}
        self.peer_paused: dict[str, float] = {}  # followers that said they pause, and when
        self._skip_parts = False  # a large entry or snapshot in parts is being skipped
        self._applied_bytes = 0
        # Leadership transfer (raftlog/transfer.py).
        self._init_transfer()
        journal_path = str(raft_dir / "journal")
        damaged = check_journal(journal_path)
        if damaged is not None:
            refuse(
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
        self._SyncObj__transport.ack_fields = self._disk_report
        self._SyncObj__transport.holds_entries = self._holds_entries

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
            fields = self._vote_fields()
            term_before = self._SyncObj__raftCurrentTerm
            self._SyncObj__transport.vote_fields = fields
            try:
                super()._onTick(0.0 if self._apply_behind else timeToWait)
            finally:
                self._SyncObj__transport.vote_fields = None
                self._after_tick(term_before, fields)
                if self._transfer_election_term is not None:
                    self._end_transfer_election()
            # Entries received in this tick's poll: synced, then acknowledged.
            self._sync_journal()
            if self._transfer_watch:
                self._transfer_tick()
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                # A full disk: the journal cut what it could not write (raftlog/journal.py);
                # this node pauses until there is room again, serving reads meanwhile.
                self._room_hit(f"writing {exc.filename or self._store.data_dir} failed: {exc}")
            elif exc.errno == errno.EIO:
                # pysyncobj's journal could not be written: logging and ticking on would leave
                # the node wedged, neither serving nor saying why.
                log.exception("the Raft journal could not be written")
                fatal(storage_fault(exc, self._store.data_dir))
            else:
                raise
        report = self.ticks.end()
        if report is not None:
            log.warning("%s", report.describe(self.ticks.slow_ms))

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
        paused = False
        try:
            while (applied := self._SyncObj__raftLastApplied) < target:
                size = self._entry_bytes(applied + 1)
                # Applying writes about the entry's bytes (CommitLog, ConsumeQueue, TimerLog):
                # only with room for twice that above the floor (raftlog/room.py).
                if not self._room_allows(2 * size):
                    paused = True
                    break
                self._SyncObj__raftCommitIndex = applied + 1
                need_send = super()._SyncObj__applyLogEntries() or need_send
                self.room_gauge.spent(size)
                if self._SyncObj__raftLastApplied == applied or time.monotonic() >= deadline:
                    break  # no progress (pysyncobj logged why), or this tick's time is up
        finally:
            self._SyncObj__raftCommitIndex = target
            self._commit_target = 0
        self._apply_behind = not paused and self._SyncObj__raftLastApplied < target
        return need_send

    def _entry_bytes(self, index: int) -> int:
        try:
            entries = self._SyncObj__getEntries(index, 1)
        except Exception:  # noqa: BLE001 - a size is only a hint here
            return 0
        return len(entries[0][0]) if entries else 0

    # ------------------------------------------------------------------ disk room

    def _disk_report(self) -> dict[str, Any]:
        """What a follower adds to its acknowledgements: its free and total bytes, and 1
        while it is paused (the leader then sends it no entries: :meth:`_holds_entries`)."""
        room = self.room_gauge.room()
        paused = int(self.room_watch.pause is not None)
        return {"disk": [room.free_bytes, room.total_bytes, paused]}

    def _holds_entries(self, node: Any) -> bool:
        """On the leader: True while ``node`` last said it is paused (recently)."""
        address = getattr(node, "id", None)
        report = None if address is None else self.peer_paused.get(address)
        return report is not None and time.monotonic() - report < PAUSE_REPORT_S

    def _room_allows(self, need_bytes: int) -> bool:
        was = self.room_watch.pause
        ok = self.room_watch.allows(self.room_gauge.room(), need_bytes, time.monotonic())
        self._room_changed(was)
        return ok

    def _room_hit(self, reason: str) -> None:
        was = self.room_watch.pause
        self.room_watch.hit(reason, time.monotonic())
        self._room_changed(was)

    def _room_changed(self, was: Any) -> None:
        now = self.room_watch.pause
        if was is None and now is not None:
            room = self.room_gauge.room()
            log.error(
                "disk of %s nearly full (%s): this node stops taking Raft entries, applying "
                "them and proposing, and keeps serving reads of what it holds; it resumes by "
                "itself once %.1f MiB are free (retention, a compacted journal, a larger disk). "
                "Nothing is lost: what it did not take stays in the leader's log",
                self._store.data_dir,
                now.reason,
                resume_bytes(room.total_bytes) / 2**20,
            )
        elif was is not None and now is None:
            log.warning(
                "disk of %s has room again (%.1f MiB free) after %.1f s: this node takes Raft "
                "entries and applies them again",
                self._store.data_dir,
                self.room_gauge.room().free_bytes / 2**20,
                time.monotonic() - was.since_s,
            )

    def _room_for_append(self, message: dict[str, Any]) -> dict[str, Any]:
        """A leader's append message as this node takes it: while there is no room for what
        it carries, as a bare heartbeat (the leader is still heard, nothing is written, and the
        leader sends the entries again later). A large entry or a snapshot sent in parts whose
        first part was not taken is not taken until its next first part."""
        transmission = message.get("transmission")
        chunk = message.get("serialized")
        if transmission is not None:
            size = len(message.get("data") or b"")
            first = transmission == "start"
        elif "serialized" in message:
            size = len(chunk[0]) if isinstance(chunk, tuple | list) and chunk else 0
            first = bool(chunk[1]) if isinstance(chunk, tuple | list) and len(chunk) > 1 else True
        else:
            size = sum(len(e[0]) for e in message.get("entries") or ())
            first = True
        parted = transmission is not None or "serialized" in message
        if (first or not (parted and self._skip_parts)) and self._room_allows(size):
            if parted and first:
                self._skip_parts = False
            self.room_gauge.spent(size)
            return message
        if parted:
            last = transmission == "finish" or (
                isinstance(chunk, tuple | list) and len(chunk) > 2 and bool(chunk[2])
            )
            self._skip_parts = not last  # its next parts are not taken either
        return transport.without_entries(message)

    def room_paused(self) -> bool:
        """True while this node takes no entries for want of disk room (raftlog/room.py)."""
        if self.room_watch.pause is None:
            return False
        return not self._room_allows(0)

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

    def leader_heard_s(self) -> float | None:
        """When (pysyncobj's monotonic clock, see :meth:`monotonic_s`) an append message from
        a leader last arrived; None before the first."""
        return self._leader_heard_s

    @staticmethod
    def monotonic_s() -> float:
        return float(_pso_monotonic())

    @property
    def wire_version(self) -> int:
        """The Raft wire version this node advertises in its hello."""
        return int(self._SyncObj__transport.context.settings.wire_version)

    def advertise(self, fields: Callable[[], dict[str, Any]]) -> None:
        """Add ``fields()`` to every append message this node sends as leader."""
        self._SyncObj__transport.append_fields = fields

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
            self._heard_leader(node)
            # A message without the field (a leader that never sets it) is taken at its word.
            self.leader_lease = bool(message.get("lease", True))
            if self.removal is not None:
                self._readmitted(node)
            message = self._room_for_append(message)
        if kind == "next_node_idx":
            disk = message.get("disk")
            if (
                isinstance(disk, list)
                and len(disk) in (2, 3)
                and all(isinstance(v, int) and not isinstance(v, bool) for v in disk)
            ):
                now = time.monotonic()
                self.peer_rooms[node.id] = (
                    Room(disk[0], disk[1]),
                    now,
                    self._store.commitlog.length,
                )
                if len(disk) == 3 and disk[2]:
                    self.peer_paused[node.id] = now
                else:
                    self.peer_paused.pop(node.id, None)
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

    def _checkCommandsToApply(self) -> None:  # noqa: N802 - pysyncobj's name
        if self._proposals_held():
            return
        if self._SyncObj__raftState == _RAFT_STATE_LEADER and self.room_paused():
            return  # no room for our own journal: proposals wait (raftlog/room.py)
        super()._checkCommandsToApply()
        # One fdatasync for every command proposed in this tick (while the last sync ran,
        # more arrived: RocketMQ's GroupCommitService), on the group-commit thread while
        # this one polls for the followers' answers; the tick waits for it before counting
        # this node towards a commit.
        journal = self._journal
        if self._group_sync and journal is not None:
            journal.start_sync()

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
            fatal(storage_fault(exc, self._store.data_dir))
        except Exception as exc:  # a failed apply would leave this replica diverged
            # Store.apply rejects whatever a command does wrong; what reaches here is a fault
            # of this node's files or settings.
            log.exception("apply failed at index %d", self.raftLastApplied + 1)
            fatal(fault_message(exc, self._cfg.data_dir))
        finally:
            self.ticks.applied(time.monotonic() - started)

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
            "disk_paused": None if self.room_watch.pause is None else self.room_watch.pause.reason,
            "peer_versions": {
                address: v.as_json()
                for address, v in list(self._SyncObj__transport.context.versions.peers.items())
            },
            "prevotes_started": self.prevotes_started,
            "prevotes_won": self.prevotes_won,
            "fast_prevotes_started": self.fast_prevotes_started,
            "votes_ignored": self.votes_ignored,
            "campaign": (
                None
                if self.campaign is None
                else {"term": self.campaign[0], "detected_by": self.campaign[1]}
            ),
        }
