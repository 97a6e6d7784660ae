"""What the timer still needs of the CommitLog, for retention.

Two kinds of timer messages wait:

- those not yet put into the wheel: the timer topic's ConsumeQueue from the replicated
  enqueue offset (``timer/enq``) on; the unit there is the lowest of them (units are in
  CommitLog order);
- those in the wheel: TimerLog records whose slot the replicated read cursor has not passed
  (``slot_ms >= cursor.slot_ms``; records of the slot being read count as waiting).

TimerLog records are appended in the order they are enqueued: records of timer-topic messages
in their ConsumeQueue order, so their CommitLog offsets rise; a cancel's record points at a
cancel written by that same apply, past everything in the CommitLog then. So among waiting
records, the first that is not a cancel has the lowest CommitLog offset of every non-cancel
record after it, and every cancel after it points higher still: the minimum is found by
scanning from the first waiting record up to the first waiting non-cancel.

:class:`TimerHold` remembers how far the TimerLog is known to be read (a low-water position
that only moves forward), so each call scans only what is new; it holds the timer's lock for
at most :data:`CHUNK_RECORDS` records at a time, so apply never waits long.
"""

from __future__ import annotations

from typing import Any

from chronomq.raftlog.store import Store
from chronomq.timer.message import TIMER_QUEUE, TIMER_TOPIC

CHUNK_RECORDS = 8192
MAX_CHUNKS = 16


class TimerHold:
    def __init__(self) -> None:
        self._low_water = -1  # TimerLog position before which every record was read

    def lowest_needed_offset(self, machine: Any, store: Store) -> int | None:
        """The lowest CommitLog offset a waiting timer message lives at; None when none waits.

        ``machine`` is the :class:`chronomq.timer.machine.TimerMachine` registered on ``store``.
        Conservative when unsure: 0 keeps everything.
        """
        for _chunk in range(MAX_CHUNKS):
            with machine.lock:
                done, low = self._step(machine, store)
            if done:
                return low
        return 0  # the read part of the TimerLog is long: keep everything this time

    def _step(self, machine: Any, store: Store) -> tuple[bool, int | None]:
        st = machine.state
        tlog = machine.files.log
        if tlog.end_pos != st.log_end:
            return True, 0  # the files are being aligned: keep everything
        units = store.read_units(TIMER_TOPIC, TIMER_QUEUE, st.enqueue_offset, 1)
        low = units[0].commitlog_offset if units else None
        if st.cursor is None:
            return True, low
        cursor_slot = st.cursor.slot_ms
        if not tlog.start_pos <= self._low_water <= tlog.end_pos:
            self._low_water = tlog.start_pos
        reading = True  # still in the prefix of read records
        for scanned, (pos, rec) in enumerate(tlog.scan(self._low_water, tlog.end_pos), 1):
            if rec.slot_ms < cursor_slot:
                if reading:
                    self._low_water = pos
            else:
                if reading:
                    self._low_water = pos
                    reading = False
                low = rec.cl_offset if low is None else min(low, rec.cl_offset)
                if not rec.is_tombstone:
                    return True, low
            if scanned >= CHUNK_RECORDS:
                if reading:
                    return False, None  # go on from the low-water mark with the lock released
                return True, 0  # many cancels and read records in between: keep everything
        if reading:
            self._low_water = tlog.end_pos
        return True, low
