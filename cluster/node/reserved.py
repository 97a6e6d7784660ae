"""What a producer may not name: system topics and the properties the services read back.

The schedule service, the timer and consumer retry keep their state in message properties
(RocketMQ's names, so tools that know RocketMQ read them) and in system topics. A producer that
set them could steer a message into a queue that does not exist, out of the data directory, or
to a due time in 2^62 that blocks a level for ever. So the edge refuses them, naming the
field; the services' own writers build their records below this check and keep using them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

from chronomq.cluster.node.errors import ApiError, bad_request
from chronomq.pop import REVIVE_TOPIC
from chronomq.raftlog import record
from chronomq.raftlog.applycheck import RecordRule
from chronomq.schedule import properties as schedule_props
from chronomq.schedule import rewrite as schedule_rewrite
from chronomq.schedule.levels import SCHEDULE_TOPIC
from chronomq.schedule.retry import DLQ_TOPIC_PREFIX, RETRY_TOPIC_PREFIX
from chronomq.timer import logtopic as timer_logtopic
from chronomq.timer import message as timer_message

UNIQ_KEY: Final = "UNIQ_KEY"
"""The property holding a message's client-made id (RocketMQ's ``PROPERTY_UNIQ_CLIENT_MESSAGE_ID``),
which RocketMQ consumers see as the message id: set from a produce's ``message_id`` only."""

SYSTEM_TOPIC_PREFIX: Final = "rmq_sys_"
"""RocketMQ's prefix for system topics; the timer's topic is one of them."""

ROCKETMQ_SYSTEM_TOPICS: Final = frozenset(
    {
        "TBW102",
        "BenchmarkTest",
        "OFFSET_MOVED_EVENT",
        "SELF_TEST_TOPIC",
        "RMQ_SYS_TRANS_HALF_TOPIC",
        "RMQ_SYS_TRANS_OP_HALF_TOPIC",
        "TRANS_CHECK_MAX_TIME_TOPIC",
        "RMQ_SYS_TRACE_TOPIC",
        "CHECKPOINT_TOPIC",
    }
)
"""The names RocketMQ's ``TopicValidator`` keeps for the broker (``SCHEDULE_TOPIC_XXXX`` and the
``rmq_sys_`` prefix are ours too): a RocketMQ tool or client that meets them expects the
broker's records there, so no client writes or reads them."""

GROUP_TOPIC_PREFIXES: Final = (RETRY_TOPIC_PREFIX, DLQ_TOPIC_PREFIX)
"""``%RETRY%{group}`` and ``%DLQ%{group}``: written only by the broker (consumer retry, pop's
DLQ), read only by their group."""

RESERVED_PROPERTIES: Final = frozenset(
    {
        schedule_props.REAL_TOPIC,
        schedule_props.REAL_QID,
        schedule_props.DELAY,
        schedule_props.RETRY_TOPIC,
        schedule_props.ORIGIN_MESSAGE_ID,
        schedule_props.RECONSUME_TIME,
        schedule_props.MAX_RECONSUME_TIMES,
        record.PROPERTY_KEYS,
        record.PROPERTY_TAGS,
        UNIQ_KEY,
        *timer_message.RESERVED,
    }
)
"""Property names set by the broker itself (``keys``, ``tags`` and ``message_id`` have fields of
their own)."""

RESERVED_PROPERTY_PREFIXES: Final = ("TIMER_",)
"""Every ``TIMER_*`` name belongs to the timer, also those it may read in a later version."""


def is_system_topic(topic: str) -> bool:
    """A topic of the broker's own, which no client reads or writes."""
    return (
        topic in (SCHEDULE_TOPIC, REVIVE_TOPIC)
        or topic in ROCKETMQ_SYSTEM_TOPICS
        or topic.startswith(SYSTEM_TOPIC_PREFIX)
    )


def group_of_topic(topic: str) -> str | None:
    """The consumer group a ``%RETRY%{group}`` or ``%DLQ%{group}`` topic belongs to."""
    for prefix in GROUP_TOPIC_PREFIXES:
        if topic.startswith(prefix):
            return topic[len(prefix) :]
    return None


def check_user_topic(topic: str, field: str = "topic") -> None:
    """Refuse a system topic, or a group's retry or dead-letter topic, as the target of a
    produce or a topic creation (400 naming ``field``)."""
    if is_system_topic(topic):
        if topic == SCHEDULE_TOPIC:
            hint = "produce to the real topic with delay_level instead"
        elif topic == REVIVE_TOPIC:
            hint = "only the timer writes pop checkpoints there"
        elif topic.startswith(SYSTEM_TOPIC_PREFIX):
            hint = "produce to the real topic with delay_ms or deliver_at_ms instead"
        else:
            hint = "RocketMQ reserves the name for the broker"
        raise bad_request(f"{topic} is a system topic, internal to the broker; {hint}", field)
    group = group_of_topic(topic)
    if group is not None:
        raise bad_request(
            f"{topic} is group {group!r}'s retry or dead-letter topic, which only the broker "
            f"writes (send a message back with POST /v1/groups/{{group}}/retry)",
            field,
        )


def check_group_read(topic: str, group: str, field: str = "topic") -> None:
    """Refuse a consumer group reading another group's retry or dead-letter topic (403
    ``not_group_topic`` naming ``field``). Reads without a group (an HTTP pull by offset, with
    the token) are the operator's and are not checked here."""
    owner = group_of_topic(topic)
    if owner is not None and owner != group:
        raise ApiError(
            403,
            "not_group_topic",
            f"{topic} belongs to group {owner!r}: group {group!r} may not read it",
            field,
        )


def is_reserved_property(name: str) -> bool:
    return name in RESERVED_PROPERTIES or name.startswith(RESERVED_PROPERTY_PREFIXES)


def check_user_properties(properties: Mapping[str, str], field: str) -> None:
    """Refuse a property name the broker reserves (400 naming ``<field>.<NAME>``)."""
    for name in properties:
        if is_reserved_property(name):
            raise bad_request(
                f"property {name} is reserved: the broker sets it itself", f"{field}.{name}"
            )


APPLY_EXTENSIONS: Final = ("timer", "pop")
"""Every apply extension a node of this cluster registers (``timer.machine.NAME``,
``chronomq.pop.machine.NAME``); a committed command for another name is rejected at apply
instead of waiting for it."""


def apply_rules() -> dict[str, RecordRule]:
    """The checks apply runs on every record appended to a system topic, so a record that got
    past the edge (an older node, another edge, a bug) is rejected the same way on every
    replica instead of stopping them: the timer's and the delay levels' properties, and the
    TimerLog's copy, which only the timer's apply writes."""
    return {
        timer_message.TIMER_TOPIC: timer_message.apply_rule,
        SCHEDULE_TOPIC: schedule_rewrite.apply_rule,
        timer_logtopic.TOPIC: timer_logtopic.apply_rule,
    }
