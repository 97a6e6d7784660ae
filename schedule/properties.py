"""Message property names used by delay levels and consumer retry.

The names are RocketMQ's (``MessageConst.PROPERTY_*``) so that operators and tools that know
RocketMQ read our messages without a glossary. Values are always strings.
"""

from __future__ import annotations

from typing import Final

REAL_TOPIC: Final = "REAL_TOPIC"
"""The topic a delayed message goes to once due (set while it waits in the schedule topic)."""

REAL_QID: Final = "REAL_QID"
"""The queue id a delayed message goes to once due, as a decimal string."""

DELAY: Final = "DELAY"
"""The delay level the message waits at, as a decimal string."""

RETRY_TOPIC: Final = "RETRY_TOPIC"
"""The topic a message was first consumed from, kept across every retry."""

ORIGIN_MESSAGE_ID: Final = "ORIGIN_MESSAGE_ID"
"""The msg id of the first copy of a retried message, kept across every retry."""

RECONSUME_TIME: Final = "RECONSUME_TIME"
"""How many times the message has been sent back for redelivery, as a decimal string."""

MAX_RECONSUME_TIMES: Final = "MAX_RECONSUME_TIMES"
"""The retry limit in force when the message was last sent back, as a decimal string."""

SCHEDULE_PROPERTIES: Final = frozenset({REAL_TOPIC, REAL_QID, DELAY})
"""Properties that belong to the wait in the schedule topic, not to the message itself."""
