"""The Raft machine's snapshots: thin dumps written and installed on pysyncobj's tick thread.

With a custom serializer pysyncobj calls ``serializer(path, (entry_S, entry_S-1, cluster))``
on the thread that applies, so the store's state is exactly that at index S; the dump is the
store's thin snapshot (:meth:`chronomq.raftlog.store.Store.snapshot`: lengths, hash chain,
small tables) and the two Raft entries. ``deserializer(path)`` restores it (fetching what the
CommitLog lacks from a peer over the catch-up channel, :mod:`chronomq.raftlog.catchup`), or
keeps what this follower already applied past it, and gives the three back. At start a
snapshot that cannot be read refuses the start; later, a received one that fails its checks
is rejected.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from pysyncobj import SyncObj
from pysyncobj.monotonic import monotonic as _pso_monotonic
from pysyncobj.transport import TCPNode

from chronomq.raftlog import catchup, durable
from chronomq.raftlog.config import RaftConfig, host_port
from chronomq.raftlog.errors import StoreCorruption
from chronomq.raftlog.journal import DurableJournal
from chronomq.raftlog.journalcheck import journal_advice
from chronomq.raftlog.machine_faults import fatal, refuse
from chronomq.raftlog.snapshot import FetchTarget, decode_entry, encode_entry
from chronomq.raftlog.store import Store
from chronomq.raftlog.ticks import TickWatch

# One component, one logger: these lines are the Raft machine's.
log = logging.getLogger("chronomq.raftlog.machine")


class SnapshotHooks(SyncObj):
    """Snapshot serializer and deserializer, mixed into the Raft machine."""

    # pysyncobj's private state read and written here.
    _SyncObj__raftElectionDeadline: float
    # The machine's.
    _cfg: RaftConfig
    _store: Store
    _journal: DurableJournal | None
    _started: bool
    ticks: TickWatch

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
                refuse(
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
            fatal(f"restoring a snapshot failed: {exc}")
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
        return [host_port(p.fetch) for p in ordered]

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
