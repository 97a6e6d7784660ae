"""Finding a message by msg_id, or by key in a topic: where it is stored, where it waits,
when it is due, when (and where) it was delivered. For ``GET /v1/messages/{msg_id}`` and
``GET /v1/topics/{topic}/messages?key=`` (the console's Messages view).

There is no index by id or key (RocketMQ keeps an IndexFile for that); the search uses what the
id carries and what the queues are ordered by:

- A plain or delay-level message's id starts with its store time (48 bits of ms,
  :meth:`chronomq.raftlog.record.MessageIdSource.next_id`), and a queue is in store order: a binary
  search on store time finds where to look in each queue, and a short scan of
  ``[t - SKEW_MS, t + SKEW_MS]`` (store times come from successive leaders' clocks) finds it.
  Found in ``SCHEDULE_TOPIC_XXXX``, it is a level message: due at its unit's tagsCode, waiting
  while the level's replicated offset has not passed it, then delivered to its ``REAL_TOPIC``
  with the same id, searched from its due time on.
- A timer message's id carries its deliver time (:func:`chronomq.timer.message.new_timer_id`): its wheel
  slot says whether it waits, was cancelled or was read (:meth:`TimerService.locate`), and
  points at its stored record.
- By key: the topic's queues and the delayed messages bound for it (schedule and timer topics
  with ``REAL_TOPIC`` = the topic) are scanned newest first, each id found then looked up.

Every search is bounded (:data:`MAX_READS` record reads); an answer says when it was cut short.
Blocking reads: run it off the event loop.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from chronomq.raftlog import record
from chronomq.raftlog.errors import RaftLogError
from chronomq.raftlog.store import Store
from chronomq.schedule.levels import SCHEDULE_TOPIC
from chronomq.schedule.properties import REAL_QID, REAL_TOPIC
from chronomq.timer.message import TIMER_TOPIC

SKEW_MS = 10_000
"""How far apart two leaders' clocks may put store times of consecutive records."""
MAX_READS = 50_000
"""Records read at most by one lookup."""
MAX_KEY_RESULTS = 50
PAGE = 256


class SearchExhausted(Exception):
    """The read budget ran out before the search could finish."""


@dataclass
class _Budget:
    left: int = MAX_READS
    reads: int = 0

    def take(self, n: int = 1) -> None:
        if self.left < n:
            raise SearchExhausted
        self.left -= n
        self.reads += n


@dataclass(frozen=True, slots=True)
class _Hit:
    topic: str
    queue: int
    offset: int
    store_ms: int
    tags_code: int
    msg_id: bytes
    properties: dict[str, str] = field(default_factory=dict)

    def place(self) -> dict[str, Any]:
        return {
            "topic": self.topic,
            "queue": self.queue,
            "offset": self.offset,
            "store_ms": self.store_ms,
        }


