"""The dequeue read cursor: which slot is being read, and how far into it.

A slot's main chain is read backwards, newest record first, in bounded batches. Records may
still be appended to a slot while it is read (a message committed just as its slot came due),
so a slot is read in *rounds*: a round starts at the slot's newest record (``head_pos``) and
walks back to where the previous round started (``stop_pos``; ``-1`` for the first round,
i.e. the start of the chain). ``next_pos`` is the next record to read; it equals ``stop_pos``
once the round is done. When a round ends and the slot has grown, a new round covers the new
records; otherwise the cursor moves to the next slot.

The cursor is part of every delivery command and of the checkpoint: it is the exact progress
of delivery, so after a failover nothing is skipped or delivered twice.
"""

from __future__ import annotations

from dataclasses import dataclass

from chronomq.timer.errors import TimerStateError
from chronomq.timer.timerlog import NO_POS


@dataclass(frozen=True, slots=True)
class ReadCursor:
    """Read progress: ``slot_ms`` and, once a round started, ``head``/``stop``/``next``."""

    slot_ms: int
    head_pos: int = NO_POS
    stop_pos: int = NO_POS
    next_pos: int = NO_POS

    def __post_init__(self) -> None:
        if self.head_pos == NO_POS:
            if self.stop_pos != NO_POS or self.next_pos != NO_POS:
                raise TimerStateError(f"cursor without a round must have no positions: {self}")
        elif not (
            self.stop_pos <= self.next_pos <= self.head_pos and self.stop_pos < self.head_pos
        ):
            raise TimerStateError(f"cursor positions out of order: {self}")
        if min(self.head_pos, self.stop_pos, self.next_pos) < NO_POS:
            raise TimerStateError(f"cursor positions must be >= -1: {self}")

    @classmethod
    def at(cls, slot_ms: int) -> ReadCursor:
        """A cursor at the start of a slot, nothing of it read yet."""
        return cls(slot_ms)

    @property
    def started(self) -> bool:
        """Whether a round of this slot has begun (some of it may have been delivered)."""
        return self.head_pos != NO_POS

    @property
    def round_done(self) -> bool:
        return self.started and self.next_pos == self.stop_pos

    def has_read(self, pos: int) -> bool:
        """Whether the record at ``pos`` of this cursor's slot has already been handed out."""
        if not self.started:
            return False
        if pos <= self.stop_pos:
            return True
        return self.next_pos < pos <= self.head_pos

    def as_tuple(self) -> tuple[int, int, int, int]:
        """Four integers for a command or a log line; see :meth:`from_tuple`."""
        return (self.slot_ms, self.head_pos, self.stop_pos, self.next_pos)

    @classmethod
    def from_tuple(cls, values: tuple[int, ...] | list[int]) -> ReadCursor:
        if len(values) != 4:
            raise TimerStateError(f"a cursor is 4 integers, got {len(values)}")
        return cls(int(values[0]), int(values[1]), int(values[2]), int(values[3]))
