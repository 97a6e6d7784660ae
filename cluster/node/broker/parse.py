"""Produce requests into log messages: the checks that depend on this node (limits, topics,
the delay table, reserved properties; the request model checked types and shapes), the queue
of a message that names none, and delayed messages rewritten into the schedule topic or handed
to the timer.
"""

from __future__ import annotations

import base64
import itertools
from typing import Any

from chronomq.cluster.node import models, reserved
from chronomq.cluster.node.broker.base import BrokerBase
from chronomq.cluster.node.errors import ApiError, bad_request
from chronomq.cluster.node.models import MessageIn, ProduceRequest
from chronomq.raftlog import record
from chronomq.raftlog.errors import UnknownTopic
from chronomq.raftlog.node import NewMessage
from chronomq.schedule import rewrite

DELAY_FIELDS = ("delay_level", "delay_ms", "deliver_at_ms")


def messages_in(raw: Any) -> Any:
    """Messages as :class:`MessageIn` (the gRPC endpoint and tests give JSON objects)."""
    if not isinstance(raw, list) or not raw or all(type(m) is MessageIn for m in raw):
        return raw
    return models.convert({"messages": raw}, ProduceRequest).messages


class Parsing(BrokerBase):
    """The broker's produce parsing (see the module)."""

    def parse_messages(
        self, topic: str, raw: Any
    ) -> tuple[list[NewMessage], list[dict[str, Any]], int]:
        """Messages (:class:`~chronomq.cluster.node.models.MessageIn`, or their JSON objects) ->
        NewMessages (delayed ones rewritten) and per-message answer extras. The model checked
        types and shapes; what is checked here depends on this node (limits, topics, the delay
        table, reserved properties)."""
        record.validate_topic(topic)
        reserved.check_user_topic(topic)
        if not isinstance(raw, list) or not raw:
            raise bad_request("messages must be a non-empty list", "messages")
        raw = messages_in(raw)
        if not self.config.auto_create_topic and self.raftlog.store.queue_count(topic) is None:
            # Also for delayed messages, which are stored in a system topic first: they would
            # be accepted and dropped when due.
            raise UnknownTopic(f"topic {topic} does not exist", "topic")
        if len(raw) > self.config.max_messages_per_request:
            raise ApiError(
                413,
                "too_many_messages",
                f"{len(raw)} messages in one request, more than {self.config.max_messages_per_request}",
                "messages",
            )
        store_ms = self.raftlog.clock.now_ms()
        out: list[NewMessage] = []
        extras: list[dict[str, Any]] = []
        for i, m in enumerate(raw):
            f = f"messages[{i}]"
            body = self._body(m, f)
            props = {} if m.properties is None else m.properties
            reserved.check_user_properties(props, f"{f}.properties")
            props = dict(props)
            if m.keys is not None:
                if not all(k and " " not in k for k in m.keys):
                    raise bad_request(
                        "keys must be a list of non-empty strings without spaces", f"{f}.keys"
                    )
                if m.keys:
                    props[record.PROPERTY_KEYS] = " ".join(m.keys)
            if m.tags is not None:
                props[record.PROPERTY_TAGS] = m.tags
            if m.message_id is not None:
                props[reserved.UNIQ_KEY] = m.message_id
            queue = m.queue
            delays = [k for k in DELAY_FIELDS if getattr(m, k) is not None]
            if len(delays) > 1:
                raise bad_request(
                    f"give at most one of {', '.join(DELAY_FIELDS)}", f"{f}.{delays[1]}"
                )
            extra: dict[str, Any] = {}
            if delays and delays[0] == "delay_level":
                level = m.delay_level
                qid = queue if queue is not None else self._next_queue(topic)
                real_queues = (
                    self.raftlog.store.queue_count(topic) or self.config.default_topic_queues
                )
                if qid >= real_queues:
                    raise ApiError(
                        400,
                        "unknown_queue",
                        f"topic {topic} has queues 0..{real_queues - 1}, not {qid}",
                        f"{f}.queue",
                    )
                try:
                    placed = rewrite.place(topic, qid, level, props, self.levels)
                except ApiError:
                    raise
                except Exception as exc:
                    err = getattr(exc, "field", None)
                    raise bad_request(str(exc), f"{f}.{err or 'delay_level'}") from None
                if placed.level.is_delayed:
                    extra = {
                        "delay_level": placed.level.level,
                        "deliver_ms": placed.deliver_ms(store_ms),
                    }
                    if placed.level.clamped:
                        extra["clamped"] = True
                    out.append(
                        NewMessage(
                            placed.topic,
                            body,
                            queue_id=placed.queue_id,
                            properties=placed.properties,
                            tags_code=placed.deliver_ms(store_ms),
                        )
                    )
                    extras.append(extra)
                    continue
            elif delays:
                timer = self.timer_hook
                if timer is None:
                    raise bad_request(
                        f"{delays[0]} is not supported by this node", f"{f}.{delays[0]}"
                    )
                out.append(
                    timer(
                        topic,
                        body,
                        queue,
                        props,
                        delays[0],
                        getattr(m, delays[0]),
                        store_ms,
                        f,
                        extra,
                    )
                )
                extras.append(extra)
                continue
            out.append(NewMessage(topic, body, queue_id=queue, properties=props))
            extras.append(extra)
        return out, extras, store_ms

    def _body(self, m: MessageIn, f: str) -> bytes:
        if m.body_base64 is not None:
            if m.body is not None:
                raise bad_request("give body or body_base64, not both", f"{f}.body_base64")
            try:
                body = base64.b64decode(m.body_base64, validate=True)
            except (ValueError, TypeError):
                raise bad_request("body_base64 is not valid base64", f"{f}.body_base64") from None
        else:
            text = m.body
            if text is None:
                raise bad_request("body is required and must be a string", f"{f}.body")
            body = text.encode()
        if len(body) > self.config.max_message_bytes:
            raise ApiError(
                413,
                "message_too_large",
                f"body is {len(body)} bytes, more than max_message_bytes {self.config.max_message_bytes}",
                f"{f}.body",
            )
        return body

    def _next_queue(self, topic: str) -> int:
        n = self.raftlog.store.queue_count(topic) or self.config.default_topic_queues
        rr = self._rr.get(topic)
        if rr is None:
            rr = self._rr[topic] = itertools.count()
        return next(rr) % n
