"""Moving a message into the schedule topic on produce, and back out when it is due.

On produce, a message with delay level ``n > 0`` is stored in ``SCHEDULE_TOPIC_XXXX`` queue
``n - 1`` with its real destination in ``REAL_TOPIC`` / ``REAL_QID`` and its level in ``DELAY``
(seed 001, "生产者发送延迟消息到Broker里"; seed 002, section 3). When due, the delivery loop
restores the real topic and queue and drops ``DELAY`` (``messageTimeup``). ``REAL_TOPIC`` and
``REAL_QID`` stay on the delivered message, as in RocketMQ, so a consumer can tell it waited.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from schedule import properties as props
from schedule.errors import CorruptScheduleMessage, InvalidDelayLevel
from schedule.levels import SCHEDULE_TOPIC, DelayLevelTable, ResolvedLevel


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
