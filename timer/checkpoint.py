"""Checkpoint of the timer's local files, and recovery of the wheel after a crash.

Checkpoint layout (80 bytes, big-endian, ``_CHECKPOINT``)::

     0          4          6          8                    16                   24
    +----------+----------+----------+--------------------+--------------------+
    | magic 4s | version  | reserved | applied_index i64  | enqueue_offset i64 |
    | "CQCP"   | u16 = 1  | u16 = 0  | Raft index covered | next timer-topic   |
    |          |          |          |                    | ConsumeQueue offset|
    +----------+----------+----------+--------------------+--------------------+
    24                   32                   40                   48
    +--------------------+--------------------+--------------------+
    | timerlog_flush_pos | cursor.slot_ms i64 | cursor.head_pos    |
    | i64                |                    | i64                |
    +--------------------+--------------------+--------------------+
    48                   56                   64                   72         76         80
    +--------------------+--------------------+--------------------+----------+----------+
    | cursor.stop_pos    | cursor.next_pos    | last_delivered_ms  | precision| crc32    |
    | i64                | i64                | i64                | _ms u32  | of 0..75 |
    +--------------------+--------------------+--------------------+----------+----------+

The enqueue offset and read cursor are also carried by the replicated commands; the checkpoint
lets a restarting node know how much of its TimerLog and wheel it can trust:

1. :func:`persist` fsyncs the TimerLog, then writes the wheel's changed slots (none of which
   can point beyond what was just fsynced), then atomically replaces the checkpoint file
   (temp file, fsync, rename, fsync of the directory).
2. :func:`recover` loads it, opens the TimerLog verifying (and cutting any torn tail) from the
   checkpoint's flush position, opens the wheel, and :func:`rebuild_wheel` links every record
   from that position on into the wheel again. Linking is idempotent (a record at or below its
   chain's head is already linked), so a wheel flushed later than the checkpoint is fine.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

from chronomq.raftlog import durable
from chronomq.timer.config import TimerConfig
from chronomq.timer.cursor import ReadCursor
from chronomq.timer.errors import (
    BadMagic,
    ChecksumMismatch,
    TimerConfigMismatch,
    TimerCorruptionError,
    TimerStateError,
)
from chronomq.timer.slots import SlotGeometry
from chronomq.timer.timerlog import OpenReport, TimerLog
from chronomq.timer.wheel import Slot, TimerWheel

CHECKPOINT_MAGIC = b"CQCP"
CHECKPOINT_VERSION = 1
_CHECKPOINT = struct.Struct(">4sHHqqqqqqqqII")
CHECKPOINT_SIZE = _CHECKPOINT.size

WHEEL_FILE = "timerwheel"
TIMERLOG_DIR = "timerlog"
CHECKPOINT_FILE = "timercheck"

assert CHECKPOINT_SIZE == 80


@dataclass(frozen=True, slots=True)
class Checkpoint:
    precision_ms: int
    applied_index: int
    enqueue_offset: int
    timerlog_flush_pos: int
    cursor: ReadCursor
    last_delivered_ms: int = 0


def encode_checkpoint(cp: Checkpoint) -> bytes:
    body = _CHECKPOINT.pack(
        CHECKPOINT_MAGIC,
        CHECKPOINT_VERSION,
        0,
        cp.applied_index,
        cp.enqueue_offset,
        cp.timerlog_flush_pos,
        *cp.cursor.as_tuple(),
        cp.last_delivered_ms,
        cp.precision_ms,
        0,
    )
    return body[:-4] + struct.pack(">I", zlib.crc32(body[:-4]))


def decode_checkpoint(data: bytes, *, path: Path | None = None) -> Checkpoint:
    if len(data) != CHECKPOINT_SIZE:
        raise TimerCorruptionError(
            f"checkpoint is {len(data)} bytes, not {CHECKPOINT_SIZE}", path=path
        )
    (magic, version, _reserved, applied, enqueue_offset, flush_pos, slot_ms, head, stop, nxt,
     last_delivered, precision_ms, crc) = _CHECKPOINT.unpack(data)  # fmt: skip
    if magic != CHECKPOINT_MAGIC or version != CHECKPOINT_VERSION:
        raise BadMagic(f"not a timer checkpoint (magic {magic!r}, version {version})", path=path)
    if zlib.crc32(data[:-4]) != crc:
        raise ChecksumMismatch("timer checkpoint checksum mismatch", path=path)
    try:
        cursor = ReadCursor(slot_ms, head, stop, nxt)
    except TimerStateError as exc:
        raise TimerCorruptionError(f"checkpoint cursor is invalid: {exc}", path=path) from exc
    return Checkpoint(precision_ms, applied, enqueue_offset, flush_pos, cursor, last_delivered)


def save_checkpoint(path: Path | str, cp: Checkpoint) -> None:
    """Replace the checkpoint file atomically: temp file, fsync, rename, fsync the directory."""
    durable.write_atomically(path, encode_checkpoint(cp), mode=0o644)


def load_checkpoint(path: Path | str) -> Checkpoint | None:
    """The saved checkpoint, or ``None`` if there is none yet."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    return decode_checkpoint(data, path=path)


