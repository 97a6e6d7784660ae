"""Flow control: per-slot congestion at produce time, and rate meters.

A slot holding ``count`` messages, with ``limit = timer_congest_num_each_slot``, rejects a new
message with probability::

    0                                   if count < limit
    min(1, (count - limit + 1) / limit)  otherwise: 1/limit at the limit, 1 from 2*limit - 1

so a fuller slot never rejects less often than an emptier one, and for any one random draw a
message rejected at ``count`` is rejected at every larger count. (RocketMQ's ``isReject`` has
the comparison the wrong way round: there the chance of rejection *falls* as the slot fills.)

The check runs on the leader before proposing, so it may use randomness: callers pass a draw
in ``[0, 1)`` (from a seeded ``random.Random`` in tests). Cancels are never refused by
congestion, only by :func:`check_cancel_room`.
"""

from __future__ import annotations

from chronomq.timer.errors import SlotCongested, TooManyTombstones
from chronomq.timer.wheel import Slot


def rejection_probability(count: int, limit: int) -> float:
    """Chance that a slot holding ``count`` messages refuses one more (see module docstring)."""
    if count < limit:
        return 0.0
    return min(1.0, (count - limit + 1) / limit)


def check_congestion(slot: Slot, limit: int, draw: float, *, field: str | None = None) -> None:
    """Raise :class:`SlotCongested` when the slot refuses a new message for this ``draw``."""
    probability = rejection_probability(slot.count, limit)
    if probability > 0.0 and draw < probability:
        raise SlotCongested(
            f"timer slot at {slot.slot_ms} ms already holds {slot.count} messages "
            f"(timer_congest_num_each_slot={limit}); retry later or choose another deliver time",
            slot_ms=slot.slot_ms,
            count=slot.count,
            limit=limit,
            field=field,
        )


def check_cancel_room(slot: Slot, limit: int) -> None:
    """Raise :class:`TooManyTombstones` when the slot holds ``limit`` cancels already."""
    if slot.tomb_count >= limit:
        raise TooManyTombstones(
            f"timer slot at {slot.slot_ms} ms already holds {slot.tomb_count} cancels "
            f"(timer_max_tombstones_each_slot={limit}); retry later",
            slot_ms=slot.slot_ms,
            count=slot.tomb_count,
            limit=limit,
        )


class RateMeter:
    """Events per second over a sliding window of fixed buckets; memory is ``buckets`` ints.

    Time is given, never read. A ``now_ms`` earlier than one already seen (by :meth:`add` or
    :meth:`rate_per_s`) counts as the latest seen: wall clocks step back, the meter does not.
    """

    __slots__ = ("_bucket_ms", "_counts", "_epochs", "_latest_ms", "total")

    def __init__(self, window_ms: int = 10_000, buckets: int = 10) -> None:
        if buckets < 1 or window_ms < buckets or window_ms % buckets:
            raise ValueError("window_ms must be a positive multiple of buckets")
        self._bucket_ms = window_ms // buckets
        self._counts = [0] * buckets
        self._epochs = [-1] * buckets
        self._latest_ms = 0
        self.total = 0

    @property
    def window_ms(self) -> int:
        return self._bucket_ms * len(self._counts)

    def add(self, now_ms: int, count: int = 1) -> None:
        now_ms = self._latest_ms = max(now_ms, self._latest_ms)
        epoch = now_ms // self._bucket_ms
        i = epoch % len(self._counts)
        if self._epochs[i] != epoch:
            self._epochs[i] = epoch
            self._counts[i] = 0
        self._counts[i] += count
        self.total += count

    def rate_per_s(self, now_ms: int) -> float:
        """Events per second in the window ending at ``now_ms`` (its current bucket included)."""
        now_ms = self._latest_ms = max(now_ms, self._latest_ms)
        epoch = now_ms // self._bucket_ms
        n = len(self._counts)
        events = sum(
            c for c, e in zip(self._counts, self._epochs, strict=True) if epoch - n < e <= epoch
        )
        return events * 1000 / self.window_ms
