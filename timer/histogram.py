"""What falls due when: a histogram of the wheel's slots from ``now`` on, for the console.

The wheel knows, per slot, how many messages its main chain holds (``count``: messages to
deliver and rolled copies to re-put) and how many cancels aim at it (``tomb_count``). Summing
the counts of the slots in ``[start, start + bucket_ms)`` gives what falls due in that bucket,
as this node's wheel holds it. A slot whose cell holds another lap reads as empty.

Slots the read cursor has not passed but whose time has come are *overdue* (the read-behind);
they are summed apart, at most :data:`MAX_OVERDUE_SLOTS` of them (the newest).

Plain arithmetic over a :class:`~chronomq.timer.chains.SlotReader`: no clock is read, the caller passes
``now_ms`` and the cursor.
"""

from __future__ import annotations

from dataclasses import dataclass

from chronomq.timer.chains import SlotReader
from chronomq.timer.slots import SlotGeometry

MAX_SLOTS = 36_000 * 10
"""At most this many slots are read for one histogram (an hour at 10 ms precision)."""
MAX_OVERDUE_SLOTS = 36_000
"""Overdue slots read at most (the newest ones when the cursor lags further)."""


@dataclass(frozen=True, slots=True)
class Bucket:
    start_ms: int
    messages: int
    cancels: int


@dataclass(frozen=True, slots=True)
class DueHistogram:
    from_ms: int
    to_ms: int
    bucket_ms: int
    buckets: tuple[Bucket, ...]
    overdue_messages: int
    overdue_from_ms: int | None
    overdue_complete: bool

    @property
    def total(self) -> int:
        return sum(b.messages for b in self.buckets)

    def as_json(self) -> dict[str, object]:
        return {
            "from_ms": self.from_ms,
            "to_ms": self.to_ms,
            "bucket_ms": self.bucket_ms,
            "total": self.total,
            "buckets": [
                {"start_ms": b.start_ms, "messages": b.messages, "cancels": b.cancels}
                for b in self.buckets
            ],
            "overdue": {
                "messages": self.overdue_messages,
                "from_ms": self.overdue_from_ms,
                "complete": self.overdue_complete,
            },
        }


def due_histogram(
    wheel: SlotReader,
    geometry: SlotGeometry,
    *,
    now_ms: int,
    span_ms: int,
    buckets: int,
    cursor_slot_ms: int | None,
) -> DueHistogram:
    """Messages falling due in ``buckets`` equal buckets covering ``span_ms`` from the slot of
    ``now_ms``; with the read cursor's slot, the overdue messages before it."""
    if buckets < 1 or span_ms < buckets:
        raise ValueError(f"cannot cut {span_ms} ms into {buckets} buckets")
    p = geometry.precision_ms
    start = geometry.slot_ms(now_ms)
    bucket_ms = -(-span_ms // buckets)
    bucket_ms = -(-bucket_ms // p) * p  # whole slots per bucket
    if bucket_ms * buckets // p > MAX_SLOTS:
        raise ValueError(f"a histogram reads at most {MAX_SLOTS} slots")
    out = []
    for i in range(buckets):
        b_start = start + i * bucket_ms
        messages = cancels = 0
        for slot_ms in range(b_start, b_start + bucket_ms, p):
            slot = wheel.get(slot_ms)
            messages += slot.count
            cancels += slot.tomb_count
        out.append(Bucket(b_start, messages, cancels))
    overdue = 0
    overdue_from: int | None = None
    complete = True
    if cursor_slot_ms is not None and cursor_slot_ms < start:
        first = geometry.slot_ms(cursor_slot_ms)
        if (start - first) // p > MAX_OVERDUE_SLOTS:
            first = start - MAX_OVERDUE_SLOTS * p
            complete = False
        overdue_from = first
        for slot_ms in range(first, start, p):
            overdue += wheel.get(slot_ms).count
    return DueHistogram(
        start, start + buckets * bucket_ms, bucket_ms, tuple(out), overdue, overdue_from, complete
    )
