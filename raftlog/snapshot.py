"""The thin snapshot: its file, and how a store is written into one and restored from one.

The file::

    +------------------+----------------+------------------------+-----------------------+
    | magic (8 bytes)  | payload length | SHA-256 of the payload | payload (JSON)        |
    | CMQSNAP1         | u64, big-end.  | 32 bytes               | length bytes          |
    +------------------+----------------+------------------------+-----------------------+

The payload holds the CommitLog length and hash chain (:mod:`chronomq.raftlog.chain`), the
replicated tables, a digest of the last 64 KiB, and the two Raft entries pysyncobj needs back
(:func:`encode_entry`), never the CommitLog itself. A node restoring one truncates its
CommitLog to that length or fetches the missing bytes from a peer through a
:class:`FetchTarget`, and accepts fetched bytes only when they extend its own chain to the
snapshot's.

:class:`SnapshotState` is the part of :class:`chronomq.raftlog.store.Store` that writes and
restores snapshots; it uses the store's fields, declared below.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import os
import struct
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import orjson

from chronomq.raftlog import clientkeys
from chronomq.raftlog.chain import BLOCK_BYTES, Chain, RangeCheck
from chronomq.raftlog.commitlog import CommitLog
from chronomq.raftlog.consumequeue import ConsumeQueueStore
from chronomq.raftlog.errors import StoreCorruption
from chronomq.raftlog.extension import ApplyExtension

log = logging.getLogger(__name__)

SNAPSHOT_MAGIC = b"CMQSNAP1"
#: 3: ``chain`` is :mod:`chronomq.raftlog.chain`'s, ``chain_block`` is there and ``clients`` holds
#: the client idempotency keys (:data:`.clientkeys.CLIENT_ENTRY`, base64). 1 (read only: the
#: builds up to November 24, 2026 wrote it, and a whole cluster stopped on one of them starts on
#: this one): a chain over commands, which fetched bytes cannot be checked against, and every
#: key in ``idem``. 2 was written by no release and by no build a cluster may be upgraded from:
#: it is refused.
SNAPSHOT_VERSION = 3
#: The versions :meth:`SnapshotState.parse_snapshot` reads.
READ_VERSIONS = (1, SNAPSHOT_VERSION)
_SNAP_HEAD = struct.Struct(">8sQ32s")
TAIL_DIGEST_BYTES = 64 * 1024
COMPARE_WINDOW_BYTES = 1024 * 1024


class FetchTarget:
    """Where CommitLog bytes fetched from peers go while a snapshot is restored.

    Bytes are appended to the CommitLog's files past the store's length (nothing serves or
    indexes them there) and fed to a :class:`RangeCheck` as they come. The store takes them
    only when :meth:`verdict` says they extend its chain to the snapshot's; otherwise
    :meth:`rewind` cuts them off again, so bytes that fail the chain are never part of the
    store. The fetcher writes each peer's bytes in order and checks at the end of the range.
    """

    def __init__(self, commitlog: CommitLog, check: RangeCheck) -> None:
        if commitlog.length != check.start:
            raise ValueError(f"the CommitLog ends at {commitlog.length}, not at {check.start}")
        self._commitlog = commitlog
        self._check = check

    @property
    def start(self) -> int:
        return self._check.start

    @property
    def end(self) -> int:
        return self._check.end

    @property
    def position(self) -> int:
        return self._check.position

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Append the next fetched bytes (at :attr:`position`)."""
        at = self._check.position
        if at + len(data) > self._check.end:
            raise ValueError(f"{len(data)} bytes at {at} run past {self._check.end}")
        self._commitlog.write_raw(at, data)
        self._check.update(data)

    def verdict(self) -> str | None:
        """None when ``[start, end)`` is complete and matches the chain; else what is wrong."""
        return self._check.verdict()

    def rewind(self) -> None:
        """Throw away every byte written since :attr:`start`."""
        self._commitlog.truncate(self._check.start)
        self._check.rewind()

    def chain(self) -> Chain:
        return self._check.chain()


