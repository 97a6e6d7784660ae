"""Moving a message into the schedule topic on produce, and back out when it is due.

On produce, a message with delay level ``n > 0`` is stored in ``SCHEDULE_TOPIC_XXXX`` queue
``n - 1`` with its real destination in ``REAL_TOPIC`` / ``REAL_QID`` and its level in ``DELAY``
(seed 001, "生产者发送延迟消息到Broker里"; seed 002, section 3). When due, the delivery loop
restores the real topic and queue and drops ``DELAY`` (``messageTimeup``). ``REAL_TOPIC`` and
``REAL_QID`` stay on the delivered message, as in RocketMQ, so a consumer can tell it waited.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from chronomq.raftlog.applycheck import RecordFacts
from chronomq.raftlog.errors import InvalidInput
from chronomq.raftlog.record import validate_topic
from chronomq.schedule import properties as props
from chronomq.schedule.errors import CorruptScheduleMessage, InvalidDelayLevel
from chronomq.schedule.levels import (
    MAX_LEVEL_DELAY_MS,
    SCHEDULE_TOPIC,
    DelayLevelTable,
    ResolvedLevel,
)


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a produced message is stored, and with which properties."""

    topic: str
    queue_id: int
    properties: Mapping[str, str]
    level: ResolvedLevel
    """The resolved level; ``level.clamped`` goes into the produce answer."""

    def deliver_ms(self, store_ms: int) -> int:
        """The tagsCode of the schedule ConsumeQueue entry; ``store_ms`` for level 0."""
        return store_ms + self.level.delay_ms


@dataclass(frozen=True, slots=True)
class Restored:
    """A due message's real destination and the properties it is delivered with."""

    topic: str
    queue_id: int
    level: int
    properties: Mapping[str, str]


def place(
    topic: str,
    queue_id: int,
    delay_level: object,
    properties: Mapping[str, str],
    table: DelayLevelTable,
) -> Placement:
    """Where to store a message produced to ``topic``/``queue_id`` with ``delay_level``.

    Level 0 leaves it where it is. Raises :class:`InvalidDelayLevel` for a negative or
    non-integer level, and for producing a delayed message straight into the schedule topic.
    """
    level = table.resolve(delay_level)
    if not level.is_delayed:
        return Placement(
            topic=topic,
            queue_id=queue_id,
            properties=MappingProxyType(dict(properties)),
            level=level,
        )
    if topic == SCHEDULE_TOPIC:
        raise InvalidDelayLevel(
            f"cannot produce a delayed message to the internal topic {SCHEDULE_TOPIC}",
            field="topic",
        )
    new_properties = dict(properties)
    new_properties[props.REAL_TOPIC] = topic
    new_properties[props.REAL_QID] = str(queue_id)
    new_properties[props.DELAY] = str(level.level)
    return Placement(
        topic=SCHEDULE_TOPIC,
        queue_id=table.queue_id(level.level),
        properties=MappingProxyType(new_properties),
        level=level,
    )


def restore(queue_id: int, properties: Mapping[str, str]) -> Restored:
    """The real destination of a due message read from schedule-topic queue ``queue_id``.

    Raises :class:`CorruptScheduleMessage` when ``REAL_TOPIC`` or ``REAL_QID`` is missing or
    unusable; the driver then skips the entry with that message as the reason.
    """
    real_topic = properties.get(props.REAL_TOPIC)
    if not real_topic:
        raise CorruptScheduleMessage(
            f"{SCHEDULE_TOPIC} queue {queue_id}: message has no {props.REAL_TOPIC} property"
        )
    if real_topic == SCHEDULE_TOPIC:
        raise CorruptScheduleMessage(
            f"{SCHEDULE_TOPIC} queue {queue_id}: {props.REAL_TOPIC} points back at {SCHEDULE_TOPIC}"
        )
    raw_qid = properties.get(props.REAL_QID)
    if raw_qid is None or not raw_qid.isascii() or not raw_qid.isdigit():
        raise CorruptScheduleMessage(
            f"{SCHEDULE_TOPIC} queue {queue_id}: {props.REAL_QID} is {raw_qid!r}, not a queue id"
        )
    restored = {key: value for key, value in properties.items() if key != props.DELAY}
    return Restored(
        topic=real_topic,
        queue_id=int(raw_qid),
        level=queue_id + 1,
        properties=MappingProxyType(restored),
    )


#: Topics a delayed message may not be restored to (the timer's system topics share the prefix).
_SYSTEM_TOPIC_PREFIX = "rmq_sys_"
_MAX_QUEUES = 1024


def destination_problem(
    properties: Mapping[str, str], queue_count: Callable[[str], int | None]
) -> tuple[str, str] | None:
    """Why a schedule-topic message's ``REAL_TOPIC``/``REAL_QID`` cannot be restored to, as
    ``(reason, property)``: not a legal topic name, a system topic, or not a queue of it."""
    topic = properties.get(props.REAL_TOPIC, "")
    try:
        validate_topic(topic)
    except InvalidInput as exc:
        return f"{props.REAL_TOPIC} {topic[:40]!r}: {exc}", props.REAL_TOPIC
    if topic == SCHEDULE_TOPIC or topic.startswith(_SYSTEM_TOPIC_PREFIX):
        return f"{props.REAL_TOPIC} {topic} is a system topic", props.REAL_TOPIC
    raw = properties.get(props.REAL_QID, "")
    if not raw.isascii() or not raw.isdigit() or len(raw) > 4 or int(raw) >= _MAX_QUEUES:
        return f"{props.REAL_QID} {raw[:20]!r} is not a queue id", props.REAL_QID
    queues = queue_count(topic)
    if queues is not None and int(raw) >= queues:
        return f"{props.REAL_QID} {raw}: topic {topic} has queues 0..{queues - 1}", props.REAL_QID
    return None


def apply_rule(
    facts: RecordFacts, queue_count: Callable[[str], int | None]
) -> tuple[str, str] | None:
    """The apply rule for records of :data:`SCHEDULE_TOPIC` (:mod:`chronomq.raftlog.applycheck`).

    Besides the destination, the deliver time (the record's tagsCode) must lie within the
    longest level delay any table allows (365 d) of the command's propose time: a record
    stamped 2^62 would otherwise hold its level until the planner's skew allowance lets it go.
    """
    problem = destination_problem(facts.properties, queue_count)
    if problem is not None:
        return problem[0], f"properties.{problem[1]}"
    if not 0 <= facts.tags_code <= facts.propose_ms + MAX_LEVEL_DELAY_MS:
        return (
            f"deliver time {facts.tags_code} is not within {MAX_LEVEL_DELAY_MS} ms of "
            f"{facts.propose_ms}",
            "delay_level",
        )
    return None
