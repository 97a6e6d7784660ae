"""The replicated store: CommitLog, ConsumeQueues and the small replicated tables.

:meth:`Store.apply` is the state machine's transition. It is deterministic: the same command
sequence gives byte-identical CommitLogs and equal tables on every node. It knows nothing of
Raft; :mod:`raftlog.machine` feeds it committed commands.

The snapshot (:meth:`Store.snapshot`) is *thin*: the CommitLog length and hash chain
(:mod:`raftlog.chain`), the tables, and a digest of the last 64 KiB, never the CommitLog itself.
A node restoring one truncates its CommitLog to that length or fetches the missing bytes from a
peer (:meth:`Store.restore`), and accepts fetched bytes only when they extend its own chain to
the snapshot's.

Registered apply extensions (:mod:`raftlog.extension`) apply ``EXTENSION`` commands; their
derived records are placed like produced ones and their state lives in ``kv``.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import itertools
import logging
import os
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from raftlog import command as cmdcodec
from raftlog import record
from raftlog.chain import BLOCK_BYTES, Chain, RangeCheck
from raftlog.commitlog import CommitLog
from raftlog.consumequeue import UNIT, ConsumeQueueStore, CqUnit
from raftlog.errors import StoreCorruption
from raftlog.extension import ApplyContext, ApplyExtension, DerivedRecord, check_name

log = logging.getLogger(__name__)

SNAPSHOT_MAGIC = b"CMQSNAP1"
#: 2: ``chain`` is :mod:`raftlog.chain`'s and ``chain_block`` is there. 1 (read only): a chain
#: over commands, which fetched bytes cannot be checked against.
SNAPSHOT_VERSION = 2
_SNAP_HEAD = struct.Struct(">8sQ32s")
TAIL_DIGEST_BYTES = 64 * 1024
COMPARE_WINDOW_BYTES = 1024 * 1024
DEFAULT_IDEMPOTENCY_WINDOW = 20_000
#: How long a command for an extension that is not registered yet waits for it.
DEFAULT_EXTENSION_WAIT_S = 60.0

# Outcome status of a batch.
OK = 0
CONDITION_FAILED = 1
BAD_QUEUE = 2


@dataclass(frozen=True, slots=True)
class Placed:
    """Where one message was stored."""

    msg_id: bytes
    topic: str
    queue_id: int
    queue_offset: int
    physical_offset: int
    size: int


def _placed(
    buf: bytearray,
    buf_at: list[int],
    phys: list[int],
    sizes: list[int],
    qoffs: list[int],
    cq_keys: list[tuple[str, int]],
    indexes: range,
) -> tuple[Placed, ...]:
    """Where records ``indexes`` of one :meth:`Store._write_records` call went."""
    return tuple(
        Placed(
            record.msg_id_at(buf, buf_at[i]),
            cq_keys[i][0],
            cq_keys[i][1],
            qoffs[i],
            phys[i],
            sizes[i],
        )
        for i in indexes
    )


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


@dataclass(frozen=True, slots=True)
class BatchOutcome:
    key: str
    status: int
    placed: tuple[Placed, ...] = ()
    duplicate: bool = False
    detail: str = ""


@dataclass(frozen=True, slots=True)
class ApplyResult:
    index: int
    kind: cmdcodec.Kind
    propose_ms: int
    outcomes: tuple[BatchOutcome, ...]
    bytes_written: int
    messages: int
    #: What an ``EXTENSION`` command's extension returned (``None`` for other kinds).
    ext: Any = None


class Store:
    def __init__(
        self,
        data_dir: str | os.PathLike[str],
        *,
        segment_bytes: int,
        flush: str = "async",
        idempotency_window: int = DEFAULT_IDEMPOTENCY_WINDOW,
    ) -> None:
        self.data_dir = Path(data_dir)
        self.commitlog = CommitLog(
            self.data_dir / "commitlog", segment_bytes=segment_bytes, flush=flush
        )
        self.cqs = ConsumeQueueStore(self.data_dir / "consumequeue")
        self.idempotency_window = idempotency_window
        self.flush = flush
        # Replicated tables. Written only by apply/restore (the Raft thread); read anywhere.
        self.topics: dict[str, list[int]] = {}  # topic -> next queue offset per queue
        self.kv: dict[str, int | str] = {}
        self.idem: OrderedDict[str, tuple[int, int, int]] = (
            OrderedDict()
        )  # key -> (phys, n, status)
        self._chain = Chain()
        self.applied_index = 0
        self.applied_length = 0
        #: Index and CommitLog length of the last snapshot written or restored here: a
        #: restart replays the journal from it, so retention keeps what that replay reads.
        self.snapshot_index = 0
        self.snapshot_length = 0
        self._lock = threading.Lock()
        self.listeners: list[Callable[[ApplyResult], None]] = []
        # Only the leader reads per-message results; followers skip building them.
        self.want_results: Callable[[], bool] = lambda: True
        # Apply extensions by name. The condition's lock serialises everything an extension
        # does (attach, apply, before_snapshot); apply waits on it for a late registration.
        self.extensions: dict[str, ApplyExtension] = {}
        self._ext_cond = threading.Condition(threading.RLock())
        self.extension_wait_s = DEFAULT_EXTENSION_WAIT_S

    # ------------------------------------------------------------------ queries

    @property
    def chain(self) -> bytes:
        """The hash chain of the CommitLog's ``applied_length`` bytes (:mod:`raftlog.chain`)."""
        return self._chain.value()

    def digest(self) -> dict[str, object]:
        """What replicas compare: equal ``length`` and ``chain`` mean equal CommitLog bytes."""
        return {
            "index": self.applied_index,
            "length": self.applied_length,
            "chain": self.chain.hex(),
        }

    def queue_count(self, topic: str) -> int | None:
        queues = self.topics.get(topic)
        return None if queues is None else len(queues)

    def max_offset(self, topic: str, queue_id: int) -> int:
        queues = self.topics.get(topic)
        if queues is None or queue_id >= len(queues):
            return 0
        return min(queues[queue_id], self.cqs.max_offset(topic, queue_id))

    def min_offset(self, topic: str, queue_id: int) -> int:
        """The first queue offset whose message the CommitLog still holds (retention)."""
        return self.cqs.min_offset(topic, queue_id, self.commitlog.min_offset)

    def read_units(self, topic: str, queue_id: int, offset: int, max_units: int) -> list[CqUnit]:
        end = self.max_offset(topic, queue_id)
        max_units = min(max_units, end - offset)
        if max_units <= 0:
            return []
        return self.cqs.read(topic, queue_id, offset, max_units)

    def read_messages(
        self, topic: str, queue_id: int, offset: int, max_units: int
    ) -> list[record.Message]:
        """Messages from ``offset`` on; below the queue's minimum (deleted by retention) from
        the minimum, as RocketMQ answers a pull below it."""
        for _attempt in range(3):
            start = max(offset, self.min_offset(topic, queue_id))
            try:
                return [
                    self.commitlog.read_message(u.commitlog_offset, u.size)
                    for u in self.read_units(topic, queue_id, start, max_units)
                ]
            except IndexError:
                if start >= self.min_offset(topic, queue_id):
                    raise
                # Retention deleted the segment between the two reads: from the new minimum.
        raise IndexError(f"{topic}/{queue_id} keeps losing its head to retention")

    # ------------------------------------------------------------------ extensions

    def register_extension(self, ext: ApplyExtension) -> None:
        """Register an apply extension: align it to the current state, then let its commands
        (which may be waiting already) apply."""
        name = check_name(ext.name)
        with self._ext_cond:
            if name in self.extensions:
                raise ValueError(f"an extension named {name!r} is registered already")
            ext.attach(self)
            self.extensions[name] = ext
            self._ext_cond.notify_all()

    def _extension(self, name: str) -> ApplyExtension:
        """The extension for ``name``, waiting for it to register (the caller holds the lock)."""
        deadline = time.monotonic() + self.extension_wait_s
        while name not in self.extensions:
            left = deadline - time.monotonic()
            if left <= 0:
                raise StoreCorruption(
                    f"a command for apply extension {name!r} arrived, but no such extension "
                    f"registered within {self.extension_wait_s} s: this node cannot apply it"
                )
            log.info("waiting for apply extension %r to register", name)
            self._ext_cond.wait(min(left, 1.0))
        return self.extensions[name]

    def _apply_extension(self, cmd: cmdcodec.Command, index: int) -> ApplyResult:
        extra = cmd.extra
        name = extra.get("e") if isinstance(extra, Mapping) else None
        if not isinstance(name, str):
            raise StoreCorruption("extension command without an extension name")
        with self._ext_cond:
            ext = self._extension(name)
            ctx = ApplyContext(self, index, cmd.propose_ms)
            out = ext.apply(ctx, extra.get("p"))
        self.applied_index = index
        result = ApplyResult(
            index, cmd.kind, cmd.propose_ms, (), ctx.bytes_written, ctx.messages, ext=out
        )
        self._notify(result)
        return result

    def _append_derived(self, records: Iterable[DerivedRecord]) -> list[Placed]:
        """Place records an extension derived in apply (see :class:`ApplyContext`)."""
        sizes: list[int] = []
        qoffs: list[int] = []
        cq_keys: list[tuple[str, int]] = []
        parts: list[bytes | bytearray] = []
        for r in records:
            queues = self.topics.get(r.topic)
            if queues is None or not 0 <= r.queue_id < len(queues):
                raise StoreCorruption(
                    f"extension record for topic {r.topic} queue {r.queue_id}, which does not exist"
                )
            qoffs.append(queues[r.queue_id])
            queues[r.queue_id] += 1
            sizes.append(len(r.data))
            cq_keys.append((r.topic, r.queue_id))
            parts.append(r.data)
        buf = bytearray(b"".join(parts))
        phys, buf_at = self._write_records(buf, sizes, qoffs, cq_keys)
        return list(_placed(buf, buf_at, phys, sizes, qoffs, cq_keys, range(len(sizes))))

    def _write_records(
        self,
        buf: bytearray,
        sizes: list[int],
        qoffs: list[int],
        cq_keys: list[tuple[str, int]],
    ) -> tuple[list[int], list[int]]:
        """Append records packed in ``buf`` to the CommitLog, index them in their
        ConsumeQueues and extend the hash chain; return physical offsets and where each record
        starts in ``buf``."""
        start_len = self.commitlog.length
        phys = self.commitlog.append_records(buf, sizes, qoffs) if sizes else []
        end_len = self.commitlog.length
        # Where each record starts in buf.
        buf_at = list(itertools.accumulate(sizes[:-1], initial=0)) if sizes else []
        # ConsumeQueue units, one write per queue.
        if sizes:
            grouped: dict[tuple[str, int], list[bytes]] = {}
            first: dict[tuple[str, int], int] = {}
            for i, qkey in enumerate(cq_keys):
                tags_code = record.tags_code_at(buf, buf_at[i])
                grouped.setdefault(qkey, []).append(UNIT.pack(phys[i], sizes[i], tags_code))
                first.setdefault(qkey, qoffs[i])
            for qkey, units in grouped.items():
                self.cqs.append(qkey[0], qkey[1], first[qkey], b"".join(units))
        if end_len - start_len == len(buf):
            self._chain.update(buf)
        else:  # blank records pad a segment's end (once a segment): hash what was written
            self._chain.update(self.commitlog.read_range(start_len, end_len))
        self.applied_length = end_len
        return phys, buf_at

    # ------------------------------------------------------------------ apply

    def apply(self, data: bytes, index: int) -> ApplyResult:
        """Apply the committed command ``data`` at Raft index ``index``."""
        cmd = cmdcodec.decode(data)
        if cmd.kind is cmdcodec.Kind.BARRIER:
            self.applied_index = index
            result = ApplyResult(index, cmd.kind, cmd.propose_ms, (), 0, 0)
            self._notify(result)
            return result
        if cmd.kind is cmdcodec.Kind.EXTENSION:
            return self._apply_extension(cmd, index)
        topics = cmd.topics
        messages = cmd.messages
        blob = cmd.blob
        outcomes: list[BatchOutcome | None] = []
        keep: list[tuple[int, int]] = []  # byte ranges of accepted records in blob
        sizes: list[int] = []
        qoffs: list[int] = []
        cq_keys: list[tuple[str, int]] = []
        pending_idem: list[tuple[int, str, int, int]] = []  # (outcome idx, key, first msg, count)
        seen_now: dict[str, int] = {}  # key -> index of its first outcome in this command
        repeats: list[tuple[int, int]] = []  # (outcome idx, outcome idx of the first occurrence)
        msg_at = 0
        byte_at = 0
        for batch in cmd.batches:
            span = messages[msg_at : msg_at + batch.count]
            span_bytes = sum(m[2] for m in span)
            start_byte = byte_at
            msg_at += batch.count
            byte_at += span_bytes
            if batch.key in seen_now:
                # Repeated inside this command: its first occurrence is not remembered yet.
                repeats.append((len(outcomes), seen_now[batch.key]))
                outcomes.append(None)
                continue
            if batch.key in self.idem:
                outcomes.append(self._replay(batch.key))
                continue
            seen_now[batch.key] = len(outcomes)
            failed = self._check_expect(batch.expect)
            if failed is not None:
                outcomes.append(BatchOutcome(batch.key, CONDITION_FAILED, detail=failed))
                self._remember(batch.key, (0, 0, CONDITION_FAILED))
                continue
            creates = batch.creates or {}
            bad = next(
                (m for m in span if m[1] >= self._queue_count(topics[m[0]], creates)),
                None,
            )
            if bad is not None:
                detail = f"topic {topics[bad[0]]} has no queue {bad[1]}"
                outcomes.append(BatchOutcome(batch.key, BAD_QUEUE, detail=detail))
                self._remember(batch.key, (0, 0, BAD_QUEUE))
                continue
            for topic, n in creates.items():
                if topic not in self.topics:
                    self.topics[topic] = [0] * int(n)
            if batch.updates:
                for k, v in batch.updates.items():
                    if v is None:
                        self.kv.pop(k, None)
                    else:
                        self.kv[k] = v
            for tidx, qid, size in span:
                queues = self.topics[topics[tidx]]
                qoffs.append(queues[qid])
                queues[qid] += 1
                sizes.append(size)
                cq_keys.append((topics[tidx], qid))
            keep.append((start_byte, start_byte + span_bytes))
            pending_idem.append((len(outcomes), batch.key, len(sizes) - len(span), len(span)))
            outcomes.append(None)
        buf = (
            bytearray(blob)
            if len(keep) == 1 and keep[0] == (0, len(blob))
            else bytearray(b"".join(blob[a:b] for a, b in keep))
        )
        start_len = self.commitlog.length
        phys, buf_at = self._write_records(buf, sizes, qoffs, cq_keys)
        end_len = self.commitlog.length
        # Outcomes of accepted batches, and their idempotency entries.
        want = self.want_results()
        for out_idx, key, first_i, count in pending_idem:
            placed = (
                _placed(buf, buf_at, phys, sizes, qoffs, cq_keys, range(first_i, first_i + count))
                if want
                else ()
            )
            outcomes[out_idx] = BatchOutcome(key, OK, placed)
            self._remember(key, (phys[first_i] if count else 0, count, OK))
        for out_idx, first_idx in repeats:
            original = outcomes[first_idx]
            assert original is not None
            outcomes[out_idx] = dataclasses.replace(original, duplicate=True)
        self.applied_index = index
        result = ApplyResult(
            index,
            cmd.kind,
            cmd.propose_ms,
            tuple(o for o in outcomes if o is not None),
            end_len - start_len,
            len(sizes),
        )
        self._notify(result)
        return result

    def _notify(self, result: ApplyResult) -> None:
        for listener in self.listeners:
            try:
                listener(result)
            except Exception:  # a listener must never break apply
                log.exception("apply listener failed")

    def _queue_count(self, topic: str, creates: Mapping[str, int]) -> int:
        """Queues of ``topic``, counting a creation the batch carries (applied only if it is accepted)."""
        queues = self.topics.get(topic)
        return len(queues) if queues is not None else int(creates.get(topic, 0))

    def _check_expect(self, expect: Mapping[str, cmdcodec.Scalar] | None) -> str | None:
        if not expect:
            return None
        for k, want in expect.items():
            have = self.kv.get(k)
            if have != want:
                return f"{k} is {have!r}, expected {want!r}"
        return None

    def _remember(self, key: str, entry: tuple[int, int, int]) -> None:
        self.idem[key] = entry
        while len(self.idem) > self.idempotency_window:
            self.idem.popitem(last=False)

    def _replay(self, key: str) -> BatchOutcome:
        """The outcome of a batch applied before, rebuilt from the CommitLog."""
        phys, count, status = self.idem.get(key, (0, 0, OK))
        if status != OK or count == 0:
            return BatchOutcome(key, status, duplicate=True, detail="repeated request")
        if phys < self.commitlog.min_offset:  # retention deleted it: the key is still honoured
            return BatchOutcome(key, OK, duplicate=True, detail="placement no longer held")
        placed: list[Placed] = []
        for at, data in self.commitlog.iter_records(phys):
            msg = record.decode(data)
            placed.append(
                Placed(msg.msg_id, msg.topic, msg.queue_id, msg.queue_offset, at, msg.size)
            )
            if len(placed) == count:
                break
        return BatchOutcome(key, OK, tuple(placed), duplicate=True)

    # ------------------------------------------------------------------ snapshot

    def snapshot(self, raft: Mapping[str, object]) -> bytes:
        """The thin snapshot file's bytes; ``raft`` holds what pysyncobj needs back."""
        if self.flush == "sync":
            self.commitlog.sync()
            self.cqs.sync()
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
                "chain": self.chain.hex(),
                "chain_block": self._chain.block_chain.hex(),
                "segment_bytes": self.commitlog.segment_bytes,
                "topics": self.topics,
                "kv": self.kv,
                "idem": [[k, *v] for k, v in self.idem.items()],
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
        if snap.get("v") not in (1, SNAPSHOT_VERSION):
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
        elif have > length or have == length:
            self.commitlog.truncate(length)
            self._chain = self._local_chain(length, bytes.fromhex(str(snap["chain_block"])))
            if self._chain.value().hex() != snap["chain"]:
                raise StoreCorruption(
                    f"the CommitLog's last block before {length} differs from the snapshot's "
                    "hash chain: replica diverged"
                )
        else:
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
                "the CommitLog's last 64 KiB differ from the snapshot's: replica diverged"
            )
        topics = {t: list(q) for t, q in snap["topics"].items()}
        expected = {(t, i): n for t, qs in topics.items() for i, n in enumerate(qs)}
        self.cqs.repair(self.commitlog, expected)
        self.topics = topics
        self.kv = dict(snap["kv"])
        self.idem = OrderedDict((k, (p, n, s)) for k, p, n, s in snap["idem"])
        self.applied_index = int(snap["index"])
        self.applied_length = length
        self.snapshot_index, self.snapshot_length = self.applied_index, length
        self._reattach_extensions()

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

    def _reattach_extensions(self) -> None:
        with self._ext_cond:
            for ext in self.extensions.values():
                ext.attach(self)

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

    def reset(self) -> None:
        """Empty state: used before pysyncobj replays a journal from its start."""
        self.commitlog.truncate(0)
        self.cqs.repair(self.commitlog, {})
        self.topics = {}
        self.kv = {}
        self.idem = OrderedDict()
        self._chain = Chain()
        self.applied_index = 0
        self.applied_length = 0
        self.snapshot_index = self.snapshot_length = 0
        self._reattach_extensions()

    def close(self) -> None:
        with self._ext_cond:
            for ext in self.extensions.values():
                try:
                    ext.close()
                except Exception:
                    log.exception("closing apply extension %s failed", ext.name)
        self.cqs.close()
        self.commitlog.close()


def encode_entry(entry: tuple[bytes, int, int]) -> list[object]:
    return [base64.b64encode(entry[0]).decode(), entry[1], entry[2]]


def decode_entry(data: Iterable[Any]) -> tuple[bytes, int, int]:
    cmd, idx, term = data
    return base64.b64decode(str(cmd)), int(idx), int(term)
