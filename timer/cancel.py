"""Cancel: the answer to ``DELETE /v1/timers/{msg_id}`` and whether to write a tombstone.

A cancel is a message in the timer topic carrying TIMER_DEL_UNIQKEY (the uniq key of its
target) and the target's deliver time, so it is enqueued like any timer message: into the
*cancel chain* of the target's slot (rolling along with the target while that slot is beyond
the roll window). When the slot is read, and again when each delivery command is applied
(:meth:`chronomq.timer.dequeue.DequeuePlanner.replay`), messages whose key is in the slot's cancel chain
are suppressed. Hence: a cancel committed before the delivery command is never outrun by it.

:func:`decide_cancel` runs where the cancel command is applied, against the committed read
cursor, so every replica gives the same answer:

- ``cancelled``: the target's slot is not fully read, the target is not among what was already
  handed out (or it was cancelled before); it will never be delivered.
- ``delivered``: the cursor is past the target (and no cancel was found in its slot).
- ``unknown``: we cannot tell, e.g. the slot's wheel cell now holds a later lap, or the target
  is not in the slot being read.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from chronomq.timer.chains import RecordReader, SlotReader, find_message, tombstone_keys
from chronomq.timer.cursor import ReadCursor
from chronomq.timer.slots import SlotGeometry


class CancelStatus(Enum):
    CANCELLED = "cancelled"
    DELIVERED = "delivered"
    UNKNOWN = "unknown"


@dataclass(frozen=True, slots=True)
class CancelDecision:
    status: CancelStatus
    #: Store the cancel message (and so its tombstone); false when it changes nothing.
    write_tombstone: bool
    reason: str


def decide_cancel(
    *,
    target_deliver_ms: int,
    key_hash: int,
    committed: ReadCursor,
    wheel: SlotReader,
    log: RecordReader,
    geometry: SlotGeometry,
    floor: int = 0,
) -> CancelDecision:
    """Answer a cancel of the message with uniq-key hash ``key_hash`` due at ``target_deliver_ms``;
    chains are read down to ``floor``, the replicated TimerLog reclaim position."""
    slot_ms = geometry.slot_ms(target_deliver_ms)
    cursor_ms = committed.slot_ms
    if slot_ms < cursor_ms:
        if cursor_ms - slot_ms >= geometry.window_ms:
            return CancelDecision(CancelStatus.UNKNOWN, False, "target slot is more than a lap old")
        slot = wheel.get(slot_ms)
        if slot.is_empty:
            return CancelDecision(CancelStatus.UNKNOWN, False, "target slot no longer in the wheel")
        if key_hash in tombstone_keys(log, slot, floor):
            return CancelDecision(
                CancelStatus.CANCELLED, False, "cancelled before its slot was read"
            )
        return CancelDecision(CancelStatus.DELIVERED, False, "its slot has been read")
    if not geometry.in_lap(slot_ms, cursor_ms):
        return CancelDecision(CancelStatus.CANCELLED, True, "target still rolling")
    slot = wheel.get(slot_ms)
    if key_hash in tombstone_keys(log, slot, floor):
        return CancelDecision(CancelStatus.CANCELLED, False, "already cancelled")
    if slot_ms == cursor_ms and committed.started:
        pos = find_message(log, slot, key_hash, floor)
        if pos is None:
            return CancelDecision(
                CancelStatus.UNKNOWN, False, "target not found in the slot being read"
            )
        if committed.has_read(pos):
            return CancelDecision(CancelStatus.DELIVERED, False, "already handed out from its slot")
    return CancelDecision(CancelStatus.CANCELLED, True, "its slot has not been read")
