"""Consumer retry: a consumed message sent back, to ``%RETRY%{group}`` through a delay level or
to the DLQ, as :mod:`chronomq.schedule.retry` decides; idempotent per message.
"""

from __future__ import annotations

from typing import Any

from chronomq.cluster.node import idempotency
from chronomq.cluster.node.broker.base import BrokerBase
from chronomq.cluster.node.errors import ApiError
from chronomq.raftlog import record
from chronomq.raftlog.node import NewMessage
from chronomq.schedule import rewrite
from chronomq.schedule.retry import RetryConfig, RetryTarget, plan_retry


class ConsumerRetry(BrokerBase):
    """The broker's consumer retry (see the module)."""

    async def send_back(
        self, group: str, topic: str, queue: int, offset: int, delay_level: int
    ) -> dict[str, Any]:
        """Send a consumed message back: to ``%RETRY%{group}`` through a delay level, or to the DLQ.

        The message is read from the store (the leader's), so the client cannot forge its
        reconsume count. The request is idempotent per (group, topic, queue, offset): sending
        the same message back twice re-enqueues it once.
        """
        store = self.raftlog.store
        self.check_queue(topic, queue)
        found = store.read_messages(topic, queue, offset, 1)
        if not found:
            raise ApiError(
                404,
                "unknown_message",
                f"{topic}/{queue} has no message at offset {offset} "
                f"(max offset {store.max_offset(topic, queue)})",
                "offset",
            )
        msg = found[0]
        decision = plan_retry(
            topic=msg.topic,
            msg_id=record.msg_id_hex(msg.msg_id),
            reconsume_times=msg.reconsume_times,
            properties=msg.properties,
            group=group,
            config=RetryConfig(self.levels, self.config.max_reconsume_times),
            requested_level=delay_level,
        )
        store_ms = self.raftlog.clock.now_ms()
        creates = {}
        if store.queue_count(decision.topic) is None:
            creates[decision.topic] = 1
        answer: dict[str, Any] = {
            "target": decision.target.value,
            "topic": decision.topic,
            "reconsume_times": decision.reconsume_times,
        }
        if decision.target is RetryTarget.RETRY and decision.delay_level:
            placed = rewrite.place(
                decision.topic, 0, decision.delay_level, decision.properties, self.levels
            )
            self._create_schedule_topic(creates)
            new = NewMessage(
                placed.topic,
                msg.body,
                queue_id=placed.queue_id,
                properties=placed.properties,
                flag=msg.flag,
                born_ms=msg.born_ms,
                reconsume_times=decision.reconsume_times,
                tags_code=placed.deliver_ms(store_ms),
            )
            answer.update(
                delay_level=placed.level.level,
                deliver_ms=placed.deliver_ms(store_ms),
                clamped=decision.level_clamped,
            )
        else:
            new = NewMessage(
                decision.topic,
                msg.body,
                queue_id=0,
                properties=decision.properties,
                flag=msg.flag,
                born_ms=msg.born_ms,
                reconsume_times=decision.reconsume_times,
            )
        key = f"retry:{group}:{topic}:{queue}:{offset}"
        self.check_topic_room(creates)
        fut = self.raftlog.append(
            [new],
            key=key,
            creates=creates or None,
            store_ms=store_ms,
            fingerprint=idempotency.key_fingerprint(key),
        )
        outcome = await self.commit(fut)
        if self.logs is not None and not outcome.duplicate:
            self.logs.stored(decision.topic, outcome.placed, [dict(answer)], store_ms)
        if outcome.placed:
            p = outcome.placed[0]
            answer.update(
                msg_id=record.msg_id_hex(p.msg_id), queue=p.queue_id, offset=p.queue_offset
            )
        answer["duplicate"] = outcome.duplicate
        return answer