class Finder:
    """One lookup over a node's store (and its timer's wheel)."""

    def __init__(
        self,
        store: Store,
        *,
        level_offset: Callable[[int], int] | None,
        timer_locate: Callable[[bytes], dict[str, Any] | None] | None,
    ) -> None:
        self._store = store
        self._level_offset = level_offset
        self._timer_locate = timer_locate
        self.budget = _Budget()

    # ------------------------------------------------------------------ reading

    def _queues(self, topic: str) -> range:
        n = self._store.queue_count(topic)
        return range(n or 0)

    def _hit(self, topic: str, queue: int, offset: int) -> _Hit | None:
        self.budget.take()
        units = self._store.read_units(topic, queue, offset, 1)
        if not units:
            return None
        u = units[0]
        data = self._store.read_record(u.commitlog_offset, u.size)
        msg_id, store_ms, props = record.head(data)
        return _Hit(topic, queue, offset, store_ms, u.tags_code, msg_id, props)

    def _first_at_or_after(self, topic: str, queue: int, t_ms: int) -> int:
        """The first offset whose record was stored at or after ``t_ms`` (store order)."""
        lo = self._store.min_offset(topic, queue)
        hi = self._store.max_offset(topic, queue)
        while lo < hi:
            mid = (lo + hi) // 2
            hit = self._hit(topic, queue, mid)
            if hit is None or hit.store_ms >= t_ms:
                hi = mid
            else:
                lo = mid + 1
        return lo

    def _forward(self, topic: str, queue: int, start: int) -> Iterator[_Hit]:
        end = self._store.max_offset(topic, queue)
        offset = max(start, self._store.min_offset(topic, queue))
        while offset < end:
            n = min(PAGE, end - offset)
            self.budget.take(n)
            for u in self._store.read_units(topic, queue, offset, n):
                data = self._store.read_record(u.commitlog_offset, u.size)
                msg_id, store_ms, props = record.head(data)
                yield _Hit(topic, queue, u.queue_offset, store_ms, u.tags_code, msg_id, props)
            offset += n

    def _backward(self, topic: str, queue: int) -> Iterator[_Hit]:
        low = self._store.min_offset(topic, queue)
        end = self._store.max_offset(topic, queue)
        while end > low:
            start = max(low, end - PAGE)
            self.budget.take(end - start)
            units = self._store.read_units(topic, queue, start, end - start)
            for u in reversed(units):
                data = self._store.read_record(u.commitlog_offset, u.size)
                msg_id, store_ms, props = record.head(data)
                yield _Hit(topic, queue, u.queue_offset, store_ms, u.tags_code, msg_id, props)
            end = start

    def _find_near(self, topics: list[str], msg_id: bytes, t_ms: int) -> _Hit | None:
        """The record ``msg_id`` stored within ``SKEW_MS`` of ``t_ms`` in one of ``topics``."""
        for topic in topics:
            for q in self._queues(topic):
                start = self._first_at_or_after(topic, q, t_ms - SKEW_MS)
                for hit in self._forward(topic, q, start):
                    if hit.msg_id == msg_id:
                        return hit
                    if hit.store_ms > t_ms + SKEW_MS:
                        break
        return None

    def _find_delivered(
        self, topic: str, queue: int | None, msg_id: bytes, due_ms: int
    ) -> _Hit | None:
        """The delivered copy of ``msg_id`` in ``topic`` (one queue or all), stored from
        ``due_ms`` on (minus the clock skew)."""
        if self._store.queue_count(topic) is None:
            return None
        queues = self._queues(topic) if queue is None else [queue]
        for q in queues:
            if q >= len(self._queues(topic)):
                continue
            start = self._first_at_or_after(topic, q, due_ms - SKEW_MS)
            for hit in self._forward(topic, q, start):
                if hit.msg_id == msg_id:
                    return hit
        return None

    # ------------------------------------------------------------------ answers

    def by_id(self, msg_id: bytes, topic: str | None = None) -> dict[str, Any] | None:
        """What is known of ``msg_id``; ``None`` when it was not found. ``topic`` narrows the
        search to that topic (and the delayed messages bound for it)."""
        timer = self._timer_locate(msg_id) if self._timer_locate is not None else None
        if timer is not None:
            return self._timer_answer(msg_id, timer, topic)
        t_ms = int.from_bytes(msg_id[:6], "big")
        topics = [SCHEDULE_TOPIC]
        if topic is not None:
            topics.append(topic)
        else:
            topics += sorted(
                t for t in list(self._store.topics) if t not in (SCHEDULE_TOPIC, TIMER_TOPIC)
            )
        hit = self._find_near(topics, msg_id, t_ms)
        if hit is None:
            return None
        if hit.topic != SCHEDULE_TOPIC:
            return self._answer(msg_id, "plain", "stored", hit, hit.topic, hit.queue, stored=hit)
        level = hit.queue + 1
        real_topic = hit.properties.get(REAL_TOPIC, "")
        real_queue = _int(hit.properties.get(REAL_QID))
        due_ms = hit.tags_code
        passed = self._level_offset is not None and self._level_offset(level) > hit.offset
        delivered = None
        if passed and real_topic:
            delivered = self._find_delivered(real_topic, real_queue, msg_id, due_ms)
        answer = self._answer(
            msg_id,
            "level",
            "delivered" if passed else "waiting",
            hit,
            real_topic,
            real_queue,
            stored=hit,
            delivered=delivered,
            due_ms=due_ms,
        )
        answer["delay_level"] = level
        return answer

    def _timer_answer(
        self, msg_id: bytes, timer: dict[str, Any], topic: str | None
    ) -> dict[str, Any] | None:
        stored = None
        where = timer.get("stored_at")
        if where is not None:
            msg = self._store.commitlog.read_message(where[0], where[1])
            if msg.msg_id == msg_id:
                stored = _Hit(
                    msg.topic,
                    msg.queue_id,
                    msg.queue_offset,
                    msg.store_ms,
                    msg.tags_code,
                    msg.msg_id,
                    msg.properties,
                )
        real_topic = stored.properties.get(REAL_TOPIC, "") if stored else (topic or "")
        real_queue = _int(stored.properties.get(REAL_QID)) if stored else None
        status = timer["status"]
        due_ms = int(timer["deliver_ms"])
        delivered = None
        if status in ("delivered", "unknown") and real_topic:
            delivered = self._find_delivered(real_topic, real_queue, msg_id, due_ms)
            if delivered is not None:
                status = "delivered"
        if stored is None and delivered is None:
            return None
        answer = self._answer(
            msg_id,
            "timer",
            status,
            stored or delivered,
            real_topic,
            real_queue,
            stored=stored,
            delivered=delivered,
            due_ms=due_ms,
        )
        answer["wheel_slot_ms"] = timer["slot_ms"]
        return answer

    @staticmethod
    def _answer(
        msg_id: bytes,
        kind: str,
        status: str,
        hit: _Hit | None,
        topic: str,
        queue: int | None,
        *,
        stored: _Hit | None = None,
        delivered: _Hit | None = None,
        due_ms: int | None = None,
    ) -> dict[str, Any]:
        props = hit.properties if hit is not None else {}
        keys = props.get(record.PROPERTY_KEYS)
        return {
            "msg_id": record.msg_id_hex(msg_id),
            "kind": kind,
            "status": status,
            "topic": topic,
            "queue": queue,
            "keys": keys.split(" ") if keys else [],
            "tags": props.get(record.PROPERTY_TAGS),
            "delay_level": None,
            "due_ms": due_ms,
            "stored": None if stored is None else stored.place(),
            "delivered": None if delivered is None else delivered.place(),
            "delivered_ms": None if delivered is None else delivered.store_ms,
        }

    def by_key(self, topic: str, key: str, limit: int) -> dict[str, Any]:
        """Messages of ``topic`` carrying ``key``, newest first (delayed ones bound for the
        topic included), at most ``limit``; ``complete`` is false when the read budget ran
        out first."""
        ids: list[bytes] = []
        complete = True
        sources = [(topic, q, False) for q in self._queues(topic)]
        sources += [(SCHEDULE_TOPIC, q, True) for q in self._queues(SCHEDULE_TOPIC)]
        sources += [(TIMER_TOPIC, q, True) for q in self._queues(TIMER_TOPIC)]
        share = max(PAGE, MAX_READS // 2 // max(1, len(sources)))
        for t, q, delayed in sources:
            left = share
            try:
                for hit in self._backward(t, q):
                    left -= 1
                    if left < 0:
                        complete = False
                        break
                    if delayed and hit.properties.get(REAL_TOPIC) != topic:
                        continue
                    keys = hit.properties.get(record.PROPERTY_KEYS, "")
                    if key in keys.split(" ") and hit.msg_id not in ids:
                        ids.append(hit.msg_id)
            except SearchExhausted:
                complete = False
                break
        found = []
        for msg_id in ids[:limit]:
            try:
                answer = self.by_id(msg_id, topic)
            except SearchExhausted:
                complete = False
                break
            if answer is not None:
                found.append(answer)
        return {
            "topic": topic,
            "key": key,
            "messages": found,
            "truncated": len(ids) > limit,
            "complete": complete,
            "reads": self.budget.reads,
        }


def _int(text: str | None) -> int | None:
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def lookup_errors() -> tuple[type[Exception], ...]:
    """What a search over a store being rewritten may meet (retention, a snapshot install)."""
    return (IndexError, RaftLogError, OSError)
