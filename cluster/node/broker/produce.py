"""Produce: a request's messages parsed, checked against the disk guard, the client's
idempotency key and the topic limits, appended through Raft in one command, and answered with
where each was stored (a replayed request answers what was stored the first time).
"""

from __future__ import annotations

import logging
from typing import Any

from chronomq.cluster.node import idempotency
from chronomq.cluster.node.broker.parse import Parsing, messages_in
from chronomq.cluster.node.disk import disk_need
from chronomq.raftlog import record
from chronomq.raftlog.node import NewMessage
from chronomq.schedule import properties as schedule_props
from chronomq.schedule.levels import SCHEDULE_TOPIC

log = logging.getLogger(__name__)


class Producing(Parsing):
    """The broker's produce path (see the module)."""

    async def produce(self, topic: str, raw: Any, idempotency_key: str | None) -> dict[str, Any]:
        if self.disk is not None:
            self.disk.check_produce()  # 507 disk_full before the request is even parsed
        raw = messages_in(raw)
        messages, extras, store_ms = self.parse_messages(topic, raw)
        idempotency_key = idempotency.message_id_key(raw, idempotency_key)
        if self.disk is None:
            return await self._produce(topic, raw, idempotency_key, messages, extras, store_ms)
        # What these messages will take on every member's disk is held until they are
        # written: 507 disk_full when a majority would not keep its reserve (cluster.node.disk).
        with self.disk.admit(disk_need(messages)):
            return await self._produce(topic, raw, idempotency_key, messages, extras, store_ms)

    async def _produce(
        self,
        topic: str,
        raw: Any,
        idempotency_key: str | None,
        messages: list[NewMessage],
        extras: list[dict[str, Any]],
        store_ms: int,
    ) -> dict[str, Any]:
        # A client's key is scoped to the topic: the same key sent to another topic is another
        # request, not a replay of the first one's placement. Within the topic it is bound to
        # its request's fingerprint (see cluster.node.idempotency).
        key = fingerprint = None
        if idempotency_key:
            key = idempotency.client_key(topic, idempotency_key)
            fingerprint = idempotency.request_fingerprint(topic, raw)
            idempotency.check_reuse(
                self.raftlog.store, key, fingerprint, store_ms, self.config.idempotency_window_s
            )
        creates = {}
        if self.config.auto_create_topic and self.raftlog.store.queue_count(topic) is None:
            creates[topic] = self.config.default_topic_queues
        if any(m.topic == SCHEDULE_TOPIC for m in messages):
            self._create_schedule_topic(creates)
        self.check_topic_room(creates)
        fut = self.raftlog.append(
            messages,
            key=key,
            creates=creates or None,
            store_ms=store_ms,
            fingerprint=fingerprint,
        )
        outcome = await self.commit(fut)
        if self.logs is not None and not outcome.duplicate:
            self.logs.stored(topic, outcome.placed, extras, store_ms)
        if outcome.duplicate:
            # A replayed request: the answer must describe what was stored the first time
            # (its due time came from that store time), not this attempt.
            extras = [
                self._stored_extra(p, e) for p, e in zip(outcome.placed, extras, strict=False)
            ]
        results = []
        for placed, extra in zip(outcome.placed, extras, strict=False):
            results.append(
                {
                    "msg_id": record.msg_id_hex(placed.msg_id),
                    "topic": placed.topic,
                    "queue": placed.queue_id,
                    "offset": placed.queue_offset,
                    **extra,
                }
            )
        return {"results": results, "duplicate": outcome.duplicate}

    def _stored_extra(self, placed: Any, extra: dict[str, Any]) -> dict[str, Any]:
        if "deliver_ms" not in extra:
            return extra
        try:
            msg = self.raftlog.store.commitlog.read_message(placed.physical_offset, placed.size)
        except Exception:  # the answer keeps this attempt's figure rather than failing
            log.exception("could not read a replayed message at %d", placed.physical_offset)
            return extra
        props = msg.properties
        if "TIMER_OUT_MS" in props and props["TIMER_OUT_MS"].isdigit():
            return {**extra, "deliver_ms": int(props["TIMER_OUT_MS"])}
        level = props.get(schedule_props.DELAY, "")
        if msg.topic == SCHEDULE_TOPIC and level.isdigit():
            return {**extra, "deliver_ms": msg.store_ms + self.levels.delay_ms(int(level))}
        return extra