class SnapshotState:
    """Writing and restoring the thin snapshot of a store (a base of ``Store``)."""

    commitlog: CommitLog
    cqs: ConsumeQueueStore
    flush: str
    topics: dict[str, list[int]]
    kv: dict[str, int | str]
    idem: OrderedDict[str, tuple[int, int, int]]
    clients: OrderedDict[bytes, bytes]
    applied_index: int
    applied_length: int
    snapshot_index: int
    snapshot_length: int
    settled: bool
    extensions: dict[str, ApplyExtension]
    _chain: Chain
    _ext_cond: threading.Condition

    def snapshot(self, raft: Mapping[str, object]) -> bytes:
        """The thin snapshot file's bytes; ``raft`` holds what pysyncobj needs back."""
        self.sync()
        with self._ext_cond:
            for ext in self.extensions.values():
                ext.before_snapshot(self.applied_index)
        length = self.applied_length
        tail_from = max(0, length - TAIL_DIGEST_BYTES)
        payload = orjson.dumps(
            {
                "v": SNAPSHOT_VERSION,
                "index": self.applied_index,
                "length": length,
                "chain": self._chain.value().hex(),
                "chain_block": self._chain.block_chain.hex(),
                "segment_bytes": self.commitlog.segment_bytes,
                "topics": self.topics,
                "kv": self.kv,
                "idem": [[k, *v] for k, v in self.idem.items()],
                "clients": base64.b64encode(b"".join(self.clients.values())).decode(),
                "tail_from": tail_from,
                "tail_digest": self._range_digest(tail_from, length),
                "raft": raft,
            }
        )
        self.snapshot_index, self.snapshot_length = self.applied_index, length
        return (
            _SNAP_HEAD.pack(SNAPSHOT_MAGIC, len(payload), hashlib.sha256(payload).digest())
            + payload
        )

    def sync(self) -> None:
        """Make the CommitLog (and, under ``flush="sync"``, the ConsumeQueues) durable: a
        snapshot must never cover bytes a power cut can take away, since the journal
        entries it replaces are dropped after it."""
        self.commitlog.sync()  # a failed fsync stops the node there (chronomq.raftlog.durable)
        if self.flush == "sync":
            self.cqs.sync()

    def _range_digest(self, start: int, end: int) -> str:
        h = hashlib.sha256()
        for fd, off, n in self.commitlog.ranges(start, end):
            h.update(os.pread(fd, n, off))
        return h.hexdigest()

    @staticmethod
    def parse_snapshot(data: bytes) -> dict[str, Any]:
        """Check a snapshot's magic, length and hash; return its payload."""
        if len(data) < _SNAP_HEAD.size:
            raise StoreCorruption(f"snapshot is {len(data)} bytes, shorter than its header")
        magic, length, digest = _SNAP_HEAD.unpack_from(data, 0)
        if magic != SNAPSHOT_MAGIC:
            raise StoreCorruption("snapshot has a bad magic")
        payload = data[_SNAP_HEAD.size :]
        if len(payload) != length:
            raise StoreCorruption(
                f"snapshot payload is {len(payload)} bytes, its header says {length}"
            )
        if hashlib.sha256(payload).digest() != digest:
            raise StoreCorruption("snapshot fails its hash")
        snap = orjson.loads(payload)
        if snap.get("v") not in READ_VERSIONS:
            raise StoreCorruption(f"snapshot version {snap.get('v')} is not supported")
        return snap

    def restore(
        self,
        snap: Mapping[str, Any],
        fetch: Callable[[FetchTarget], None],
        peer_bytes: Callable[[int, int], bytes | None] | None = None,
    ) -> None:
        """Make this store exactly the snapshot's state.

        The CommitLog is truncated to the snapshot's length, or the missing bytes are
        fetched by ``fetch(target)``, which appends them through ``target`` (a
        :class:`FetchTarget`: it checks them against the snapshot's hash chain, and throws away
        bytes that fail it). Before fetching, the local tail is compared with a peer's
        (``peer_bytes(start, end)``, None when no peer answers); a CommitLog that differs is
        discarded and fetched whole, as is one whose chain this node does not know (at start,
        with a CommitLog shorter than the snapshot's). Then the chain and the tail digest are
        checked and ConsumeQueues are cut or rebuilt to match.
        """
        length = int(snap["length"])
        if snap["segment_bytes"] != self.commitlog.segment_bytes:
            raise StoreCorruption(
                f"snapshot was taken with commitlog_segment_bytes={snap['segment_bytes']}, "
                f"this node has {self.commitlog.segment_bytes}: the setting must be equal on all nodes"
            )
        # Nothing past this is served to peers until the store is restored.
        self.applied_length = min(self.applied_length, self.commitlog.length)
        have = self.commitlog.length
        if 0 < have < length and peer_bytes is not None and not self._tail_agrees(have, peer_bytes):
            # Where the tail departs is not known, and a later window can match by chance
            # (segment padding): start again from an empty CommitLog.
            log.error(
                "the local CommitLog's last bytes before %d differ from a peer's: "
                "discarding it and fetching all %d bytes again",
                have,
                length,
            )
            have = self._discard_commitlog()
        if 0 < have < length and self._chain.length != have:
            log.warning(
                "the local CommitLog's %d bytes have no known hash chain (not applied since "
                "start): discarding them and fetching all %d bytes, so that every byte is checked",
                have,
                length,
            )
            have = self._discard_commitlog()
        if snap["v"] == 1:
            self._restore_v1_chain(snap, fetch)
            have = length
        elif have >= length:
            damage = self._local_prefix_damage(snap)
            if damage is not None:
                # A damaged CommitLog (a torn or corrupted file, a diverged tail): the peers
                # hold the same bytes; fetch them all again, each checked against the chain.
                log.error(
                    "the CommitLog in %s does not match the snapshot at index %s (%s): "
                    "discarding it and fetching all %d bytes again from a peer",
                    self.commitlog.directory,
                    snap["index"],
                    damage,
                    length,
                )
                have = self._discard_commitlog()
        if have < length:
            log.info(
                "CommitLog is %d bytes, snapshot needs %d: fetching the rest from a peer",
                have,
                length,
            )
            target = FetchTarget(
                self.commitlog,
                RangeCheck(self._chain, length, bytes.fromhex(str(snap["chain"]))),
            )
            try:
                fetch(target)
            except BaseException:
                target.rewind()  # what was fetched so far is not checked: never keep it
                raise
            failed = target.verdict()
            if failed is not None:
                target.rewind()
                raise StoreCorruption(f"fetching the CommitLog failed: {failed}")
            self._chain = target.chain()
        tail_from = int(snap["tail_from"])
        if self._range_digest(tail_from, length) != snap["tail_digest"]:
            raise StoreCorruption(
                f"the CommitLog in {self.commitlog.directory}: its last 64 KiB before {length} "
                "differ from the snapshot's: replica diverged"
            )
        topics = {t: list(q) for t, q in snap["topics"].items()}
        expected = {(t, i): n for t, qs in topics.items() for i, n in enumerate(qs)}
        self.cqs.repair(self.commitlog, expected)
        self.topics = topics
        self.kv = dict(snap["kv"])
        self.idem = OrderedDict((k, (p, n, s)) for k, p, n, s in snap["idem"])
        self.clients = clientkeys.clients_from(snap.get("clients", ""))
        self.applied_index = int(snap["index"])
        self.applied_length = length
        self.settled = True
        self.snapshot_index, self.snapshot_length = self.applied_index, length
        self._reattach_extensions()

    def _local_prefix_damage(self, snap: Mapping[str, Any]) -> str | None:
        """Cut the local CommitLog to the snapshot's length and check it there: None when its
        hash chain and last 64 KiB are the snapshot's (the chain is then set), else what
        differs."""
        length = int(snap["length"])
        self.commitlog.truncate(length)
        try:
            chain = self._local_chain(length, bytes.fromhex(str(snap["chain_block"])))
            if chain.value().hex() != snap["chain"]:
                return f"its last block before {length} fails the snapshot's hash chain"
            tail_from = int(snap["tail_from"])
            if self._range_digest(tail_from, length) != snap["tail_digest"]:
                return f"its last 64 KiB before {length} differ from the snapshot's"
        except (OSError, StoreCorruption) as exc:
            return f"reading it failed: {exc}"
        self._chain = chain
        return None

    def _discard_commitlog(self) -> int:
        self.commitlog.truncate(0)
        self.cqs.repair(self.commitlog, {})
        self._chain = Chain()
        self.applied_length = 0
        return 0

    def _local_chain(self, length: int, block_chain: bytes) -> Chain:
        """The chain at ``length`` from a snapshot's block chain and the local last block."""
        start = length - length % BLOCK_BYTES
        return Chain(length, block_chain, self.commitlog.read_range(start, length))

    def _restore_v1_chain(
        self, snap: Mapping[str, Any], fetch: Callable[[FetchTarget], None]
    ) -> None:
        """A snapshot written before the chain covered the byte stream: its chain cannot
        check fetched bytes, so only the tail digest does, and the chain is recomputed."""
        length = int(snap["length"])
        have = self.commitlog.length
        if have >= length:
            self.commitlog.truncate(length)
        else:
            log.warning(
                "snapshot format 1 has no hash chain to check fetched bytes against: "
                "CommitLog [%d, %d) is checked by its last 64 KiB only",
                have,
                length,
            )
            target = FetchTarget(self.commitlog, RangeCheck(self._chain, length, b""))
            fetch(target)
            if target.position != length:
                target.rewind()
                raise StoreCorruption(f"fetched CommitLog ends at {target.position}, not {length}")
        self._chain = Chain.over(
            os.pread(fd, n, off) for fd, off, n in self.commitlog.ranges(0, length)
        )

    def holds(
        self, snap: Mapping[str, Any], peer_bytes: Callable[[int, int], bytes | None]
    ) -> bool:
        """Whether this store already holds the snapshot's state and went on along the same
        history, so that restoring it would only take the store back.

        The CommitLog must be at least the snapshot's length and its bytes before that length
        must end as the snapshot's do (the same last 64 KiB, the check :meth:`restore`
        trusts). Bytes past that length must end as a peer's do at the same offsets
        (``peer_bytes(start, end)``, None when no peer has them all): a tail the cluster never
        committed can only end where the local CommitLog ends, and restoring the snapshot is
        what replaces such a tail. False when no peer answers.
        """
        length = int(snap["length"])
        have = self.applied_length
        if snap["segment_bytes"] != self.commitlog.segment_bytes:
            return False
        if have < length or self.commitlog.length != have:
            return False
        if self._range_digest(int(snap["tail_from"]), length) != snap["tail_digest"]:
            return False
        if have == length:
            return True
        start = max(length, have - COMPARE_WINDOW_BYTES)
        theirs = peer_bytes(start, have)
        return theirs is not None and theirs == self.commitlog.read_range(start, have)

    def _tail_agrees(self, have: int, peer_bytes: Callable[[int, int], bytes | None]) -> bool:
        """Whether the last bytes of the local CommitLog equal a peer's at the same offsets.

        Bytes a replica holds that the cluster never committed can only be a tail ending at
        ``have``, and its last record (ids, timestamps) cannot match another by chance. True
        when no peer answers: the fetch then fails, or the digest check catches a difference.
        """
        start = max(self.commitlog.min_offset, have - COMPARE_WINDOW_BYTES)
        theirs = peer_bytes(start, have)
        if theirs is None:
            return True
        return self.commitlog.read_range(start, have) == theirs

    def _reattach_extensions(self) -> None:
        raise NotImplementedError  # the store attaches its extensions


def encode_entry(entry: tuple[bytes, int, int]) -> list[object]:
    return [base64.b64encode(entry[0]).decode(), entry[1], entry[2]]


def decode_entry(data: Iterable[Any]) -> tuple[bytes, int, int]:
    cmd, idx, term = data
    return base64.b64decode(str(cmd)), int(idx), int(term)