def persist(
    path: Path | str,
    log: TimerLog,
    wheel: TimerWheel,
    *,
    applied_index: int,
    enqueue_offset: int,
    cursor: ReadCursor,
    last_delivered_ms: int = 0,
) -> Checkpoint:
    """Flush the TimerLog, then the wheel, then save the checkpoint; in that order."""
    flush_pos = log.flush()
    wheel.flush(durable_log_end=flush_pos)
    cp = Checkpoint(
        precision_ms=wheel.geometry.precision_ms,
        applied_index=applied_index,
        enqueue_offset=enqueue_offset,
        timerlog_flush_pos=flush_pos,
        cursor=cursor,
        last_delivered_ms=last_delivered_ms,
    )
    save_checkpoint(path, cp)
    return cp


@dataclass(frozen=True, slots=True)
class RebuildReport:
    from_pos: int
    end_pos: int
    scanned: int
    linked: int
    already_linked: int
    #: Records of a slot whose wheel cell already holds a later lap (long delivered).
    stale: int
    #: Records whose ``prev_pos`` is not the chain head they were linked after; the chain is
    #: still walkable through ``prev_pos`` but the slot's count/first may be off.
    chain_mismatches: int


def rebuild_wheel(wheel: TimerWheel, log: TimerLog, from_pos: int) -> RebuildReport:
    """Link every TimerLog record from ``from_pos`` on into the wheel (idempotent)."""
    g = wheel.geometry
    scanned = linked = already = stale = mismatches = 0
    for pos, record in log.scan(from_pos):
        scanned += 1
        held = wheel.raw(g.index(record.slot_ms))
        if held is not None and held.slot_ms > record.slot_ms:
            stale += 1
            continue
        slot = held if held is not None and held.slot_ms == record.slot_ms else Slot(record.slot_ms)
        tomb = record.in_tombstone_chain
        head = slot.tomb_last_pos if tomb else slot.last_pos
        if pos <= head:
            already += 1
            continue
        if record.prev_pos != head:
            mismatches += 1
        wheel.put(record.slot_ms, pos, tombstone=tomb)
        linked += 1
    return RebuildReport(from_pos, log.end_pos, scanned, linked, already, stale, mismatches)


@dataclass(frozen=True, slots=True)
class Recovered:
    """Open files and what recovery found; the caller owns (and closes) ``log`` and ``wheel``."""

    log: TimerLog
    wheel: TimerWheel
    checkpoint: Checkpoint | None
    log_report: OpenReport
    rebuild: RebuildReport
    #: The wheel file was unreadable, set aside as ``*.corrupt`` and rebuilt from scratch.
    wheel_recreated: bool


def recover(data_dir: Path | str, config: TimerConfig) -> Recovered:
    """Open the timer files under ``data_dir`` after a clean or unclean stop.

    Files: ``timerwheel``, ``timerlog/``, ``timercheck``. Without a checkpoint the whole
    TimerLog is verified and linked.
    """
    root = Path(data_dir)
    durable.make_dirs(root)
    geometry = config.geometry
    cp = load_checkpoint(root / CHECKPOINT_FILE)
    if cp is not None and cp.precision_ms != geometry.precision_ms:
        raise TimerConfigMismatch(
            f"timer checkpoint was written with timer_precision_ms={cp.precision_ms}, "
            f"the configuration says {geometry.precision_ms}",
            field="timer_precision_ms",
        )
    log = TimerLog.open(
        root / TIMERLOG_DIR,
        segment_bytes=config.timer_log_segment_bytes,
        verify_from_pos=cp.timerlog_flush_pos if cp is not None else 0,
    )
    try:
        if cp is not None and cp.timerlog_flush_pos > log.end_pos:
            raise TimerCorruptionError(
                f"TimerLog ends at {log.end_pos}, before the checkpoint's flushed position "
                f"{cp.timerlog_flush_pos}",
                path=root / TIMERLOG_DIR,
            )
        wheel_path = root / WHEEL_FILE
        wheel, rebuild, recreated = _open_and_rebuild(wheel_path, geometry, log, cp)
    except BaseException:
        log.close()
        raise
    return Recovered(log, wheel, cp, log.open_report, rebuild, recreated)


def _open_and_rebuild(
    wheel_path: Path, geometry: SlotGeometry, log: TimerLog, cp: Checkpoint | None
) -> tuple[TimerWheel, RebuildReport, bool]:
    """Open the wheel and relink from the checkpoint; a damaged wheel is set aside and rebuilt
    from the whole TimerLog (a wrong configuration is not damage and is raised)."""
    wheel: TimerWheel | None = None
    try:
        wheel = TimerWheel.open(wheel_path, geometry)
        start = log.start_pos if cp is None else cp.timerlog_flush_pos
        return wheel, rebuild_wheel(wheel, log, start), False
    except TimerConfigMismatch:
        raise
    except TimerCorruptionError as exc:
        if exc.path != wheel_path:
            if wheel is not None:
                wheel.close()
            raise
        if wheel is not None:
            wheel.close()
    wheel_path.replace(wheel_path.with_name(wheel_path.name + ".corrupt"))
    wheel = TimerWheel.open(wheel_path, geometry)
    try:
        return wheel, rebuild_wheel(wheel, log, log.start_pos), True
    except BaseException:
        wheel.close()
        raise
