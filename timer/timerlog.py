"""TimerLog: append-only segment files of fixed-size records, one per timer message in the wheel.

A record does not hold the message, only where it lives in the CommitLog, plus the position of
the previous record of the same wheel-slot chain: each slot of :mod:`chronomq.timer.wheel` points at the
newest record of its chain and the records link backwards from there.

Record layout (80 bytes, big-endian, ``_RECORD``)::

     0          4          8          10         12         16
    +----------+----------+----------+----------+----------+
    | size u32 | magic 4s | version  | flags    | roll     |
    | = 80     | "CQTL"   | u16 = 1  | u16      | count u32|
    +----------+----------+----------+----------+----------+
    16                   24                   32                   40
    +--------------------+--------------------+--------------------+
    | prev_pos i64       | write_ms i64       | deliver_ms i64     |
    | -1 = chain start   | when enqueued      | real deliver time  |
    +--------------------+--------------------+--------------------+
    40                   48                   56         60         64
    +--------------------+--------------------+----------+----------+
    | slot_ms i64        | cl_offset i64      | cl_size  | topic    |
    | slot chained into  | CommitLog offset   | u32      | hash u32 |
    +--------------------+--------------------+----------+----------+
    64                   72         76         80
    +--------------------+----------+----------+
    | key_hash u64       | reserved | crc32    |
    | uniq key (target)  | u32 = 0  | of 0..75 |
    +--------------------+----------+----------+

``flags``: :class:`RecordFlags`. A TOMBSTONE record cancels the message whose uniq key hashes to
``key_hash`` (its ``cl_offset`` is the cancel message carrying TIMER_DEL_UNIQKEY); a ROLLED
record waits in ``slot_ms`` to be re-put into the CommitLog, its ``deliver_ms`` lying beyond
the roll window. ``slot_ms`` equals the slot of ``deliver_ms`` unless ROLLED.

Every record is also copied, by the same apply that appends it, into the CommitLog (system
topic ``rmq_sys_timer_log``, see :mod:`chronomq.timer.logtopic`), so a node rebuilds a lost or short
TimerLog from its own CommitLog.

Positions are byte offsets in one logical stream cut into segments of ``segment_bytes``; the
file of a segment is named by its first position (20 digits). Records never span segments:
when one does not fit, the rest of the segment stays unused and the next record starts the
next segment.
"""

from __future__ import annotations

import hashlib
import os
import re
import struct
import zlib
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from enum import IntFlag
from pathlib import Path

from chronomq.raftlog import durable
from chronomq.timer.errors import (
    BadMagic,
    ChainBroken,
    ChecksumMismatch,
    InvalidTimerConfig,
    TimerConfigMismatch,
    TimerCorruptionError,
    TimerStateError,
)

NO_POS = -1
RECORD_MAGIC = b"CQTL"
RECORD_VERSION = 1
_RECORD = struct.Struct(">I4sHHIqqqqqIIQII")
RECORD_SIZE = _RECORD.size
_CRC_SPAN = RECORD_SIZE - 4
_SEGMENT_NAME = re.compile(r"^\d{20}$")
_MAX_OPEN_SEGMENTS = 32
_SCAN_CHUNK_RECORDS = 1024
_U32 = 0xFFFF_FFFF
_U64 = 0xFFFF_FFFF_FFFF_FFFF

assert RECORD_SIZE == 80


class RecordFlags(IntFlag):
    NONE = 0
    TOMBSTONE = 1
    ROLLED = 2


_KNOWN_FLAGS = RecordFlags.TOMBSTONE | RecordFlags.ROLLED
# Plain ints for the hot paths: IntFlag arithmetic builds enum members on every operation.
_TOMBSTONE = int(RecordFlags.TOMBSTONE)
_ROLLED = int(RecordFlags.ROLLED)
_UNKNOWN = ~int(_KNOWN_FLAGS)
#: Bytes a read pulls in around the record asked for (one pread serves a chain walk's
#: neighbours: records of one slot are often written back to back).
_READ_BLOCK = 64 * 1024


