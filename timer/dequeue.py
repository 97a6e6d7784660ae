"""Dequeue: walk the wheel from the read cursor up to now and say what to deliver.

Two halves, one walk:

- :meth:`DequeuePlanner.plan` runs on the leader. From the committed (or in-flight) cursor it
  walks due slots, reads each slot's main chain newest first, and returns a
  :class:`DequeueBatch`: the items (deliver, re-put a rolled message, or suppress a cancelled
  one) and a :class:`DequeueSpan` = (from cursor, to cursor, TimerLog end when planned). At
  most ``max_records`` items and ``max_slots`` slots per batch, so a slot with a million
  records is delivered in many batches, the cursor holding the position inside the slot.
- :meth:`DequeuePlanner.replay` runs where the delivery command is applied, on every replica.
  The command carries only the span. Replay checks the span starts at the committed cursor
  (else the command is stale: another leader moved on) and walks the same records again, over
  the TimerLog as it stands *now* in the log order:

  * cancels are read again, so a cancel committed after the leader planned but before this
    command still suppresses its target: *a cancel committed before delivery wins*;
  * records appended at or after the span's ``end_pos`` to a slot the span finishes (a message
    committed while the batch was in flight) are returned as ``late`` items instead of being
    skipped for ever; records appended to the slot the span stops inside are left to a later
    round of that slot.

  Replay reads nothing but the TimerLog and the wheel, so every replica that enqueued the
  same log agrees on the outcome. Its items are the ones to act on; the plan's are a preview.

A batch holding a re-put (a rolled message) ends with that slot: re-put cancels must reach the
TimerLog (when this command is applied) before any later slot is replayed.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from chronomq.timer.chains import RecordReader, SlotReader, tombstone_keys
from chronomq.timer.cursor import ReadCursor
from chronomq.timer.errors import ChainBroken, StaleCursor, TimerStateError
from chronomq.timer.slots import SlotGeometry
from chronomq.timer.timerlog import NO_POS, TimerRecord
from chronomq.timer.wheel import Slot


class ItemAction(Enum):
    DELIVER = "deliver"
    REPUT = "reput"
    SUPPRESS = "suppress"


@dataclass(frozen=True, slots=True)
class DequeueItem:
    pos: int
    record: TimerRecord
    action: ItemAction
    #: Appended after the batch was planned; found by replay in a slot the batch finished.
    late: bool = False


@dataclass(frozen=True, slots=True)
class DequeueSpan:
    """The progress a delivery command makes: all a replica needs to replay it."""

    from_cursor: ReadCursor
    to_cursor: ReadCursor
    end_pos: int

    def as_tuple(self) -> tuple[int, ...]:
        """Nine integers: from cursor, to cursor, end position."""
        return (*self.from_cursor.as_tuple(), *self.to_cursor.as_tuple(), self.end_pos)

    @classmethod
    def from_tuple(cls, values: tuple[int, ...] | list[int]) -> DequeueSpan:
        if len(values) != 9:
            raise TimerStateError(f"a dequeue span is 9 integers, got {len(values)}")
        return cls(
            ReadCursor.from_tuple(tuple(values[0:4])),
            ReadCursor.from_tuple(tuple(values[4:8])),
            int(values[8]),
        )


def _deliveries(items: tuple[DequeueItem, ...]) -> tuple[tuple[int, int], ...]:
    return tuple(
        (i.record.cl_offset, i.record.cl_size) for i in items if i.action is ItemAction.DELIVER
    )


@dataclass(frozen=True, slots=True)
class DequeueBatch:
    span: DequeueSpan
    items: tuple[DequeueItem, ...]
    slots_scanned: int

    @property
    def cursor(self) -> ReadCursor:
        return self.span.to_cursor

    @property
    def is_noop(self) -> bool:
        """Nothing read and the cursor did not move: nothing worth proposing."""
        return not self.items and self.span.to_cursor == self.span.from_cursor

    @property
    def deliveries(self) -> tuple[tuple[int, int], ...]:
        """(CommitLog offset, size) of the messages to deliver, in chain order."""
        return _deliveries(self.items)


@dataclass(frozen=True, slots=True)
class ReplayResult:
    #: The span does not start at the committed cursor: apply nothing.
    stale: bool
    items: tuple[DequeueItem, ...]
    #: The committed cursor after this command.
    cursor: ReadCursor

    @property
    def deliveries(self) -> tuple[tuple[int, int], ...]:
        return _deliveries(self.items)

    @property
    def reputs(self) -> tuple[DequeueItem, ...]:
        return tuple(i for i in self.items if i.action is ItemAction.REPUT)


def classify(record: TimerRecord, cancelled_keys: frozenset[int]) -> ItemAction:
    """A rolled record is re-put; a message whose key is cancelled in its slot is suppressed."""
    if record.is_rolled:
        return ItemAction.REPUT
    if record.key_hash and record.key_hash in cancelled_keys:
        return ItemAction.SUPPRESS
    return ItemAction.DELIVER


class DequeuePlanner:
    """Plans and replays dequeue batches (see the module docstring). Keeps only a one-slot
    cache of cancel keys between calls; all progress lives in the cursors."""

    def __init__(self, geometry: SlotGeometry, *, max_records: int = 512, max_slots: int = 1000):
        if max_records < 1 or max_slots < 1:
            raise TimerStateError("max_records and max_slots must be at least 1")
        self._geometry = geometry
        self._max_records = max_records
        self._max_slots = min(max_slots, geometry.slot_count)  # a span never exceeds a lap
        self._tomb_key: tuple[int, int] | None = None
        self._tomb_value: frozenset[int] = frozenset()

    def plan(
        self, cursor: ReadCursor, now_ms: int, wheel: SlotReader, log: RecordReader
    ) -> DequeueBatch:
        """Walk due slots from ``cursor`` (never one whose last millisecond is after now).

        Raises :class:`StaleCursor` when ``cursor`` is inside a slot whose cell has since been
        taken by a later lap: the committed cursor moved on (another leader's batches
        committed); plan again from it.
        """
        g = self._geometry
        cur = cursor
        items: list[DequeueItem] = []
        scanned = 0
        rolled = False
        while len(items) < self._max_records and scanned < self._max_slots:
            if not g.is_due(cur.slot_ms, now_ms):
                break
            slot = wheel.get(cur.slot_ms)
            scanned += 1
            if not cur.started:
                if slot.last_pos == NO_POS:
                    cur = ReadCursor.at(g.next_slot_ms(cur.slot_ms))
                    continue
                cur = ReadCursor(cur.slot_ms, slot.last_pos, NO_POS, slot.last_pos)
            elif slot.last_pos < cur.head_pos:
                raise StaleCursor(f"slot {cur.slot_ms} no longer holds what {cur} was reading")
            cancelled = self._cancelled(log, slot)
            while not cur.round_done and len(items) < self._max_records:
                pos, record = self._read(log, cur)
                action = classify(record, cancelled)
                rolled = rolled or action is ItemAction.REPUT
                items.append(DequeueItem(pos, record, action))
                cur = ReadCursor(cur.slot_ms, cur.head_pos, cur.stop_pos, record.prev_pos)
            if not cur.round_done:
                break
            if slot.last_pos != cur.head_pos:
                cur = ReadCursor(cur.slot_ms, slot.last_pos, cur.head_pos, slot.last_pos)
                continue
            cur = ReadCursor.at(g.next_slot_ms(cur.slot_ms))
            if rolled:
                break
        span = DequeueSpan(cursor, cur, log.end_pos)
        return DequeueBatch(span, tuple(items), scanned)

    def replay(
        self, span: DequeueSpan, committed: ReadCursor, wheel: SlotReader, log: RecordReader
    ) -> ReplayResult:
        """Re-walk ``span`` over the current TimerLog; see the module docstring."""
        if span.from_cursor != committed:
            return ReplayResult(True, (), committed)
        g = self._geometry
        to = span.to_cursor
        if not 0 <= g.slots_between(committed.slot_ms, to.slot_ms) - 1 <= g.slot_count:
            raise ChainBroken(f"dequeue span {span} goes backwards or beyond one lap")
        cur = committed
        items: list[DequeueItem] = []
        while cur != to:
            if cur.slot_ms > to.slot_ms:
                raise ChainBroken(f"dequeue span {span} does not replay: passed {to}")
            slot = wheel.get(cur.slot_ms)
            last, late = self._split_late(log, slot, span.end_pos)
            if not cur.started:
                if last == NO_POS:
                    items.extend(self._late_items(log, slot, late))
                    cur = ReadCursor.at(g.next_slot_ms(cur.slot_ms))
                    continue
                cur = ReadCursor(cur.slot_ms, last, NO_POS, last)
            cancelled = self._cancelled(log, slot)
            while not cur.round_done and cur != to:
                pos, record = self._read(log, cur)
                items.append(DequeueItem(pos, record, classify(record, cancelled)))
                cur = ReadCursor(cur.slot_ms, cur.head_pos, cur.stop_pos, record.prev_pos)
            if cur == to:
                break
            if last != cur.head_pos:
                cur = ReadCursor(cur.slot_ms, last, cur.head_pos, last)
                continue
            items.extend(self._late_items(log, slot, late))
            cur = ReadCursor.at(g.next_slot_ms(cur.slot_ms))
        return ReplayResult(False, tuple(items), to)

    # ---------------------------------------------------------------- helpers

    def _read(self, log: RecordReader, cur: ReadCursor) -> tuple[int, TimerRecord]:
        pos = cur.next_pos
        record = log.read(pos)
        if record.slot_ms != cur.slot_ms or record.in_tombstone_chain:
            raise ChainBroken(
                f"main chain of slot {cur.slot_ms} holds a record of slot {record.slot_ms}", pos=pos
            )
        if not cur.stop_pos <= record.prev_pos < pos:
            raise ChainBroken(
                f"main chain of slot {cur.slot_ms} steps from {pos} to {record.prev_pos}, "
                f"expected a position in [{cur.stop_pos}, {pos})",
                pos=pos,
            )
        return pos, record

    def _split_late(
        self, log: RecordReader, slot: Slot, end_pos: int
    ) -> tuple[int, list[tuple[int, TimerRecord]]]:
        """The newest record of the main chain before ``end_pos``, and those at or after it."""
        late: list[tuple[int, TimerRecord]] = []
        pos = slot.last_pos
        while pos >= end_pos:
            record = log.read(pos)
            if record.slot_ms != slot.slot_ms or record.prev_pos >= pos:
                raise ChainBroken(f"main chain of slot {slot.slot_ms} is inconsistent", pos=pos)
            late.append((pos, record))
            pos = record.prev_pos
        return pos, late

    def _late_items(
        self, log: RecordReader, slot: Slot, late: list[tuple[int, TimerRecord]]
    ) -> list[DequeueItem]:
        if not late:
            return []
        cancelled = self._cancelled(log, slot)
        return [DequeueItem(pos, rec, classify(rec, cancelled), late=True) for pos, rec in late]

    def _cancelled(self, log: RecordReader, slot: Slot) -> frozenset[int]:
        if slot.tomb_last_pos == NO_POS:
            return frozenset()
        key = (slot.slot_ms, slot.tomb_last_pos)
        if self._tomb_key != key:
            self._tomb_value = tombstone_keys(log, slot)
            self._tomb_key = key
        return self._tomb_value
