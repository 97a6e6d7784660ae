"""The TimerLog's copy in the CommitLog: the system topic :data:`TOPIC`, and rebuilding a
TimerLog from it.

The TimerLog is appended by the apply of timer commands, whose slot decisions depend on the
committed cursor at that point of the log; those commands live only in the Raft journal, which
snapshots compact away. So every apply that appends TimerLog records also appends, in the same
apply and after everything else it writes, their bytes to :data:`TOPIC` queue 0 as derived
records (the command's propose time as store and born time). A node whose TimerLog is behind
its replicated state (a thin snapshot installed, the files lost or torn) copies the missing
records back from its own CommitLog (:func:`rebuild_from_store`); fetching them from a peer is
only the fallback for what the local CommitLog no longer holds.

One record of :data:`TOPIC` (a normal message record, :mod:`chronomq.raftlog.record`)::

    msg_id (16 bytes)
    +----------------+----------------+--------------------------------+
    | magic "TLOG"   | count u32      | first_pos i64                  |
    +----------------+----------------+--------------------------------+
    tags_code = first_pos (so the ConsumeQueue alone is searchable by position)
    properties: TIMER_LOG_POS = first_pos, TIMER_LOG_COUNT = count (decimal)
    body:
    +-------------------+-------------------+-----+-------------------+
    | TimerLog record   | TimerLog record   | ... | TimerLog record   |
    | at first_pos      | at first_pos + 80 |     | (count of them)   |
    +-------------------+-------------------+-----+-------------------+

Each TimerLog record is the 80 bytes :mod:`chronomq.timer.timerlog` wrote (``encode_record``, its own
CRC inside). The records of one body are byte-contiguous in the TimerLog: a body never spans a
TimerLog segment boundary (records never do, and the skipped tail of a segment starts a new
body) and holds at most :data:`MAX_RECORDS_PER_MESSAGE`. Bodies follow one another in
TimerLog order, so ``first_pos`` grows along the queue.

Records of :data:`TOPIC` are the timer's own: the edge refuses produces to ``rmq_sys_*``
topics and apply rejects an ``APPEND`` to it (:func:`apply_rule`); no service reads them as
messages. A pull of the topic reads them like any other (read-only); nothing consumes them.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from chronomq.raftlog import record
from chronomq.raftlog.applycheck import QueueCount, RecordFacts
from chronomq.raftlog.errors import StoreCorruption
from chronomq.raftlog.extension import DerivedRecord
from chronomq.timer.errors import TimerCorruptionError
from chronomq.timer.timerlog import RECORD_SIZE, TimerLog, decode_record

if TYPE_CHECKING:
    from chronomq.raftlog.store import Store

log = logging.getLogger(__name__)

TOPIC: Final = "rmq_sys_timer_log"
QUEUE: Final = 0
TIMER_LOG_POS: Final = "TIMER_LOG_POS"
TIMER_LOG_COUNT: Final = "TIMER_LOG_COUNT"
#: Most TimerLog records in one message (20 KiB of body).
MAX_RECORDS_PER_MESSAGE: Final = 256
_ID = struct.Struct(">4sIq")
_ID_MAGIC = b"TLOG"
#: ConsumeQueue units read per step while copying.
_UNITS_PER_READ = 64


def message_id(first_pos: int, count: int) -> bytes:
    return _ID.pack(_ID_MAGIC, count, first_pos)


def chunks(appended: Sequence[tuple[int, bytes]]) -> list[tuple[int, bytes]]:
    """Group ``(pos, record bytes)`` appended in order into ``(first_pos, body)`` pieces of
    byte-contiguous positions, at most :data:`MAX_RECORDS_PER_MESSAGE` records each."""
    out: list[tuple[int, bytes]] = []
    first = -1
    parts: list[bytes] = []
    for pos, data in appended:
        if parts and (
            pos != first + len(parts) * RECORD_SIZE or len(parts) >= MAX_RECORDS_PER_MESSAGE
        ):
            out.append((first, b"".join(parts)))
            parts = []
        if not parts:
            first = pos
        parts.append(data)
    if parts:
        out.append((first, b"".join(parts)))
    return out


def derived_records(appended: Sequence[tuple[int, bytes]], *, store_ms: int) -> list[DerivedRecord]:
    """The :data:`TOPIC` records that carry the TimerLog records one apply appended."""
    out: list[DerivedRecord] = []
    for first, body in chunks(appended):
        count = len(body) // RECORD_SIZE
        data = record.encode(
            topic=TOPIC,
            queue_id=QUEUE,
            msg_id=message_id(first, count),
            body=body,
            properties={TIMER_LOG_POS: str(first), TIMER_LOG_COUNT: str(count)},
            born_ms=store_ms,
            store_ms=store_ms,
            tags_code=first,
        )
        out.append(DerivedRecord(TOPIC, QUEUE, data))
    return out


def apply_rule(facts: RecordFacts, queue_count: QueueCount) -> tuple[str, str] | None:
    """Records of :data:`TOPIC` are written by the timer's apply only: refuse any produced."""
    return f"{TOPIC} is written by the timer itself", "topic"


