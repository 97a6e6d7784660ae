"""Enqueue decisions: where a timer message (or a cancel) goes when it is read from the timer
topic, and the produce-time check of its deliver time.

For a message due at ``deliver_ms``, enqueued at ``now_ms`` while the committed read cursor is
at ``cursor_slot_ms``, with ``S`` the slot of ``deliver_ms``:

- ``S`` before the cursor: the slot was already read, chaining the message there would lose it.
  **DUE_NOW**: deliver it straight away (for a cancel: its target's slot is gone, drop it).
- ``S`` within the roll window from ``now`` and inside the unread lap: **INTO_WHEEL** at ``S``.
  That includes messages already due (``deliver_ms <= now_ms``) whose slot is still unread: the
  dequeue reaches them at once, in order, and a cancel can still find them there.
- otherwise: **ROLL**. The message waits in an earlier slot, flagged ROLLED; when that slot is
  read it is put back into the CommitLog (timer topic, same deliver time, roll count + 1) and
  enqueued again. The roll slot is the last of the roll window (clamped into the unread lap),
  always before ``S``, so the longest delay is bounded only by ``timer_max_delay_s``.

The decision must be the same on every replica: pass the leader-stamped store time of the
message as ``now_ms`` and the committed cursor as it stands at that point of the log.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from chronomq.timer.chains import append_linked
from chronomq.timer.config import TimerConfig
from chronomq.timer.errors import DelayTooLong, InvalidDeliverTime, TimerStateError
from chronomq.timer.slots import SlotGeometry
from chronomq.timer.timerlog import NO_POS, RecordFlags, TimerLog, TimerRecord
from chronomq.timer.wheel import TimerWheel


class EnqueueAction(Enum):
    DUE_NOW = "due_now"
    INTO_WHEEL = "into_wheel"
    ROLL = "roll"


@dataclass(frozen=True, slots=True)
class EnqueuePlan:
    action: EnqueueAction
    #: Slot to chain the record into; ``None`` for DUE_NOW.
    slot_ms: int | None
    #: Flags of the TimerLog record (TOMBSTONE for a cancel, ROLLED when rolling).
    flags: RecordFlags
    deliver_ms: int


def resolve_deliver_ms(
    now_ms: int,
    *,
    deliver_at_ms: int | None = None,
    delay_ms: int | None = None,
    delay_sec: int | None = None,
) -> int:
    """The absolute deliver time from the one delay field a producer gave."""
    given = {
        name: value
        for name, value in (
            ("deliver_at_ms", deliver_at_ms),
            ("delay_ms", delay_ms),
            ("delay_sec", delay_sec),
        )
        if value is not None
    }
    if len(given) != 1:
        raise InvalidDeliverTime(
            "give exactly one of deliver_at_ms, delay_ms and delay_sec",
            field=next(iter(given), None),
        )
    name, value = next(iter(given.items()))
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidDeliverTime(f"{name} must be an integer, got {value!r}", field=name)
    if name != "deliver_at_ms" and value < 0:
        raise InvalidDeliverTime(f"{name} must not be negative, got {value}", field=name)
    if name == "deliver_at_ms":
        return value
    return now_ms + (value if name == "delay_ms" else value * 1000)


def check_deliver_time(
    deliver_ms: int, now_ms: int, config: TimerConfig, *, field: str = "deliver_at_ms"
) -> int:
    """Accept or reject a deliver time at produce time; return the delay in ms (>= 0).

    A time in the past is accepted (delivered at once); one further ahead than
    ``timer_max_delay_s`` is refused with :class:`DelayTooLong`.
    """
    if isinstance(deliver_ms, bool) or not isinstance(deliver_ms, int) or deliver_ms < 0:
        raise InvalidDeliverTime(
            f"{field} must be a non-negative integer, got {deliver_ms!r}", field=field
        )
    delay_ms = deliver_ms - now_ms
    if delay_ms > config.max_delay_ms:
        raise DelayTooLong(
            f"{field} is {delay_ms} ms ahead, beyond timer_max_delay_s="
            f"{config.timer_max_delay_s} ({config.max_delay_ms} ms)",
            field=field,
        )
    return max(delay_ms, 0)


def plan_enqueue(
    *,
    deliver_ms: int,
    now_ms: int,
    cursor_slot_ms: int,
    geometry: SlotGeometry,
    tombstone: bool = False,
) -> EnqueuePlan:
    """Decide DUE_NOW, INTO_WHEEL or ROLL (see the module docstring)."""
    base = RecordFlags.TOMBSTONE if tombstone else RecordFlags.NONE
    slot_ms = geometry.slot_ms(deliver_ms)
    cursor = geometry.slot_ms(cursor_slot_ms)
    if slot_ms < cursor:
        return EnqueuePlan(EnqueueAction.DUE_NOW, None, base, deliver_ms)
    if geometry.in_roll_window(deliver_ms, now_ms) and geometry.in_lap(slot_ms, cursor):
        return EnqueuePlan(EnqueueAction.INTO_WHEEL, slot_ms, base, deliver_ms)
    roll_ms = geometry.roll_slot_ms(now_ms, cursor)
    return EnqueuePlan(EnqueueAction.ROLL, roll_ms, base | RecordFlags.ROLLED, deliver_ms)


@dataclass(frozen=True, slots=True)
class TimerMessage:
    """What the enqueue needs to know of a message read from the timer topic."""

    cl_offset: int
    cl_size: int
    deliver_ms: int
    #: Leader-stamped store time: the ``now_ms`` of the enqueue decision on every replica.
    store_ms: int
    #: For a message: hash of its own uniq key; for a cancel: of the key it cancels.
    key_hash: int
    topic_hash: int = 0
    roll_count: int = 0
    tombstone: bool = False


@dataclass(frozen=True, slots=True)
class EnqueueResult:
    plan: EnqueuePlan
    #: TimerLog position of the new record; ``None`` for DUE_NOW.
    pos: int | None


def enqueue(
    message: TimerMessage, *, cursor_slot_ms: int, log: TimerLog, wheel: TimerWheel
) -> EnqueueResult:
    """Plan ``message`` with its store time as ``now_ms`` and chain it unless DUE_NOW.

    DUE_NOW is left to the caller: deliver the message (a cancel: nothing to do).
    """
    plan = plan_enqueue(
        deliver_ms=message.deliver_ms,
        now_ms=message.store_ms,
        cursor_slot_ms=cursor_slot_ms,
        geometry=wheel.geometry,
        tombstone=message.tombstone,
    )
    if plan.slot_ms is None:
        return EnqueueResult(plan, None)
    if message.key_hash == 0 and message.tombstone:
        raise TimerStateError("a cancel must carry the key hash of its target")
    record = TimerRecord(
        prev_pos=NO_POS,
        flags=plan.flags,
        write_ms=message.store_ms,
        deliver_ms=message.deliver_ms,
        slot_ms=plan.slot_ms,
        cl_offset=message.cl_offset,
        cl_size=message.cl_size,
        topic_hash=message.topic_hash,
        key_hash=message.key_hash,
        roll_count=message.roll_count,
    )
    return EnqueueResult(plan, append_linked(log, wheel, record))
