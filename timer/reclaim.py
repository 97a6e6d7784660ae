"""Where the TimerLog may be reclaimed: the leader's scan for the replicated reclaim position.

A TimerLog record is still needed while some apply may read it:

1. it lies in a slot the read cursor has not passed (``slot_ms >= cursor.slot_ms``): a message
   waiting for its slot, a rolled message waiting to be re-put, or a cancel waiting to suppress
   its target (dequeue reads the slot's chains, a cancel looks its target up there);
2. it is a cancel (in a slot's cancel chain) of a slot already read, while a message stored
   before that slot was read still waits in the timer topic: enqueued, that message is found
   already due and delivered at once *unless* its slot's cancel chain holds its cancel.

Every other record belongs to a slot already read and can no longer change what any replica
does. Records are appended in enqueue order, so the reclaim position is the start of the segment
of the first needed record: whole segments before it go (:meth:`TimerLog.drop_segments_before`).

For rule 2 the scanner keeps samples of (committed cursor, CommitLog end) taken as it runs:
every message stored before a sample was stored before that sample's cursor had passed the
slots below it. When the first message still waiting in the timer topic lies at or after a
sample's CommitLog end, no waiting message was stored before those slots were read, so their
cancels are no longer needed. With nothing waiting, no read slot's cancel is.

The leader proposes the position in a timer command; applied, it becomes kv ``timer/rc`` on
every replica (:mod:`chronomq.timer.machine`), and from then on every replica reads chains only
down to it (:func:`chronomq.timer.chains.walk`), whether or not it still holds the records: the
position is replicated, the deleting is each node's own (at its checkpoints). No clock is read
here: the caller passes the committed cursor and the offsets.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from chronomq.timer.timerlog import TimerLog

SAMPLES = 256
"""(cursor, CommitLog end) samples kept for rule 2; older ones are forgotten."""
CHUNK_RECORDS = 8192
"""Records one :meth:`ReclaimScanner.scan` call reads at most (the caller holds the timer's
lock meanwhile)."""


@dataclass(frozen=True, slots=True)
class _Sample:
    cursor_slot_ms: int
    commitlog_end: int


class ReclaimScanner:
    """The first needed TimerLog record, found incrementally (one scan pointer that only moves
    forward while the log is not cut before it). Not thread-safe: the leader's driver owns it.
    """

    def __init__(self) -> None:
        self._samples: deque[_Sample] = deque(maxlen=SAMPLES)
        self._low = -1  # every record before this position is known not to be needed

    def reset(self) -> None:
        """Forget what was found (a new term: the committed state is read afresh)."""
        self._samples.clear()
        self._low = -1

    def cancels_read_before(
        self, cursor_slot_ms: int, commitlog_end: int, first_waiting_offset: int | None
    ) -> int | None:
        """Record a sample; the slot before which read slots' cancels are no longer needed
        (rule 2), or None when none is known to be."""
        if not self._samples or self._samples[-1] != _Sample(cursor_slot_ms, commitlog_end):
            self._samples.append(_Sample(cursor_slot_ms, commitlog_end))
        if first_waiting_offset is None:
            return cursor_slot_ms
        found = None
        for sample in self._samples:  # in the order taken: cursors only move forward
            if sample.commitlog_end <= first_waiting_offset:
                found = sample.cursor_slot_ms
        return found

    def first_needed(
        self,
        log: TimerLog,
        cursor_slot_ms: int,
        cancels_before_ms: int | None,
        *,
        from_pos: int = 0,
        max_records: int = CHUNK_RECORDS,
    ) -> tuple[int, bool]:
        """The position of the first needed record at or after ``from_pos`` (the log's end when
        none is), and whether the scan got there; False: ``max_records`` were read first, call
        again."""
        start = max(from_pos, self._low, log.start_pos)
        for read, (pos, record) in enumerate(log.scan(start), 1):
            if record.slot_ms >= cursor_slot_ms:
                return pos, True
            if record.in_tombstone_chain and (
                cancels_before_ms is None or record.slot_ms >= cancels_before_ms
            ):
                return pos, True
            self._low = pos + 1
            if read >= max_records:
                return pos + 1, False
        self._low = max(self._low, log.end_pos)
        return log.end_pos, True


def reclaim_position(first_needed_pos: int, segment_bytes: int) -> int:
    """The reclaim position for a first needed record: the start of its segment."""
    return first_needed_pos - first_needed_pos % segment_bytes
