"""The consumer's bookkeeping, without I/O: which queues to read from where, what the
application has finished, what to commit and when. Times are monotonic seconds passed in.

A message counts as finished when the application asks for the next one, commits, sends it
back with ``reconsume_later()``, or closes the consumer without an exception. Offsets are
committed only up to finished messages, so a crash in the middle of one hands it out again
(at-least-once), and a commit never moves an offset backwards.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from chronomq._model import MessageData, retry_topic

QueueKey = tuple[str, int]
Start = Literal["earliest", "latest"]


@dataclass(frozen=True, slots=True)
class FetchStart:
    """Start reading ``topic``/``queue`` at ``offset``."""

    topic: str
    queue: int
    offset: int


class ConsumerState:
    def __init__(
        self,
        group: str,
        topics: Sequence[str],
        *,
        start: Start,
        auto_commit_interval_s: float | None,
        refresh_interval_s: float,
        now: float,
    ) -> None:
        if not group:
            raise ValueError("a consumer needs a group")
        if not topics:
            raise ValueError("a consumer needs at least one topic")
        if start not in ("earliest", "latest"):
            raise ValueError(f"start must be 'earliest' or 'latest', not {start!r}")
        self.group = group
        self.retry_topic = retry_topic(group)
        self.topics = [*dict.fromkeys(topics)]
        if self.retry_topic not in self.topics:
            self.topics.append(self.retry_topic)
        self.start = start
        self.auto_commit_interval_s = auto_commit_interval_s
        self.refresh_interval_s = refresh_interval_s
        self.fetching: dict[QueueKey, int] = {}
        """Queues being read, with the offset reading started at."""
        self._seen: set[str] = set()
        """Topics described at least once (existing or not)."""
        self.done: dict[QueueKey, int] = {}
        self.committed: dict[QueueKey, int] = {}
        self.in_hand: MessageData | None = None
        self.next_refresh = now
        self.next_commit = now + (auto_commit_interval_s or 0.0)

    # ------------------------------------------------------------------ which queues

    def plan(
        self,
        topic: str,
        described: Mapping[str, Any] | None,
        offsets: Iterable[Mapping[str, Any]],
    ) -> list[FetchStart]:
        """Queues of ``topic`` to start reading, from ``GET /v1/topics/{topic}`` (None: no
        such topic yet) and the group's committed offsets for it.

        A queue resumes at the committed offset; without one, at the start the consumer was
        given, except in a topic or queue that appeared while the consumer ran (the retry
        topic, a topic created later, queues added), which is read from its first message."""
        first_look = topic not in self._seen
        self._seen.add(topic)
        if described is None:
            return []
        committed = {
            int(o["queue"]): int(o["offset"]) for o in offsets if o.get("topic", topic) == topic
        }
        out: list[FetchStart] = []
        for q in described.get("queues", ()):
            queue = int(q["queue"])
            key = (topic, queue)
            if key in self.fetching:
                continue
            if queue in committed:
                offset = committed[queue]
                self.committed[key] = offset
            elif first_look and self.start == "latest" and topic != self.retry_topic:
                offset = int(q["max_offset"])
            else:
                offset = int(q["min_offset"])
            self.fetching[key] = offset
            self.done.setdefault(key, offset)
            out.append(FetchStart(topic, queue, offset))
        return out

    def refresh_due(self, now: float) -> bool:
        return now >= self.next_refresh

    def refreshed(self, now: float) -> None:
        self.next_refresh = now + self.refresh_interval_s

    def refresh_soon(self, now: float, within_s: float = 0.5) -> None:
        """Look for new queues soon (a send-back may just have created the retry topic)."""
        self.next_refresh = min(self.next_refresh, now + within_s)

    # ------------------------------------------------------------------ progress

    def hand_out(self, message: MessageData) -> None:
        """``message`` goes to the application; the one it had before is finished."""
        self.finish_in_hand()
        self.in_hand = message

    def finish(self, message: MessageData) -> None:
        key = (message.topic, message.queue)
        if message.offset + 1 > self.done.get(key, 0):
            self.done[key] = message.offset + 1
        if self.in_hand is message:
            self.in_hand = None

    def finish_in_hand(self) -> None:
        if self.in_hand is not None:
            self.finish(self.in_hand)

    def to_commit(self) -> dict[QueueKey, int]:
        """Offsets finished past what was committed."""
        return {
            k: v
            for k, v in self.done.items()
            if v > self.committed.get(k, self.fetching.get(k, -1))
        }

    def commit_done(self, key: QueueKey, offset: int) -> None:
        if offset > self.committed.get(key, -1):
            self.committed[key] = offset

    def commit_due(self, now: float) -> bool:
        return self.auto_commit_interval_s is not None and now >= self.next_commit

    def auto_committed(self, now: float) -> None:
        if self.auto_commit_interval_s is not None:
            self.next_commit = now + self.auto_commit_interval_s

    def wait_s(self, now: float, cap_s: float) -> float:
        """How long the application may wait for a message before there is work to do."""
        until = self.next_refresh
        if self.auto_commit_interval_s is not None:
            until = min(until, self.next_commit)
        return max(0.0, min(cap_s, until - now))
