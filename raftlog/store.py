"""The replicated store: CommitLog, ConsumeQueues and the small replicated tables.

:meth:`Store.apply` is the state machine's transition. It is deterministic: the same command
sequence gives byte-identical CommitLogs and equal tables on every node. It knows nothing of
Raft; :mod:`chronomq.raftlog.machine` feeds it committed commands.

The snapshot (:meth:`Store.snapshot`) is *thin*: the CommitLog length and hash chain
(:mod:`chronomq.raftlog.chain`), the tables, and a digest of the last 64 KiB, never the CommitLog itself.
A node restoring one truncates its CommitLog to that length or fetches the missing bytes from a
peer (:meth:`Store.restore`), and accepts fetched bytes only when they extend its own chain to
the snapshot's. Both live in :mod:`chronomq.raftlog.snapshot`, the held client keys in
:mod:`chronomq.raftlog.clientkeys`.

Idempotency keys come in two kinds. A client's key (its batch carries the fingerprint of the
request, see :mod:`chronomq.raftlog.command`) is remembered with that fingerprint, the propose time and
the placement for a time window measured in propose times, at most a number of keys (the
oldest go first); a repeat within the window answers the first placement, and a repeat with
another fingerprint is rejected (``KEY_REUSED``). Internal batches' keys are kept by count.
The leader carries both limits in every command, so apply forgets the same keys everywhere.

Registered apply extensions (:mod:`chronomq.raftlog.extension`) apply ``EXTENSION`` commands; their
derived records are placed like produced ones and their state lives in ``kv``.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from chronomq.raftlog import applycheck, clientkeys, record
from chronomq.raftlog import command as cmdcodec
from chronomq.raftlog.chain import Chain
from chronomq.raftlog.clientkeys import CLIENT_ENTRY, ClientKey, fingerprint_bytes, key_digest
from chronomq.raftlog.commitlog import CommitLog
from chronomq.raftlog.consumequeue import DEFAULT_MAX_OPEN_FILES, UNIT, ConsumeQueueStore, CqUnit
from chronomq.raftlog.errors import ApplyRejected, NodeFault, StoreCorruption
from chronomq.raftlog.extension import ApplyContext, ApplyExtension, DerivedRecord, check_name
from chronomq.raftlog.snapshot import SnapshotState

log = logging.getLogger(__name__)

DEFAULT_IDEMPOTENCY_WINDOW_BATCHES = 20_000
DEFAULT_CLIENT_WINDOW_MS = 600_000
DEFAULT_CLIENT_MAX_KEYS = 100_000
#: How long a command for an extension that is not registered yet waits for it.
DEFAULT_EXTENSION_WAIT_S = 60.0
MAX_EXTENSION_NAME = 32

# Outcome status of a batch.
OK = 0
CONDITION_FAILED = 1
BAD_QUEUE = 2
#: A batch (or a whole command) broke a rule of apply (:mod:`chronomq.raftlog.applycheck`); the
#: outcome's ``field`` names the input.
REJECTED = 4

#: Replicated kv entries counting commands and batches rejected at apply, and the last reason.
REJECTED_COUNT_KEY = "raftlog/rejected"
REJECTED_LAST_KEY = "raftlog/rejected_last"
_REJECTED_LAST_CHARS = 300

#: A client's idempotency key came back with another request (fingerprint) within its window.
KEY_REUSED = 3
#: The detail of a batch refused at apply because it would create a topic past
#: :class:`TopicLimits` starts with this (the edge turns it into 429 ``too_many_topics``).
TOO_MANY_TOPICS = "too_many_topics"


@dataclass(frozen=True, slots=True)
class TopicLimits:
    """How many topics, and queues over all topics, apply lets batches create.

    A batch whose creations would pass either is rejected whole (``REJECTED``, field
    ``topic``, detail starting with :data:`TOO_MANY_TOPICS`). The limits come from the node's
    config and must be equal on every node, like ``record_rules``; topics that exist are never
    touched, so a lower limit only stops new ones.
    """

    max_topics: int = 10_000
    max_queues: int = 80_000

    def refusal(self, topics: int, queues: int, creates: Mapping[str, int]) -> str | None:
        """Why creating ``creates`` next to ``topics`` topics of ``queues`` queues in all is
        refused, or None."""
        if not creates:
            return None
        new_topics = topics + len(creates)
        new_queues = queues + sum(int(n) for n in creates.values())
        if new_topics > self.max_topics:
            names = ", ".join(sorted(creates))
            return (
                f"{TOO_MANY_TOPICS}: creating topic {names} would make {new_topics} topics, "
                f"more than max_topics {self.max_topics}"
            )
        if new_queues > self.max_queues:
            names = ", ".join(sorted(creates))
            return (
                f"{TOO_MANY_TOPICS}: creating topic {names} would make {new_queues} queues, "
                f"more than max_queues {self.max_queues}"
            )
        return None


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


@dataclass(frozen=True, slots=True)
class BatchOutcome:
    key: str
    status: int
    placed: tuple[Placed, ...] = ()
    duplicate: bool = False
    detail: str = ""
    #: For ``REJECTED``: the input the rejection names (``messages[0].properties.REAL_QID``).
    field: str = ""


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


class Store(SnapshotState):
    def __init__(
        self,
        data_dir: str | os.PathLike[str],
        *,
        segment_bytes: int,
        flush: str = "async",
        idempotency_window_batches: int = DEFAULT_IDEMPOTENCY_WINDOW_BATCHES,
        client_window_ms: int = DEFAULT_CLIENT_WINDOW_MS,
        client_max_keys: int = DEFAULT_CLIENT_MAX_KEYS,
        topic_limits: TopicLimits | None = None,
        max_open_cq_files: int = DEFAULT_MAX_OPEN_FILES,
        flush_interval_ms: int = 500,
    ) -> None:
        self.data_dir = Path(data_dir)
        # Under either setting the CommitLog and the ConsumeQueues are synced in the
        # background and before a snapshot (:meth:`sync`): past the last snapshot they are
        # rebuilt from the Raft journal, which ``flush="sync"`` syncs before acknowledging.
        self.commitlog = CommitLog(
            self.data_dir / "commitlog",
            segment_bytes=segment_bytes,
            flush="async",
            flush_interval_ms=flush_interval_ms,
        )
        self.cqs = ConsumeQueueStore(
            self.data_dir / "consumequeue", max_open_files=max_open_cq_files, flush="async"
        )
        self.topic_limits = topic_limits or TopicLimits()
        # Limits for commands that carry none (written before commands carried them).
        self.default_idem = cmdcodec.IdemLimits(
            client_window_ms, client_max_keys, idempotency_window_batches
        )
        self.flush = flush
        # Replicated tables. Written only by apply/restore (the Raft thread); read anywhere.
        self.topics: dict[str, list[int]] = {}  # topic -> next queue offset per queue
        self.kv: dict[str, int | str] = {}
        self.idem: OrderedDict[str, tuple[int, int, int]] = (
            OrderedDict()
        )  # internal batch key -> (phys, n, status)
        # Client keys: key digest -> CLIENT_ENTRY bytes, in the order they were applied.
        self.clients: OrderedDict[bytes, bytes] = OrderedDict()
        # Local figure (not replicated): client keys dropped by the bound before their window.
        self.clients_evicted = 0
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
        #: False while the state this store starts from is not established yet (a node with
        #: a snapshot, before the Raft thread has restored it): extensions registered then
        #: are attached by that restore, never to the empty state, whose kv would tell them
        #: to throw their files away.
        self.settled = True
        #: Names of the extensions this cluster runs; a command for another name is rejected
        #: at once. None: wait for any name (``extension_wait_s``), then stop.
        self.expected_extensions: frozenset[str] | None = None
        #: Checks for records of a topic appended by ``APPEND`` commands (see
        #: :mod:`chronomq.raftlog.applycheck`). Set before the first apply, equal on every node.
        self.record_rules: dict[str, applycheck.RecordRule] = {}
        #: ``peer_bytes(start, end)``: a peer's CommitLog bytes, None if none has them (set by
        #: :mod:`chronomq.raftlog.machine`); :meth:`read_record` falls back to it.
        self.peer_bytes: Callable[[int, int], bytes | None] | None = None

    # ------------------------------------------------------------------ queries

    @property
    def chain(self) -> bytes:
        """The hash chain of the CommitLog's ``applied_length`` bytes (:mod:`chronomq.raftlog.chain`)."""
        return self._chain.value()

    def digest(self) -> dict[str, object]:
        """What replicas compare: equal ``length`` and ``chain`` mean equal CommitLog bytes."""
        return {
            "index": self.applied_index,
            "length": self.applied_length,
            "chain": self.chain.hex(),
        }

    def client_key(self, key: str) -> ClientKey | None:
        """What is remembered of client key ``key`` (read anywhere; may be expired already)."""
        entry = self.clients.get(key_digest(key))
        return None if entry is None else ClientKey.unpack(entry)

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

    def read_record(self, at: int, size: int) -> bytes:
        """The checked bytes of the record at physical offset ``at``, from this node's
        CommitLog or, when the local copy cannot be read (EIO, CRC mismatch), from a peer's.

        Never answers with bytes that fail the record's CRC or are not the record at ``at``.
        Raises :class:`StoreCorruption` (or ``OSError``) naming the file when neither can give
        it: the caller must then wait, never skip the record.
        """
        try:
            data = self.commitlog.read(at, size)
            record.check(data)
            return data
        except (OSError, StoreCorruption) as exc:
            local = exc
        if at < self.commitlog.min_offset or at + size > self.applied_length:
            raise local  # not a record this store holds: nothing to ask a peer for
        where = self._segment_name(at)
        peer_bytes = self.peer_bytes
        theirs = peer_bytes(at, at + size) if peer_bytes is not None else None
        if theirs is not None and len(theirs) == size:
            try:
                record.check(theirs)
                if int.from_bytes(theirs[32:40], "big") == at:  # its physical_offset field
                    log.warning(
                        "CommitLog record at %d (%d bytes) is unreadable here (%s%s); "
                        "read it from a peer",
                        at,
                        size,
                        local,
                        f", {where}" if where else "",
                    )
                    return theirs
            except StoreCorruption:
                pass
        raise StoreCorruption(
            f"CommitLog record at {at} ({size} bytes) is unreadable in "
            f"{self.commitlog.directory}{f' ({where})' if where else ''}: {local}; no peer "
            "could supply it. Check the disk; if the file is damaged, stop this node, move "
            "its data directory aside and restart it to copy the CommitLog from its peers"
        ) from local

    def _segment_name(self, at: int) -> str:
        try:
            return f"segment {self.commitlog._segment_at(at).path.name}"
        except (IndexError, AttributeError):
            return ""

    # ------------------------------------------------------------------ extensions

    def register_extension(self, ext: ApplyExtension) -> None:
        """Register an apply extension: align it to the current state, then let its commands
        (which may be waiting already) apply."""
        name = check_name(ext.name)
        with self._ext_cond:
            if name in self.extensions:
                raise ValueError(f"an extension named {name!r} is registered already")
            if self.settled:
                ext.attach(self)
            else:
                log.info("extension %r waits for the snapshot to be restored to attach", name)
            self.extensions[name] = ext
            self._ext_cond.notify_all()

    def _extension(self, name: str) -> ApplyExtension:
        """The extension for ``name``, waiting for it to register (the caller holds the lock)."""
        if self.expected_extensions is not None and name not in self.expected_extensions:
            raise ApplyRejected(f"this cluster runs no apply extension named {name[:40]!r}")
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
        if not isinstance(name, str) or not 0 < len(name) <= MAX_EXTENSION_NAME:
            raise ApplyRejected("extension command without an extension name")
        if isinstance(cmd.propose_ms, bool) or not isinstance(cmd.propose_ms, int):
            raise ApplyRejected("extension command without an integer propose time")
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
                raise ApplyRejected(
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
        """Apply the committed command ``data`` at Raft index ``index``.

        Total: any bytes give an :class:`ApplyResult`. A command that does not decode or
        breaks a rule of apply is rejected (:meth:`_reject`) the same way on every replica.
        Only a fault of this node (``OSError``, :class:`NodeFault`) is raised.
        """
        try:
            cmd = cmdcodec.decode(data)
        except StoreCorruption as exc:  # the command's bytes, not this node's files
            return self._reject(None, index, str(exc))
        try:
            return self._apply_command(cmd, index)
        except (OSError, MemoryError, NodeFault):
            raise
        except ApplyRejected as exc:
            return self._reject(cmd, index, str(exc), exc.field or "")
        except Exception as exc:  # a rule no check above caught: still the same everywhere
            log.exception("apply of the command at index %d failed; rejecting it", index)
            return self._reject(cmd, index, f"{type(exc).__name__}: {exc}")

    def _reject(
        self, cmd: cmdcodec.Command | None, index: int, detail: str, field: str = ""
    ) -> ApplyResult:
        """Reject a whole command: count it in kv, answer every batch ``REJECTED``."""
        detail = detail[:_REJECTED_LAST_CHARS]
        log.error("command at index %d rejected at apply: %s", index, detail)
        self._count_rejection(index, detail)
        self.applied_index = index
        kind = cmd.kind if cmd is not None else cmdcodec.Kind.BARRIER
        propose_ms = cmd.propose_ms if cmd is not None and isinstance(cmd.propose_ms, int) else 0
        keys = [b.key for b in cmd.batches if isinstance(b.key, str)] if cmd is not None else []
        outcomes = tuple(BatchOutcome(k, REJECTED, detail=detail, field=field) for k in keys)
        result = ApplyResult(index, kind, propose_ms, outcomes, 0, 0)
        self._notify(result)
        return result

    def _count_rejection(self, index: int, detail: str) -> None:
        count = self.kv.get(REJECTED_COUNT_KEY, 0)
        self.kv[REJECTED_COUNT_KEY] = (count if isinstance(count, int) else 0) + 1
        self.kv[REJECTED_LAST_KEY] = f"index {index}: {detail}"[:_REJECTED_LAST_CHARS]

    def _apply_command(self, cmd: cmdcodec.Command, index: int) -> ApplyResult:
        if cmd.kind is cmdcodec.Kind.BARRIER:
            self.applied_index = index
            result = ApplyResult(index, cmd.kind, cmd.propose_ms, (), 0, 0)
            self._notify(result)
            return result
        if cmd.kind is cmdcodec.Kind.EXTENSION:
            return self._apply_extension(cmd, index)
        problem = applycheck.check_command(cmd, self.commitlog.segment_bytes - record.BLANK_SIZE)
        if problem is not None:
            raise ApplyRejected(problem)
        topics = cmd.topics
        messages = cmd.messages
        blob = cmd.blob
        outcomes: list[BatchOutcome | None] = []
        keep: list[tuple[int, int]] = []  # byte ranges of accepted records in blob
        sizes: list[int] = []
        qoffs: list[int] = []
        cq_keys: list[tuple[str, int]] = []
        # (outcome idx, batch, first msg, count)
        pending_idem: list[tuple[int, cmdcodec.Batch, int, int]] = []
        seen_now: dict[str, int] = {}  # key -> index of its first outcome in this command
        limits = cmd.idem or self.default_idem
        clientkeys.expire(self.clients, cmd.propose_ms - limits.client_window_ms)
        repeats: list[tuple[int, int]] = []  # (outcome idx, outcome idx of the first occurrence)
        # The batches' kv updates, in order (None deletes), applied to kv once their records
        # are written: a reader on another thread that sees a progress key move (a delay
        # level's offset) finds the records it moved past. A later batch's ``expect`` sees an
        # earlier one's updates through it, as before.
        updates: dict[str, cmdcodec.Scalar | None] = {}
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
                first_idx = seen_now[batch.key]
                if batch.fingerprint != cmd.batches[first_idx].fingerprint:
                    outcomes.append(_reused(batch.key))
                else:
                    repeats.append((len(outcomes), first_idx))
                    outcomes.append(None)
                continue
            seen = self._seen(batch, cmd.propose_ms, limits)
            if seen is not None:
                outcomes.append(seen)
                continue
            seen_now[batch.key] = len(outcomes)
            failed = self._check_expect(batch.expect, updates)
            if failed is not None:
                outcomes.append(BatchOutcome(batch.key, CONDITION_FAILED, detail=failed))
                self._remember(batch, cmd.propose_ms, limits, 0, 0, CONDITION_FAILED)
                continue
            creates = batch.creates or {}
            bad = next(
                (m for m in span if m[1] >= self._queue_count(topics[m[0]], creates)),
                None,
            )
            if bad is not None:
                detail = f"topic {topics[bad[0]]} has no queue {bad[1]}"
                outcomes.append(BatchOutcome(batch.key, BAD_QUEUE, detail=detail))
                self._remember(batch, cmd.propose_ms, limits, 0, 0, BAD_QUEUE)
                continue
            broken = applycheck.check_batch(
                blob,
                start_byte,
                span,
                topics,
                lambda t, c=creates: self._queue_count(t, c) or None,  # type: ignore[misc]
                self.record_rules,
                cmd.propose_ms,
            )
            if broken is not None:
                detail, field = broken
                log.error(
                    "batch %r at index %d rejected at apply: %s (%s)",
                    batch.key,
                    index,
                    detail,
                    field,
                )
                self._count_rejection(index, f"{field}: {detail}")
                outcomes.append(BatchOutcome(batch.key, REJECTED, detail=detail, field=field))
                self._remember(batch, cmd.propose_ms, limits, 0, 0, REJECTED)
                continue
            fresh = {t: int(n) for t, n in creates.items() if t not in self.topics}
            too_many = (
                self.topic_limits.refusal(
                    len(self.topics), sum(len(q) for q in self.topics.values()), fresh
                )
                if fresh
                else None
            )
            if too_many is not None:
                outcomes.append(BatchOutcome(batch.key, REJECTED, detail=too_many, field="topic"))
                self._remember(batch, cmd.propose_ms, limits, 0, 0, REJECTED)
                continue
            for topic, n in fresh.items():
                self.topics[topic] = [0] * n
            if batch.updates:
                updates.update(batch.updates)
            for tidx, qid, size in span:
                queues = self.topics[topics[tidx]]
                qoffs.append(queues[qid])
                queues[qid] += 1
                sizes.append(size)
                cq_keys.append((topics[tidx], qid))
            keep.append((start_byte, start_byte + span_bytes))
            pending_idem.append((len(outcomes), batch, len(sizes) - len(span), len(span)))
            outcomes.append(None)
        buf = (
            bytearray(blob)
            if len(keep) == 1 and keep[0] == (0, len(blob))
            else bytearray(b"".join(blob[a:b] for a, b in keep))
        )
        start_len = self.commitlog.length
        phys, buf_at = self._write_records(buf, sizes, qoffs, cq_keys)
        end_len = self.commitlog.length
        for k, v in updates.items():
            if v is None:
                self.kv.pop(k, None)
            else:
                self.kv[k] = v
        # Outcomes of accepted batches, and their idempotency entries.
        want = self.want_results()
        for out_idx, batch, first_i, count in pending_idem:
            placed = (
                _placed(buf, buf_at, phys, sizes, qoffs, cq_keys, range(first_i, first_i + count))
                if want
                else ()
            )
            outcomes[out_idx] = BatchOutcome(batch.key, OK, placed)
            first_phys = phys[first_i] if count else 0
            self._remember(batch, cmd.propose_ms, limits, first_phys, count, OK)
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

    def _check_expect(
        self,
        expect: Mapping[str, cmdcodec.Scalar] | None,
        updates: Mapping[str, cmdcodec.Scalar | None],
    ) -> str | None:
        """Whether kv, with this command's ``updates`` so far over it, holds what ``expect``
        says; the first difference, else None."""
        if not expect:
            return None
        for k, want in expect.items():
            have = updates[k] if k in updates else self.kv.get(k)
            if have != want:
                return f"{k} is {have!r}, expected {want!r}"
        return None

    def _seen(
        self, batch: cmdcodec.Batch, propose_ms: int, limits: cmdcodec.IdemLimits
    ) -> BatchOutcome | None:
        """The outcome of a batch whose key was applied before (within its window), else None."""
        if batch.fingerprint is None:
            entry = self.idem.get(batch.key)
            return None if entry is None else self._replay(batch.key, *entry)
        packed = self.clients.get(key_digest(batch.key))
        if packed is not None:
            known = ClientKey.unpack(packed)
            if known.propose_ms > propose_ms - limits.client_window_ms:
                if known.fingerprint != fingerprint_bytes(batch.fingerprint):
                    return _reused(batch.key)
                return self._replay(batch.key, known.physical_offset, known.count, known.status)
            return None
        # A key remembered before keys had fingerprints (a snapshot of version 1).
        legacy = self.idem.get(batch.key)
        return None if legacy is None else self._replay(batch.key, *legacy)

    def _remember(
        self,
        batch: cmdcodec.Batch,
        propose_ms: int,
        limits: cmdcodec.IdemLimits,
        phys: int,
        count: int,
        status: int,
    ) -> None:
        if batch.fingerprint is None:
            self.idem[batch.key] = (phys, count, status)
            while len(self.idem) > limits.internal_keys:
                self.idem.popitem(last=False)
            return
        digest = key_digest(batch.key)
        # An expired entry still held (behind a younger one) is replaced, at the end.
        self.clients.pop(digest, None)
        self.clients[digest] = CLIENT_ENTRY.pack(
            digest, fingerprint_bytes(batch.fingerprint), propose_ms, phys, count, status
        )
        while len(self.clients) > max(limits.client_max_keys, 0):
            self.clients.popitem(last=False)
            if self.clients_evicted % 10_000 == 0:
                log.warning(
                    "%d client idempotency keys are held, the most idempotency_max_keys "
                    "allows: the oldest are forgotten before idempotency_window_s ends, and a "
                    "retry with a forgotten key is stored again (%d forgotten so far)",
                    len(self.clients),
                    self.clients_evicted + 1,
                )
            self.clients_evicted += 1

    def _replay(self, key: str, phys: int, count: int, status: int) -> BatchOutcome:
        """The outcome of a batch applied before, rebuilt from the CommitLog."""
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

    def _reattach_extensions(self) -> None:
        with self._ext_cond:
            for ext in self.extensions.values():
                ext.attach(self)

    def reset(self) -> None:
        """Empty state: used before pysyncobj replays a journal from its start."""
        self.commitlog.truncate(0)
        self.cqs.repair(self.commitlog, {})
        self.topics = {}
        self.kv = {}
        self.idem = OrderedDict()
        self.clients = OrderedDict()
        self._chain = Chain()
        self.applied_index = 0
        self.applied_length = 0
        self.settled = True
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


def _reused(key: str) -> BatchOutcome:
    return BatchOutcome(
        key,
        KEY_REUSED,
        detail="this Idempotency-Key was used with a different request within the idempotency window",
    )
