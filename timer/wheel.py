"""TimerWheel: a file of fixed-size slots, one per wheel cell, each heading a TimerLog chain.

File layout: a 64-byte header, then ``slot_count`` slots of 64 bytes (cell ``i`` at
``64 + 64 * i``, so no slot straddles a 512-byte sector). Big-endian.

Header (``_HEADER``)::

     0          4          6          8          12         16                 60         64
    +----------+----------+----------+----------+----------+------------------+----------+
    | magic 4s | version  | slot     | precision| slot     | reserved (zero)  | crc32    |
    | "CQTW"   | u16 = 1  | size u16 | _ms u32  | count u32| 44 bytes         | of 0..59 |
    +----------+----------+----------+----------+----------+------------------+----------+

Slot (``_SLOT``)::

     0          4          8                    16                   24
    +----------+----------+--------------------+--------------------+
    | magic 4s | count    | slot_ms i64        | first_pos i64      |
    | "CQSL"   | u32      | lap held by cell   | oldest main record |
    +----------+----------+--------------------+--------------------+
    24                   32                   40         44                    60         64
    +--------------------+--------------------+----------+---------------------+----------+
    | last_pos i64       | tomb_last_pos i64  | tomb     | reserved (zero)     | crc32    |
    | newest main record | newest cancel      | count u32| 16 bytes            | of 0..59 |
    +--------------------+--------------------+----------+---------------------+----------+

A cell never written is all zeros. ``count``/``first_pos``/``last_pos`` describe the main chain
(messages to deliver and rolled messages to re-put); ``tomb_*`` the chain of cancels aimed at
messages of this slot. A cell holding another lap (``slot_ms`` differs) reads as empty.

Reads go through a shared read-only memory map. Writes are kept in memory until
:meth:`TimerWheel.flush`, which writes them with ``pwrite`` and fsyncs, so the file never points
at TimerLog records that were not flushed first (flush the TimerLog, then the wheel; see
:func:`chronomq.timer.checkpoint.persist`). Not thread-safe: the owner serialises calls.
"""

from __future__ import annotations

import mmap
import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

from chronomq.raftlog import durable
from chronomq.timer.errors import (
    BadMagic,
    ChecksumMismatch,
    TimerConfigMismatch,
    TimerCorruptionError,
    TimerStateError,
)
from chronomq.timer.slots import SlotGeometry
from chronomq.timer.timerlog import NO_POS

WHEEL_MAGIC = b"CQTW"
WHEEL_VERSION = 1
SLOT_MAGIC = b"CQSL"
_HEADER = struct.Struct(">4sHHII44xI")
_SLOT = struct.Struct(">4sIqqqqI16xI")
HEADER_SIZE = _HEADER.size
SLOT_SIZE = _SLOT.size
_EMPTY_SLOT = bytes(SLOT_SIZE)
_U32 = 0xFFFF_FFFF

assert HEADER_SIZE == 64 and SLOT_SIZE == 64


@dataclass(frozen=True, slots=True)
class Slot:
    """The state of one slot (one lap of one cell)."""

    slot_ms: int
    first_pos: int = NO_POS
    last_pos: int = NO_POS
    count: int = 0
    tomb_last_pos: int = NO_POS
    tomb_count: int = 0

    @property
    def is_empty(self) -> bool:
        return self.count == 0 and self.tomb_count == 0


def encode_slot(slot: Slot) -> bytes:
    body = _SLOT.pack(
        SLOT_MAGIC,
        slot.count,
        slot.slot_ms,
        slot.first_pos,
        slot.last_pos,
        slot.tomb_last_pos,
        slot.tomb_count,
        0,
    )
    return body[:-4] + struct.pack(">I", zlib.crc32(body[:-4]))


def decode_slot(data: bytes, *, path: Path | None = None, pos: int | None = None) -> Slot | None:
    """Decode a slot's 64 bytes; ``None`` for a cell never written (all zeros)."""
    if len(data) != SLOT_SIZE:
        raise TimerCorruptionError(
            f"slot is {len(data)} bytes, not {SLOT_SIZE}", path=path, pos=pos
        )
    if data == _EMPTY_SLOT:
        return None
    magic, count, slot_ms, first, last, tomb_last, tomb_count, crc = _SLOT.unpack(data)
    if magic != SLOT_MAGIC:
        raise BadMagic(f"wheel slot has magic {magic!r}", path=path, pos=pos)
    if zlib.crc32(data[:-4]) != crc:
        raise ChecksumMismatch("wheel slot checksum mismatch", path=path, pos=pos)
    if min(first, last, tomb_last) < NO_POS or (count == 0) != (last == NO_POS):
        raise TimerCorruptionError("wheel slot has impossible fields", path=path, pos=pos)
    return Slot(slot_ms, first, last, count, tomb_last, tomb_count)


