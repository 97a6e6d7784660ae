"""The timer's replicated state: a handful of kv entries of the replicated store.

Every field here changes only inside the apply of a timer command, identically on every
replica, and kv is part of the thin snapshot, so a restarted node or one that installed a
snapshot has exactly the state the log says. The timer's files (TimerLog, wheel) are derived
from it and re-aligned to :attr:`TimerState.log_end` when the node attaches
(:mod:`chronomq.timer.files`).

=======================  ================================================================
kv key                   value
=======================  ================================================================
``timer/cur``            read cursor ``"slot_ms,head,stop,next"``; absent until the first
                         timer command, which starts it at the slot of its propose time
``timer/enq``            next timer-topic ConsumeQueue offset to put into the wheel
``timer/tl``             TimerLog end position after the last timer command
``timer/rc``             TimerLog reclaim position: no apply reads a record before it, so
                         each node may delete the whole segments before it (absent: 0)
``timer/sw/enqueue``     ``1`` while enqueue is stopped cluster-wide (absent: running)
``timer/sw/dequeue``     ``1`` while delivery is stopped cluster-wide (absent: running)
``timer/n/<counter>``    running totals (enqueued, delivered, cancelled, rolled, ...)
``timer/bl/<topic>``     messages of ``topic`` waiting in the wheel (absent: none)
``timer/last``           propose time of the last command that delivered something
``timer/geom``           ``"precision_ms,wheel_slots,roll_window_slots,segment_bytes"`` of
                         the first timer command: every node must apply with the same
=======================  ================================================================
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from chronomq.timer.cursor import ReadCursor

PREFIX = "timer/"
CURSOR = "timer/cur"
ENQUEUE_OFFSET = "timer/enq"
LOG_END = "timer/tl"
RECLAIM = "timer/rc"
STOP_ENQUEUE = "timer/sw/enqueue"
STOP_DEQUEUE = "timer/sw/dequeue"
LAST_DELIVERED = "timer/last"
GEOMETRY = "timer/geom"
COUNTER_PREFIX = "timer/n/"
BACKLOG_PREFIX = "timer/bl/"

COUNTERS = (
    "enqueued",  # put into the wheel (messages and rolled copies; not cancels)
    "due_now",  # already due when enqueued: delivered by the same command
    "delivered",
    "cancelled",  # suppressed by a cancel when their slot was read
    "rolled",  # re-put into the timer topic
    "tombstones",  # cancels stored
    "skipped",  # unusable timer-topic records (no deliver time)
    "stale_spans",  # delivery commands that found the cursor moved on
)


def _int(value: object, default: int = 0) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


@dataclass(slots=True)
class TimerState:
    """An in-memory mirror of the ``timer/`` kv entries (see the module docstring)."""

    cursor: ReadCursor | None = None
    enqueue_offset: int = 0
    log_end: int = 0
    stop_enqueue: bool | None = None
    stop_dequeue: bool | None = None
    last_delivered_ms: int = 0
    counters: dict[str, int] = field(default_factory=dict)
    backlog: dict[str, int] = field(default_factory=dict)
    reclaim_pos: int = 0

    @classmethod
    def from_kv(cls, kv: Mapping[str, object]) -> TimerState:
        raw = kv.get(CURSOR)
        cursor = None
        if isinstance(raw, str):
            cursor = ReadCursor.from_tuple([int(x) for x in raw.split(",")])
        counters: dict[str, int] = {}
        backlog: dict[str, int] = {}
        for key, value in list(kv.items()):
            if key.startswith(COUNTER_PREFIX):
                counters[key[len(COUNTER_PREFIX) :]] = _int(value)
            elif key.startswith(BACKLOG_PREFIX):
                backlog[key[len(BACKLOG_PREFIX) :]] = _int(value)
        sw_enq, sw_deq = kv.get(STOP_ENQUEUE), kv.get(STOP_DEQUEUE)
        return cls(
            cursor=cursor,
            enqueue_offset=_int(kv.get(ENQUEUE_OFFSET)),
            log_end=_int(kv.get(LOG_END)),
            stop_enqueue=None if sw_enq is None else bool(sw_enq),
            stop_dequeue=None if sw_deq is None else bool(sw_deq),
            last_delivered_ms=_int(kv.get(LAST_DELIVERED)),
            counters=counters,
            backlog=backlog,
            reclaim_pos=_int(kv.get(RECLAIM)),
        )

    def copy(self) -> TimerState:
        return TimerState(
            self.cursor,
            self.enqueue_offset,
            self.log_end,
            self.stop_enqueue,
            self.stop_dequeue,
            self.last_delivered_ms,
            dict(self.counters),
            dict(self.backlog),
            self.reclaim_pos,
        )

    def kv_changes(self, before: TimerState) -> dict[str, int | str | None]:
        """The kv writes that turn ``before`` into this state (``None`` deletes)."""
        out: dict[str, int | str | None] = {}
        if self.cursor != before.cursor and self.cursor is not None:
            out[CURSOR] = ",".join(str(x) for x in self.cursor.as_tuple())
        if self.enqueue_offset != before.enqueue_offset:
            out[ENQUEUE_OFFSET] = self.enqueue_offset
        if self.log_end != before.log_end:
            out[LOG_END] = self.log_end
        if self.reclaim_pos != before.reclaim_pos:
            out[RECLAIM] = self.reclaim_pos
        for key, now, was in (
            (STOP_ENQUEUE, self.stop_enqueue, before.stop_enqueue),
            (STOP_DEQUEUE, self.stop_dequeue, before.stop_dequeue),
        ):
            if now != was:
                out[key] = None if now is None else int(now)
        if self.last_delivered_ms != before.last_delivered_ms:
            out[LAST_DELIVERED] = self.last_delivered_ms
        for name, value in self.counters.items():
            if before.counters.get(name) != value:
                out[COUNTER_PREFIX + name] = value
        for topic in self.backlog.keys() | before.backlog.keys():
            value = self.backlog.get(topic, 0)
            if value != before.backlog.get(topic, 0):
                out[BACKLOG_PREFIX + topic] = value if value > 0 else None
        return out

    def count(self, name: str, n: int = 1) -> None:
        if n:
            self.counters[name] = self.counters.get(name, 0) + n

    def add_backlog(self, topic: str, n: int) -> None:
        value = self.backlog.get(topic, 0) + n
        if value > 0:
            self.backlog[topic] = value
        else:
            self.backlog.pop(topic, None)

    @property
    def backlog_total(self) -> int:
        return sum(self.backlog.values())
