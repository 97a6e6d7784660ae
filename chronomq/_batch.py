"""Batching of produced messages, without I/O: a batch per topic leaves when it is full or
its oldest message has waited ``linger_s``. Times are monotonic seconds passed in."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

T = TypeVar("T")


@dataclass(slots=True)
class _Pending(Generic[T]):
    message: dict[str, Any]
    waiter: T
    since: float


class Batcher(Generic[T]):
    """Messages waiting to be sent, per topic, each with its ``waiter`` (a future)."""

    def __init__(self, max_batch: int, linger_s: float, max_pending: int) -> None:
        if not 1 <= max_batch <= max_pending:
            raise ValueError("need 1 <= max_batch <= max_pending")
        if linger_s < 0:
            raise ValueError("linger must not be negative")
        self.max_batch = max_batch
        self.linger_s = linger_s
        self.max_pending = max_pending
        self._topics: dict[str, deque[_Pending[T]]] = {}
        self.pending = 0

    def full(self) -> bool:
        return self.pending >= self.max_pending

    def add(self, topic: str, message: dict[str, Any], waiter: T, now: float) -> None:
        self._topics.setdefault(topic, deque()).append(_Pending(message, waiter, now))
        self.pending += 1

    def take(self, now: float, flush: bool = False) -> tuple[str, list[tuple[dict[str, Any], T]]]:
        """The next batch due (the topic whose oldest message waited longest), or ("", [])."""
        best: str | None = None
        for topic, q in self._topics.items():
            due = flush or len(q) >= self.max_batch or now - q[0].since >= self.linger_s
            if due and (best is None or q[0].since < self._topics[best][0].since):
                best = topic
        if best is None:
            return "", []
        q = self._topics[best]
        batch = [q.popleft() for _ in range(min(self.max_batch, len(q)))]
        if not q:
            del self._topics[best]
        self.pending -= len(batch)
        return best, [(p.message, p.waiter) for p in batch]

    def wait_s(self, now: float) -> float | None:
        """Until the next batch is due; None when nothing waits."""
        if not self._topics:
            return None
        soonest = min(
            0.0 if len(q) >= self.max_batch else q[0].since + self.linger_s - now
            for q in self._topics.values()
        )
        return max(0.0, soonest)