def uniq_key_hash(uniq_key: str) -> int:
    """Stable 64-bit hash of a message's uniq key (msg_id); never 0, which means "no key"."""
    digest = hashlib.blake2b(uniq_key.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") or 1


def topic_hash(topic: str) -> int:
    """32-bit hash of a real topic name, for per-topic backlog figures."""
    return zlib.crc32(topic.encode("utf-8"))


@dataclass(frozen=True, slots=True)
class TimerRecord:
    """One TimerLog record; see the module docstring for its bytes."""

    prev_pos: int
    flags: RecordFlags
    write_ms: int
    deliver_ms: int
    slot_ms: int
    cl_offset: int
    cl_size: int
    topic_hash: int = 0
    key_hash: int = 0
    roll_count: int = 0

    def __post_init__(self) -> None:
        if self.prev_pos < NO_POS:
            raise TimerStateError(f"prev_pos must be >= -1, got {self.prev_pos}")
        if self.cl_offset < 0 or not 0 < self.cl_size <= _U32:
            raise TimerStateError(f"bad CommitLog reference {self.cl_offset}/{self.cl_size}")
        if not 0 <= self.topic_hash <= _U32 or not 0 <= self.key_hash <= _U64:
            raise TimerStateError("topic_hash must fit u32 and key_hash u64")
        if not 0 <= self.roll_count <= _U32:
            raise TimerStateError(f"roll_count must fit u32, got {self.roll_count}")
        if int(self.flags) & _UNKNOWN:
            raise TimerStateError(f"unknown record flags {int(self.flags):#x}")

    @property
    def is_tombstone(self) -> bool:
        return bool(int(self.flags) & _TOMBSTONE)

    @property
    def is_rolled(self) -> bool:
        return bool(int(self.flags) & _ROLLED)

    @property
    def in_tombstone_chain(self) -> bool:
        """Cancels waiting in their target's slot form a chain of their own; a rolled cancel
        only travels, so it sits in the main chain with everything else."""
        return int(self.flags) & (_TOMBSTONE | _ROLLED) == _TOMBSTONE


def encode_record(record: TimerRecord) -> bytes:
    body = _RECORD.pack(
        RECORD_SIZE,
        RECORD_MAGIC,
        RECORD_VERSION,
        int(record.flags),
        record.roll_count,
        record.prev_pos,
        record.write_ms,
        record.deliver_ms,
        record.slot_ms,
        record.cl_offset,
        record.cl_size,
        record.topic_hash,
        record.key_hash,
        0,
        0,
    )
    return body[:_CRC_SPAN] + struct.pack(">I", zlib.crc32(body[:_CRC_SPAN]))


def decode_record(data: bytes, *, path: Path | None = None, pos: int | None = None) -> TimerRecord:
    """Decode one record, checking size, magic, version, CRC and flags."""
    if len(data) != RECORD_SIZE:
        raise TimerCorruptionError(
            f"record is {len(data)} bytes, not {RECORD_SIZE}", path=path, pos=pos
        )
    (size, magic, version, flags, roll, prev, write_ms, deliver_ms, slot_ms, cl_offset, cl_size,
     t_hash, k_hash, _reserved, crc) = _RECORD.unpack(data)  # fmt: skip
    if size != RECORD_SIZE or magic != RECORD_MAGIC or version != RECORD_VERSION:
        raise BadMagic(
            f"not a TimerLog record (size {size}, magic {magic!r}, version {version})",
            path=path,
            pos=pos,
        )
    if zlib.crc32(data[:_CRC_SPAN]) != crc:
        raise ChecksumMismatch("TimerLog record checksum mismatch", path=path, pos=pos)
    if flags & _UNKNOWN or prev < NO_POS or cl_size == 0 or cl_offset < 0:
        raise TimerCorruptionError(
            f"TimerLog record has impossible fields (flags {flags:#x})", path=path, pos=pos
        )
    return TimerRecord(
        prev_pos=prev,
        flags=_FLAGS[flags],
        write_ms=write_ms,
        deliver_ms=deliver_ms,
        slot_ms=slot_ms,
        cl_offset=cl_offset,
        cl_size=cl_size,
        topic_hash=t_hash,
        key_hash=k_hash,
        roll_count=roll,
    )


_FLAGS = {int(f): f for f in (RecordFlags(i) for i in range(int(_KNOWN_FLAGS) + 1))}


@dataclass(frozen=True, slots=True)
class OpenReport:
    """What :meth:`TimerLog.open` found: where it verified from, and what it cut off."""

    start_pos: int
    end_pos: int
    verified_from_pos: int
    verified_records: int
    truncated_bytes: int
    reason: str | None = None


class TimerLog:
    """Append-only log of :class:`TimerRecord` in segment files. Not thread-safe: the owner
    serialises appends, reads and flushes (one thread or one lock)."""

    def __init__(self, directory: Path, segment_bytes: int, bases: list[int], end_pos: int) -> None:
        self._dir = directory
        self._segment_bytes = segment_bytes
        self._usable = (segment_bytes // RECORD_SIZE) * RECORD_SIZE
        self._bases = bases
        self._end = end_pos
        self._flushed = end_pos
        self._open: OrderedDict[int, int] = OrderedDict()
        self._dirty: set[int] = set()
        self._closed = False
        # One cached block of a segment: (segment base, offset of the block, its bytes).
        self._block: tuple[int, int, bytes] = (-1, 0, b"")
        # While capturing (see :meth:`start_capture`): every record appended, with its position.
        self._capture: list[tuple[int, bytes]] | None = None
        self.open_report = OpenReport(self.start_pos, end_pos, end_pos, 0, 0)

    # ----------------------------------------------------------------- opening

    @classmethod
    def open(
        cls, directory: Path | str, *, segment_bytes: int, verify_from_pos: int | None = None
    ) -> TimerLog:
        """Open (or create) the log in ``directory``.

        Records from ``verify_from_pos`` (default: the start of the last segment; give the
        checkpoint's flush position after a crash) to the end are checked, and the log is cut
        at the first torn or damaged one: whatever was not flushed may be lost, never misread.
        """
        if segment_bytes < RECORD_SIZE:
            raise InvalidTimerConfig(
                f"timer_log_segment_bytes must be at least {RECORD_SIZE}, got {segment_bytes}",
                field="timer_log_segment_bytes",
            )
        path = Path(directory)
        durable.make_dirs(path)
        usable = (segment_bytes // RECORD_SIZE) * RECORD_SIZE
        bases = sorted(int(p.name) for p in path.iterdir() if _SEGMENT_NAME.match(p.name))
        for i, base in enumerate(bases):
            size = (path / f"{base:020d}").stat().st_size
            if base % segment_bytes or (i and base != bases[i - 1] + segment_bytes):
                raise TimerConfigMismatch(
                    f"TimerLog segment {base:020d} in {path} does not fit "
                    f"timer_log_segment_bytes={segment_bytes}",
                    field="timer_log_segment_bytes",
                )
            if size > usable or (i < len(bases) - 1 and size != usable):
                raise TimerConfigMismatch(
                    f"TimerLog segment {base:020d} holds {size} bytes, which does not fit "
                    f"timer_log_segment_bytes={segment_bytes}",
                    field="timer_log_segment_bytes",
                )
        raw_end = end = 0
        if bases:
            raw_end = bases[-1] + (path / f"{bases[-1]:020d}").stat().st_size
            end = raw_end - (raw_end - bases[-1]) % RECORD_SIZE
        log = cls(path, segment_bytes, bases, end)
        if verify_from_pos is None:
            verify_from_pos = bases[-1] if bases else 0
        verify = log._align_up(min(max(verify_from_pos, log.start_pos), end))
        log.open_report = log._verify_tail(verify, raw_end=raw_end)
        return log

    def _align_up(self, pos: int) -> int:
        base = pos - pos % self._segment_bytes
        offset = pos - base
        offset += (-offset) % RECORD_SIZE
        return base + offset if offset < self._usable else base + self._segment_bytes

    def _verify_tail(self, verify_from: int, raw_end: int) -> OpenReport:
        count = 0
        pos = min(verify_from, self._end)
        cut_reason: str | None = None
        while pos < self._end:
            try:
                self.read(pos)
            except TimerCorruptionError as exc:
                cut_reason = str(exc)
                break
            count += 1
            pos = self._next(pos)
        truncated = raw_end - pos if pos < raw_end else 0
        if truncated:
            self.truncate(pos)
            cut_reason = cut_reason or "partial record at the end"
        return OpenReport(self.start_pos, self._end, verify_from, count, truncated, cut_reason)

    # -------------------------------------------------------------- properties

    @property
    def directory(self) -> Path:
        return self._dir

    @property
    def segment_bytes(self) -> int:
        return self._segment_bytes

    @property
    def start_pos(self) -> int:
        """First position still on disk (segments before it were dropped)."""
        return self._bases[0] if self._bases else self._end

    @property
    def end_pos(self) -> int:
        """Position the next record will be written at (or the start of the next segment)."""
        return self._end

    @property
    def append_pos(self) -> int:
        """Position the next record will be written at (past a segment's unused tail)."""
        pos = self._end
        base = pos - pos % self._segment_bytes
        return base + self._segment_bytes if pos - base + RECORD_SIZE > self._usable else pos

    @property
    def flushed_pos(self) -> int:
        """Everything before this position has been fsynced."""
        return self._flushed

    # ------------------------------------------------------------------ writes

    def append(self, record: TimerRecord) -> int:
        """Append one record and return its position."""
        self._check_open()
        pos = self._end
        base = pos - pos % self._segment_bytes
        if pos - base + RECORD_SIZE > self._usable:
            base += self._segment_bytes
            pos = base
        if not self._bases or self._bases[-1] != base:
            self._bases.append(base)
        fd = self._fd(base, create=True)
        data = encode_record(record)
        durable.pwrite_all(fd, data, pos - base, self._segment_path(base))
        self._dirty.add(base)
        self._end = pos + RECORD_SIZE
        if self._capture is not None:
            self._capture.append((pos, data))
        return pos

    def start_capture(self) -> None:
        """Keep a copy of every record appended from now on, until :meth:`stop_capture`."""
        self._capture = []

    def stop_capture(self) -> list[tuple[int, bytes]]:
        """The ``(position, record bytes)`` appended since :meth:`start_capture`, in order."""
        captured, self._capture = self._capture or [], None
        return captured

    def flush(self) -> int:
        """fsync everything appended so far; return the new flushed position."""
        self._check_open()
        for base in sorted(self._dirty):
            if base in self._bases:
                durable.fsync(self._fd(base), self._segment_path(base))
        if self._dirty:
            durable.fsync_dir(self._dir)
        self._dirty.clear()
        self._flushed = self._end
        return self._flushed

    def truncate(self, pos: int) -> None:
        """Cut the log at ``pos`` (a record boundary): later records and segments are removed."""
        self._check_open()
        offset = pos % self._segment_bytes
        if not self.start_pos <= pos <= self._end or offset % RECORD_SIZE or offset > self._usable:
            raise TimerStateError(
                f"cannot truncate TimerLog at {pos} (records span {self.start_pos}..{self._end})"
            )
        self._block = (-1, 0, b"")
        keep_base = pos - offset
        for base in [b for b in self._bases if b > keep_base or (b == keep_base and offset == 0)]:
            self._forget(base)
            (self._dir / f"{base:020d}").unlink(missing_ok=True)
            self._bases.remove(base)
        if keep_base in self._bases:
            os.truncate(self._dir / f"{keep_base:020d}", offset)
            self._dirty.add(keep_base)
        self._end = pos
        self._flushed = min(self._flushed, pos)

    def drop_segments_before(self, pos: int) -> int:
        """Delete whole segments that end at or before ``pos`` (never the last one).

        Call it with a position no chain that may still be read reaches below (the replicated
        reclaim position, see :mod:`chronomq.timer.reclaim`); returns how many went.
        """
        self._check_open()
        dropped = 0
        while len(self._bases) > 1 and self._bases[0] + self._segment_bytes <= pos:
            base = self._bases.pop(0)
            self._forget(base)
            (self._dir / f"{base:020d}").unlink(missing_ok=True)
            dropped += 1
        return dropped

    def restart_at(self, pos: int) -> None:
        """Delete every segment and make the log empty, starting at the segment of ``pos``:
        the next record goes there, and the log is completed from that position on."""
        self._check_open()
        for base in list(self._bases):
            self._forget(base)
            (self._dir / f"{base:020d}").unlink(missing_ok=True)
        durable.fsync_dir(self._dir)
        self._bases = []
        self._end = self._flushed = pos - pos % self._segment_bytes

    @property
    def size_bytes(self) -> int:
        """Bytes the segments hold on disk (whole segments but the last)."""
        if not self._bases:
            return 0
        return (len(self._bases) - 1) * self._usable + (self._end - self._bases[-1])

    @property
    def segment_count(self) -> int:
        return len(self._bases)

    # ------------------------------------------------------------------- reads

    def read(self, pos: int) -> TimerRecord:
        """The record at ``pos``; :class:`TimerStateError` if no record starts there."""
        self._check_open()
        if not self._is_record_pos(pos) or not self.start_pos <= pos < self._end:
            raise TimerStateError(
                f"no TimerLog record at {pos} (records span {self.start_pos}..{self._end})"
            )
        base = pos - pos % self._segment_bytes
        offset = pos - base
        cached_base, block_at, block = self._block
        at = offset - block_at
        if cached_base != base or at < 0 or at + RECORD_SIZE > len(block):
            # Read the block ending just after this record (chains are walked backwards),
            # never past the end of the log: bytes there may still be written.
            block_end = min(offset + RECORD_SIZE, self._end - base, self._usable)
            block_at = max(0, block_end - _READ_BLOCK)
            block = os.pread(self._fd(base), block_end - block_at, block_at)
            self._block = (base, block_at, block)
            at = offset - block_at
        data = block[at : at + RECORD_SIZE]
        try:
            return decode_record(data)
        except TimerCorruptionError:
            self._block = (-1, 0, b"")
            # Again, naming the file and position (building the path costs on the hot path).
            return decode_record(data, path=self._dir / f"{base:020d}", pos=pos)

    def contains(self, pos: int) -> bool:
        return self._is_record_pos(pos) and self.start_pos <= pos < self._end

    def iter_chain(
        self, last_pos: int, *, stop_pos: int = NO_POS
    ) -> Iterator[tuple[int, TimerRecord]]:
        """Walk a slot chain backwards from ``last_pos`` down to ``stop_pos`` (exclusive).

        Positions must strictly decrease and the walk must meet ``stop_pos`` exactly;
        otherwise the chain is broken and :class:`ChainBroken` is raised.
        """
        pos = last_pos
        while pos != stop_pos:
            if pos < stop_pos or pos == NO_POS:
                raise ChainBroken(
                    f"chain skipped past its stop position {stop_pos}", path=self._dir, pos=pos
                )
            if not self.contains(pos):
                raise ChainBroken("chain points outside the TimerLog", path=self._dir, pos=pos)
            record = self.read(pos)
            yield pos, record
            if record.prev_pos >= pos:
                raise ChainBroken("chain does not go backwards", path=self._dir, pos=pos)
            pos = record.prev_pos

    def scan(self, from_pos: int, to_pos: int | None = None) -> Iterator[tuple[int, TimerRecord]]:
        """Read records in position order from ``from_pos`` up to ``to_pos`` (default: the end)."""
        self._check_open()
        end = self._end if to_pos is None else min(to_pos, self._end)
        pos = self._align_up(max(from_pos, self.start_pos))
        while pos < end:
            base = pos - pos % self._segment_bytes
            stop = min(end, base + self._usable, pos + _SCAN_CHUNK_RECORDS * RECORD_SIZE)
            chunk = os.pread(self._fd(base), stop - pos, pos - base)
            seg_path = self._dir / f"{base:020d}"
            for off in range(0, len(chunk) - RECORD_SIZE + 1, RECORD_SIZE):
                yield (
                    pos + off,
                    decode_record(chunk[off : off + RECORD_SIZE], path=seg_path, pos=pos + off),
                )
            pos = stop if stop < base + self._usable else base + self._segment_bytes

    # --------------------------------------------------------------- lifecycle

    def close(self) -> None:
        """Close the files without flushing (call :meth:`flush` first to keep unsynced data)."""
        for base in list(self._open):
            self._forget(base)
        self._closed = True

    def __enter__(self) -> TimerLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- helpers

    def _next(self, pos: int) -> int:
        base = pos - pos % self._segment_bytes
        nxt = pos + RECORD_SIZE
        return nxt if nxt - base + RECORD_SIZE <= self._usable else base + self._segment_bytes

    def _is_record_pos(self, pos: int) -> bool:
        if pos < 0:
            return False
        offset = pos % self._segment_bytes
        return offset % RECORD_SIZE == 0 and offset + RECORD_SIZE <= self._usable

    def _fd(self, base: int, *, create: bool = False) -> int:
        fd = self._open.get(base)
        if fd is not None:
            self._open.move_to_end(base)
            return fd
        flags = os.O_RDWR | (os.O_CREAT if create else 0)
        fd = os.open(self._segment_path(base), flags, 0o644)
        self._open[base] = fd
        while len(self._open) > _MAX_OPEN_SEGMENTS:
            old, old_fd = self._open.popitem(last=False)
            if old in self._dirty:
                durable.fsync(old_fd, self._segment_path(old))
                self._dirty.discard(old)
            os.close(old_fd)
        return fd

    def _segment_path(self, base: int) -> Path:
        return self._dir / f"{base:020d}"

    def _forget(self, base: int) -> None:
        self._block = (-1, 0, b"")
        fd = self._open.pop(base, None)
        self._dirty.discard(base)
        if fd is not None:
            os.close(fd)

    def _check_open(self) -> None:
        if self._closed:
            raise TimerStateError(f"TimerLog {self._dir} is closed")


def read_records(
    directory: Path | str, segment_bytes: int, start: int, end: int, max_records: int
) -> tuple[bytes, int]:
    """Raw records from ``start`` towards ``end``: at most ``max_records``, and the position to
    continue from. Opens the segment files itself, so another thread may serve a peer while
    the owner of the :class:`TimerLog` keeps appending (records before ``end`` never change).
    """
    usable = (segment_bytes // RECORD_SIZE) * RECORD_SIZE
    root = Path(directory)
    chunks: list[bytes] = []
    pos = start
    left = max_records
    while pos < end and left > 0:
        base = pos - pos % segment_bytes
        offset = pos - base
        if offset % RECORD_SIZE or offset > usable:
            raise TimerStateError(f"{pos} is not a TimerLog record position")
        if offset == usable:
            pos = base + segment_bytes
            continue
        stop = min(end, base + usable, pos + left * RECORD_SIZE)
        fd = os.open(root / f"{base:020d}", os.O_RDONLY)
        try:
            data = os.pread(fd, stop - pos, offset)
        finally:
            os.close(fd)
        if len(data) != stop - pos:
            raise TimerStateError(f"TimerLog ends before {stop} in segment {base:020d}")
        chunks.append(data)
        left -= len(data) // RECORD_SIZE
        pos = stop if stop < base + usable else base + segment_bytes
    return b"".join(chunks), min(pos, end)