def encode_header(geometry: SlotGeometry) -> bytes:
    body = _HEADER.pack(
        WHEEL_MAGIC, WHEEL_VERSION, SLOT_SIZE, geometry.precision_ms, geometry.slot_count, 0
    )
    return body[:-4] + struct.pack(">I", zlib.crc32(body[:-4]))


def decode_header(data: bytes, *, path: Path | None = None) -> tuple[int, int]:
    """Return ``(precision_ms, slot_count)`` from a wheel file header."""
    if len(data) != HEADER_SIZE:
        raise TimerCorruptionError("wheel header is truncated", path=path, pos=0)
    magic, version, slot_size, precision_ms, slot_count, crc = _HEADER.unpack(data)
    if magic != WHEEL_MAGIC or version != WHEEL_VERSION or slot_size != SLOT_SIZE:
        raise BadMagic(
            f"not a TimerWheel file v{WHEEL_VERSION} (magic {magic!r}, version {version})",
            path=path,
            pos=0,
        )
    if zlib.crc32(data[:-4]) != crc:
        raise ChecksumMismatch("wheel header checksum mismatch", path=path, pos=0)
    return precision_ms, slot_count


class TimerWheel:
    """The wheel file, see the module docstring for its layout."""

    def __init__(self, path: Path, geometry: SlotGeometry, fd: int, view: mmap.mmap) -> None:
        self._path = path
        self._geometry = geometry
        self._fd = fd
        self._view = view
        self._dirty: dict[int, bytes] = {}
        self._closed = False

    @classmethod
    def open(cls, path: Path | str, geometry: SlotGeometry) -> TimerWheel:
        """Open the wheel file, creating it (sparse) if missing.

        A file created with another precision or slot count is refused with
        :class:`TimerConfigMismatch` naming the key: its slots mean other times.
        """
        path = Path(path)
        size = HEADER_SIZE + geometry.slot_count * SLOT_SIZE
        if not path.exists():
            _create(path, geometry, size)
        fd = os.open(path, os.O_RDWR)
        try:
            precision_ms, slot_count = decode_header(os.pread(fd, HEADER_SIZE, 0), path=path)
            if precision_ms != geometry.precision_ms:
                raise TimerConfigMismatch(
                    f"wheel file {path} was made with timer_precision_ms={precision_ms}, "
                    f"the configuration says {geometry.precision_ms}; move the timer data "
                    "away or restore the old value",
                    field="timer_precision_ms",
                )
            if slot_count != geometry.slot_count:
                raise TimerConfigMismatch(
                    f"wheel file {path} was made with timer_wheel_slots={slot_count}, "
                    f"the configuration says {geometry.slot_count}; move the timer data "
                    "away or restore the old value",
                    field="timer_wheel_slots",
                )
            if os.fstat(fd).st_size != size:
                raise TimerCorruptionError(
                    f"wheel file is {os.fstat(fd).st_size} bytes, expected {size}", path=path
                )
            view = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
        except BaseException:
            os.close(fd)
            raise
        return cls(path, geometry, fd, view)

    @property
    def path(self) -> Path:
        return self._path

    @property
    def geometry(self) -> SlotGeometry:
        return self._geometry

    @property
    def dirty_slots(self) -> int:
        """Slots changed since the last flush (memory held until then)."""
        return len(self._dirty)

    def raw(self, index: int) -> Slot | None:
        """What cell ``index`` holds, whatever its lap; ``None`` if never written."""
        self._check_open()
        if not 0 <= index < self._geometry.slot_count:
            raise TimerStateError(f"wheel cell {index} out of range")
        data = self._dirty.get(index)
        if data is None:
            offset = HEADER_SIZE + index * SLOT_SIZE
            data = self._view[offset : offset + SLOT_SIZE]
        return decode_slot(data, path=self._path, pos=HEADER_SIZE + index * SLOT_SIZE)

    def get(self, time_ms: int) -> Slot:
        """The slot holding ``time_ms``; empty if its cell holds another lap or nothing."""
        slot_ms = self._geometry.slot_ms(time_ms)
        held = self.raw(self._geometry.index(slot_ms))
        if held is None or held.slot_ms != slot_ms:
            return Slot(slot_ms)
        return held

    def put(self, time_ms: int, pos: int, *, tombstone: bool = False) -> Slot:
        """Make the TimerLog record at ``pos`` the newest of its slot's chain.

        The main chain gets a new ``last_pos`` (and ``first_pos`` when it was empty) and one
        more ``count``; with ``tombstone`` the cancel chain does. A cell holding an older lap is
        taken over; one holding a newer lap is refused (time would go backwards).
        """
        slot_ms = self._geometry.slot_ms(time_ms)
        index = self._geometry.index(slot_ms)
        held = self.raw(index)
        if held is not None and held.slot_ms > slot_ms:
            raise TimerStateError(
                f"wheel cell {index} holds slot {held.slot_ms}, newer than {slot_ms}"
            )
        slot = held if held is not None and held.slot_ms == slot_ms else Slot(slot_ms)
        if tombstone:
            if pos <= slot.tomb_last_pos or slot.tomb_count >= _U32:
                raise TimerStateError(f"cannot chain cancel at {pos} after {slot.tomb_last_pos}")
            slot = Slot(
                slot.slot_ms,
                slot.first_pos,
                slot.last_pos,
                slot.count,
                pos,
                slot.tomb_count + 1,
            )
        else:
            if pos <= slot.last_pos or slot.count >= _U32:
                raise TimerStateError(f"cannot chain record at {pos} after {slot.last_pos}")
            first = pos if slot.first_pos == NO_POS else slot.first_pos
            slot = Slot(
                slot.slot_ms, first, pos, slot.count + 1, slot.tomb_last_pos, slot.tomb_count
            )
        self._write(index, encode_slot(slot))
        return slot

    def reset(self, time_ms: int) -> None:
        """Empty the slot holding ``time_ms`` if its cell holds that lap."""
        slot_ms = self._geometry.slot_ms(time_ms)
        index = self._geometry.index(slot_ms)
        held = self.raw(index)
        if held is not None and held.slot_ms == slot_ms:
            self._write(index, _EMPTY_SLOT)

    def flush(self, *, durable_log_end: int | None = None) -> int:
        """Write changed slots to the file and fsync it; returns how many were written.

        With ``durable_log_end`` (the TimerLog's flushed position) it refuses to write a slot
        pointing at or beyond it: the file must never lead the TimerLog.
        """
        self._check_open()
        if not self._dirty:
            return 0
        if durable_log_end is not None:
            for index, data in self._dirty.items():
                slot = decode_slot(data)
                if slot and max(slot.last_pos, slot.tomb_last_pos) >= durable_log_end:
                    raise TimerStateError(
                        f"wheel cell {index} points at {max(slot.last_pos, slot.tomb_last_pos)}, "
                        f"beyond the flushed TimerLog ({durable_log_end}): flush the TimerLog first"
                    )
        indexes = sorted(self._dirty)
        run_start = 0
        for i in range(1, len(indexes) + 1):
            if i == len(indexes) or indexes[i] != indexes[i - 1] + 1:
                chunk = b"".join(self._dirty[j] for j in indexes[run_start:i])
                at = HEADER_SIZE + indexes[run_start] * SLOT_SIZE
                durable.pwrite_all(self._fd, chunk, at, self._path)
                run_start = i
        durable.fsync(self._fd, self._path)
        written = len(self._dirty)
        self._dirty.clear()
        return written

    def close(self) -> None:
        """Close the file; slots changed since the last :meth:`flush` are dropped."""
        if self._closed:
            return
        self._closed = True
        self._dirty.clear()
        self._view.close()
        os.close(self._fd)

    def __enter__(self) -> TimerWheel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _write(self, index: int, data: bytes) -> None:
        self._check_open()
        self._dirty[index] = data

    def _check_open(self) -> None:
        if self._closed:
            raise TimerStateError(f"TimerWheel {self._path} is closed")


def _create(path: Path, geometry: SlotGeometry, size: int) -> None:
    durable.make_dirs(path.parent)
    tmp = path.with_name(path.name + ".tmp")
    with durable.atomic_file(path, tmp=tmp, mode=0o644) as fd:
        durable.pwrite_all(fd, encode_header(geometry), 0, tmp)
        os.ftruncate(fd, size)
