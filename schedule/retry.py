"""Consumer retry through the delay levels (seed 001, "延迟消息与消息重试机制的关系").

A consumer that fails a message sends it back. It is re-enqueued to the group's retry topic
``%RETRY%{group}`` (queue 0) at delay level ``3 + reconsume_times``, clamped to the maximum
level, so with the default table the 1st retry waits 10s and the 16th waits 2h. A message whose
``reconsume_times`` has reached ``max_reconsume_times`` (16) goes to the group's dead-letter
topic ``%DLQ%{group}`` (queue 0) instead, without delay.

Counting, as RocketMQ's ``consumerSendMsgBack`` does: ``reconsume_times`` is how often the
message was already sent back (0 for a first delivery). Sends-back with counts 0..15 are the
16 retries; the send-back of a message that shows ``reconsume_times == 16`` goes to the DLQ.
The re-enqueued copy always carries ``reconsume_times + 1``.

The result is the logical destination: the produce path then stores a delayed retry in the
schedule topic like any delayed message (:func:`chronomq.schedule.rewrite.place`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from types import MappingProxyType
from typing import Final

from chronomq.schedule import properties as props
from chronomq.schedule.errors import ConfigError, InvalidRetryRequest
from chronomq.schedule.levels import SCHEDULE_TOPIC, DelayLevelTable

RETRY_TOPIC_PREFIX: Final = "%RETRY%"
DLQ_TOPIC_PREFIX: Final = "%DLQ%"
MAX_RECONSUME_TIMES_KEY: Final = "max_reconsume_times"
DEFAULT_MAX_RECONSUME_TIMES: Final = 16
FIRST_RETRY_LEVEL: Final = 3
"""Retry ``n`` (1-based) waits at level ``FIRST_RETRY_LEVEL + n - 1``."""
MAX_GROUP_LENGTH: Final = 120
"""So that ``%RETRY%{group}`` fits in a 127-character topic name."""
_MAX_RECONSUME_TIMES_CEILING: Final = 1_000
_GROUP_PATTERN: Final = re.compile(r"[A-Za-z0-9_|-]+")


class RetryTarget(Enum):
    RETRY = "retry"
    DLQ = "dlq"


@dataclass(frozen=True, slots=True)
class RetryConfig:
    levels: DelayLevelTable = field(default_factory=DelayLevelTable.default)
    max_reconsume_times: int = DEFAULT_MAX_RECONSUME_TIMES

    def __post_init__(self) -> None:
        if not 0 <= self.max_reconsume_times <= _MAX_RECONSUME_TIMES_CEILING:
            raise ConfigError(
                MAX_RECONSUME_TIMES_KEY,
                f"must be in 0..{_MAX_RECONSUME_TIMES_CEILING}, got {self.max_reconsume_times}",
            )


@dataclass(frozen=True, slots=True)
class RetryDecision:
    target: RetryTarget
    topic: str
    queue_id: int
    delay_level: int | None
    """The level to wait at; None for the DLQ (delivered at once)."""
    level_clamped: bool
    reconsume_times: int
    """The count the re-enqueued copy carries (the old count + 1)."""
    properties: Mapping[str, str]


def retry_topic(group: str) -> str:
    return RETRY_TOPIC_PREFIX + _checked_group(group)


def dlq_topic(group: str) -> str:
    return DLQ_TOPIC_PREFIX + _checked_group(group)


def is_retry_topic(topic: str) -> bool:
    return topic.startswith(RETRY_TOPIC_PREFIX)


def is_dlq_topic(topic: str) -> bool:
    return topic.startswith(DLQ_TOPIC_PREFIX)


def plan_retry(
    *,
    topic: str,
    msg_id: str,
    reconsume_times: int,
    properties: Mapping[str, str],
    group: str,
    config: RetryConfig,
    requested_level: int = 0,
) -> RetryDecision:
    """Where a message sent back by ``group`` goes next, and with which properties.

    ``topic``, ``msg_id``, ``reconsume_times`` and ``properties`` describe the message as the
    consumer received it. ``requested_level`` follows RocketMQ's send-back header: 0 picks
    ``3 + reconsume_times``, a positive level is used as given (clamped), a negative one sends
    the message straight to the DLQ.

    The new properties keep the message's own, drop the schedule ones (``REAL_TOPIC``,
    ``REAL_QID``, ``DELAY``: the produce path sets them afresh), keep ``RETRY_TOPIC`` and
    ``ORIGIN_MESSAGE_ID`` from the first send-back, and set ``RECONSUME_TIME`` and
    ``MAX_RECONSUME_TIMES``.
    """
    checked_group = _checked_group(group)
    if isinstance(reconsume_times, bool) or not isinstance(reconsume_times, int):
        raise InvalidRetryRequest(
            f"reconsume_times must be an integer, got {reconsume_times!r}",
            field="reconsume_times",
        )
    if reconsume_times < 0:
        raise InvalidRetryRequest(
            f"reconsume_times must be >= 0, got {reconsume_times}", field="reconsume_times"
        )
    if isinstance(requested_level, bool) or not isinstance(requested_level, int):
        raise InvalidRetryRequest(
            f"delay_level must be an integer, got {requested_level!r}", field="delay_level"
        )
    if not topic or topic == SCHEDULE_TOPIC:
        raise InvalidRetryRequest(f"cannot send back a message of topic {topic!r}", field="topic")
    if not msg_id:
        raise InvalidRetryRequest("msg_id must not be empty", field="msg_id")

    new_times = reconsume_times + 1
    new_properties = {
        key: value for key, value in properties.items() if key not in props.SCHEDULE_PROPERTIES
    }
    new_properties.setdefault(props.RETRY_TOPIC, topic)
    if not new_properties.get(props.ORIGIN_MESSAGE_ID):
        new_properties[props.ORIGIN_MESSAGE_ID] = msg_id
    new_properties[props.RECONSUME_TIME] = str(new_times)
    new_properties[props.MAX_RECONSUME_TIMES] = str(config.max_reconsume_times)

    if reconsume_times >= config.max_reconsume_times or requested_level < 0:
        return RetryDecision(
            target=RetryTarget.DLQ,
            topic=DLQ_TOPIC_PREFIX + checked_group,
            queue_id=0,
            delay_level=None,
            level_clamped=False,
            reconsume_times=new_times,
            properties=MappingProxyType(new_properties),
        )

    wanted = requested_level if requested_level > 0 else FIRST_RETRY_LEVEL + reconsume_times
    level = config.levels.resolve(wanted)
    return RetryDecision(
        target=RetryTarget.RETRY,
        topic=RETRY_TOPIC_PREFIX + checked_group,
        queue_id=0,
        delay_level=level.level,
        level_clamped=level.clamped,
        reconsume_times=new_times,
        properties=MappingProxyType(new_properties),
    )


def _checked_group(group: str) -> str:
    if not isinstance(group, str) or not group:
        raise InvalidRetryRequest("group must be a non-empty string", field="group")
    if len(group) > MAX_GROUP_LENGTH:
        raise InvalidRetryRequest(
            f"group is {len(group)} characters; at most {MAX_GROUP_LENGTH}", field="group"
        )
    if not _GROUP_PATTERN.fullmatch(group):
        raise InvalidRetryRequest(
            f"group {group!r} may contain only letters, digits, '_', '-' and '|'",
            field="group",
        )
    return group