@dataclass(frozen=True, slots=True)
class Piece:
    """One record of :data:`TOPIC` read back: where its TimerLog records start, and them."""

    first_pos: int
    body: bytes
    commitlog_offset: int

    @property
    def count(self) -> int:
        return len(self.body) // RECORD_SIZE


def decode_piece(data: bytes, commitlog_offset: int) -> Piece:
    """Check and decode one :data:`TOPIC` record (``StoreCorruption`` when it is not one)."""
    msg = record.decode(data)
    where = f"{TOPIC} record at CommitLog offset {commitlog_offset}"
    raw_pos = msg.properties.get(TIMER_LOG_POS, "")
    raw_count = msg.properties.get(TIMER_LOG_COUNT, "")
    if not (
        raw_pos.isascii() and raw_pos.isdigit() and raw_count.isascii() and raw_count.isdigit()
    ):
        raise StoreCorruption(f"{where} has no TimerLog position/count")
    first, count = int(raw_pos), int(raw_count)
    if (
        msg.topic != TOPIC
        or msg.tags_code != first
        or msg.msg_id != message_id(first, count)
        or len(msg.body) != count * RECORD_SIZE
        or count == 0
    ):
        raise StoreCorruption(f"{where} does not describe its {len(msg.body)} bytes of records")
    return Piece(first, msg.body, commitlog_offset)


def _first_unit(store: Store, pos: int) -> int | None:
    """ConsumeQueue offset of the last :data:`TOPIC` record whose first position is at or
    before ``pos`` (binary search over the units' tags_code), or None."""
    lo, hi = 0, store.max_offset(TOPIC, QUEUE)
    found: int | None = None
    while lo < hi:
        mid = (lo + hi) // 2
        units = store.read_units(TOPIC, QUEUE, mid, 1)
        if not units:
            break
        if units[0].tags_code <= pos:
            found = mid
            lo = mid + 1
        else:
            hi = mid
    return found


@dataclass(frozen=True, slots=True)
class LocalCopy:
    """What :func:`rebuild_from_store` appended, and why it stopped short (if it did)."""

    records: int
    stopped: str | None = None


def rebuild_from_store(store: Store, timer_log: TimerLog, target_end: int) -> LocalCopy:
    """Append to ``timer_log`` the records ``[timer_log.end_pos, target_end)`` copied from
    :data:`TOPIC` in ``store``'s CommitLog, as far as it holds them.

    Stops short (``stopped`` says why) when the local CommitLog lacks them: no record covers
    the position (written before this topic existed, or removed by retention) or one is
    unreadable. Raises :class:`TimerCorruptionError` naming the TimerLog when the records read
    leave a gap in positions: what the local CommitLog holds cannot be this TimerLog.
    """
    count = 0
    if timer_log.end_pos >= target_end:
        return LocalCopy(0)
    start = timer_log.append_pos
    at = _first_unit(store, start)
    if at is None:
        return LocalCopy(0, f"no {TOPIC} record covers TimerLog position {start}")
    end_units = store.max_offset(TOPIC, QUEUE)
    while at < end_units and timer_log.end_pos < target_end:
        units = store.read_units(TOPIC, QUEUE, at, _UNITS_PER_READ)
        if not units:
            break
        for unit in units:
            try:
                data = store.read_record(unit.commitlog_offset, unit.size)
                piece = decode_piece(data, unit.commitlog_offset)
            except (OSError, StoreCorruption) as exc:
                return LocalCopy(count, f"{TOPIC} unit {unit.queue_offset}: {exc}")
            count += _append_piece(timer_log, piece, target_end)
            if timer_log.end_pos >= target_end:
                break
        at += len(units)
    if timer_log.end_pos < target_end:
        return LocalCopy(count, f"{TOPIC} ends before TimerLog position {target_end}")
    return LocalCopy(count)


def _append_piece(timer_log: TimerLog, piece: Piece, target_end: int) -> int:
    appended = 0
    for i in range(piece.count):
        pos = piece.first_pos + i * RECORD_SIZE
        if pos < timer_log.end_pos:
            continue  # the first piece may start before the local end
        if pos >= target_end:
            break
        expected = timer_log.append_pos
        if pos != expected:
            raise TimerCorruptionError(
                f"{TOPIC} record at CommitLog offset {piece.commitlog_offset} holds TimerLog "
                f"position {pos}, but the TimerLog continues at {expected}: a gap",
                path=timer_log.directory,
                pos=expected,
            )
        data = piece.body[i * RECORD_SIZE : (i + 1) * RECORD_SIZE]
        timer_log.append(decode_record(data, path=timer_log.directory, pos=pos))
        appended += 1
    return appended
