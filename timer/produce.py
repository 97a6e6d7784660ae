"""The produce rewrite: a message with ``delay_ms``/``deliver_at_ms`` into the timer topic.

On the leader's HTTP loop, before the message is proposed: check the deliver time (at most
``timer_max_delay_s`` ahead; a past time means now), the slot's congestion
(:mod:`chronomq.timer.flow`, 429), pick the real queue (round robin when none is named) and
rewrite the message into the timer topic with a timer message id
(:mod:`chronomq.timer.message`). Caller mistakes raise errors naming the field.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Mapping
from typing import Any

from chronomq.raftlog.errors import InvalidInput, UnknownQueue, UnknownTopic
from chronomq.raftlog.node import NewMessage, RaftLog
from chronomq.timer import message as tm
from chronomq.timer.config import TimerConfig
from chronomq.timer.enqueue import check_deliver_time
from chronomq.timer.errors import InvalidDeliverTime
from chronomq.timer.flow import check_congestion
from chronomq.timer.machine import TimerMachine
from chronomq.timer.wheel import Slot


def advisory_slot(machine: TimerMachine, time_ms: int) -> Slot | None:
    """The wheel slot of ``time_ms``, read without the lock (advisory: flow control)."""
    try:
        return machine.files.wheel.get(time_ms)
    except Exception:  # being rewritten or realigned right now: no opinion
        return None


class TimerProducer:
    """Rewrites produced timer messages; counts the ones refused for congestion."""

    def __init__(
        self,
        raftlog: RaftLog,
        machine: TimerMachine,
        config: TimerConfig,
        *,
        default_topic_queues: int = 4,
        auto_create_topics: bool = True,
    ) -> None:
        self.raftlog = raftlog
        self.machine = machine
        self.config = config
        self.default_topic_queues = default_topic_queues
        self.auto_create_topics = auto_create_topics
        self._rng = random.Random(random.SystemRandom().getrandbits(128))
        self._rr: dict[str, itertools.count[int]] = {}
        self.rejected = 0
        """Messages refused because their slot was congested."""

    def produce_hook(
        self,
        topic: str,
        body: bytes,
        queue: int | None,
        props: Mapping[str, str],
        field_name: str,
        value: Any,
        store_ms: int,
        prefix: str,
        extra: dict[str, Any],
    ) -> NewMessage:
        """Rewrite one produced message with ``delay_ms``/``deliver_at_ms`` into the timer
        topic; the broker's ``timer_hook``. Raises caller errors naming the field."""
        field = f"{prefix}.{field_name}"
        if topic == tm.TIMER_TOPIC:
            raise InvalidInput(f"cannot produce to the internal topic {tm.TIMER_TOPIC}", "topic")
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidDeliverTime(f"{field_name} must be an integer, got {value!r}", field=field)
        if value < 0:
            raise InvalidDeliverTime(f"{field_name} must not be negative, got {value}", field=field)
        deliver_ms = store_ms + value if field_name == "delay_ms" else value
        check_deliver_time(deliver_ms, store_ms, self.config, field=field)
        deliver_ms = max(deliver_ms, store_ms)  # a time in the past means now
        count = self.raftlog.store.queue_count(topic)
        if count is None:
            if not self.auto_create_topics:
                raise UnknownTopic(f"topic {topic} does not exist", "topic")
            count = self.default_topic_queues
        if queue is None:
            rr = self._rr.get(topic)
            if rr is None:
                rr = self._rr[topic] = itertools.count()
            queue = next(rr) % count
        elif queue >= count:
            raise UnknownQueue(
                f"topic {topic} has queues 0..{count - 1}, not {queue}", f"{prefix}.queue"
            )
        slot = advisory_slot(self.machine, deliver_ms)
        if slot is not None:
            try:
                check_congestion(
                    slot, self.config.timer_congest_num_each_slot, self._rng.random(), field=field
                )
            except Exception:
                self.rejected += 1
                raise
        extra["deliver_ms"] = deliver_ms
        return NewMessage(
            tm.TIMER_TOPIC,
            body,
            queue_id=tm.TIMER_QUEUE,
            properties=tm.timer_properties(
                props, real_topic=topic, real_queue=queue, deliver_ms=deliver_ms
            ),
            tags_code=deliver_ms,
            msg_id=tm.new_timer_id(deliver_ms, self._rng),
        )
