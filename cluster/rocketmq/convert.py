"""A ``SendMessageRequest`` as our produce request, and recall handles (no I/O).

One request is one produce request of the HTTP API (``POST /v1/topics/{topic}/messages``), so
it takes the same path: the same validation, group commit, ops logs and idempotency.

- ``body`` (``body_encoding`` IDENTITY, or GZIP inflated up to ``max_message_bytes``) ->
  ``body_base64``; ``tag`` -> ``tags``; ``keys`` -> ``keys``; ``user_properties`` ->
  ``properties``;
- ``system_properties.message_id`` (the client's id, kept across its own retries) ->
  ``message_id``, stored as the ``UNIQ_KEY`` property (RocketMQ's name for it), and the
  request's idempotency key, so a send retried on another node after a failover is stored once
  and no other send to the topic takes the id within the idempotency window (a client cannot
  set ``UNIQ_KEY`` as a user property);
- ``system_properties.delivery_timestamp`` -> ``deliver_at_ms`` (our timer);
- the 4.x ``DELAY`` user property (a delay level) -> ``delay_level``;
- ``message_group`` (FIFO), transactions, lite topics and priorities are refused with
  ``unsupported`` (UNSUPPORTED).

Nothing a client sets per attempt (born time and host) goes into the produce request, so a
retry fingerprints the same as its first attempt (:mod:`chronomq.cluster.node.idempotency`).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
import zlib
from dataclasses import dataclass
from typing import Any, Final

from rocketmq.grpc_protocol import definition_pb2 as pb
from rocketmq.grpc_protocol import service_pb2 as spb

from chronomq.cluster.node import reserved
from chronomq.cluster.node.errors import ApiError, bad_request
from chronomq.cluster.node.idempotency import MESSAGE_ID_KEY_PREFIX
from chronomq.raftlog import record

UNIQ_KEY: Final = reserved.UNIQ_KEY
"""The property holding the client's message id (RocketMQ's ``PROPERTY_UNIQ_CLIENT_MESSAGE_ID``)."""
DELAY_PROPERTY: Final = "DELAY"
"""The 4.x delay level property a client may still set."""
MAX_TIMESTAMP_SECONDS: Final = 253_402_300_799
"""9999-12-31T23:59:59Z: the last second a protobuf ``Timestamp`` may hold (its definition
says so); in ms it fits every integer the node writes or forwards."""
MAX_MESSAGE_ID_CHARS: Final = 128
IDEMPOTENCY_PREFIX: Final = MESSAGE_ID_KEY_PREFIX
RECALL_PREFIX: Final = "c2."
_RECALL_KEY_LABEL: Final = b"chronomq/recall-handle/v2"
_RECALL_TAG_BYTES: Final = 16
_TAG_RE: Final = re.compile(r"[0-9a-f]{32}")
_ID_RE: Final = re.compile(r"[0-9A-Za-z_\-]{1,128}")
_HEX_RE: Final = re.compile(r"[0-9a-fA-F]{32}")
_SUPPORTED_TYPES: Final = frozenset(
    {pb.MessageType.MESSAGE_TYPE_UNSPECIFIED, pb.MessageType.NORMAL, pb.MessageType.DELAY}
)


@dataclass(frozen=True, slots=True)
class ProduceRequest:
    """What a ``SendMessageRequest`` asks of our produce path."""

    topic: str
    messages: tuple[dict[str, Any], ...]
    """The HTTP API's message objects, in the request's order."""
    client_ids: tuple[str, ...]
    """Each message's client message id ('' when the client gave none)."""
    idempotency_key: str | None
    body_bytes: int

    def body(self) -> dict[str, Any]:
        return {"messages": list(self.messages)}


def unsupported(message: str, field: str) -> ApiError:
    return ApiError(400, "unsupported", message, field)


def _inflate(data: bytes, limit_bytes: int, field: str) -> bytes:
    d = zlib.decompressobj(wbits=47)  # gzip or zlib header
    try:
        out = d.decompress(data, limit_bytes + 1)
    except zlib.error as exc:
        raise bad_request(f"body is not valid GZIP: {exc}", field) from None
    if len(out) > limit_bytes or d.unconsumed_tail:
        raise ApiError(
            413,
            "message_too_large",
            f"the inflated body is more than max_message_bytes {limit_bytes}",
            field,
        )
    return out


def _message(m: Any, i: int, max_message_bytes: int) -> tuple[dict[str, Any], str]:
    f = f"messages[{i}]"
    sp = m.system_properties
    if sp.message_type not in _SUPPORTED_TYPES:
        name = pb.MessageType.Name(sp.message_type)
        raise unsupported(
            f"message type {name} is not supported: only NORMAL and DELAY messages",
            f"{f}.system_properties.message_type",
        )
    if sp.message_group:
        raise unsupported(
            "FIFO message groups are not supported", f"{f}.system_properties.message_group"
        )
    if sp.lite_topic:
        raise unsupported("lite topics are not supported", f"{f}.system_properties.lite_topic")
    if sp.HasField("priority"):
        raise unsupported("priorities are not supported", f"{f}.system_properties.priority")
    body = bytes(m.body)
    if sp.body_encoding == pb.Encoding.GZIP:
        body = _inflate(body, max_message_bytes, f"{f}.body")
    elif sp.body_encoding not in (pb.Encoding.ENCODING_UNSPECIFIED, pb.Encoding.IDENTITY):
        raise bad_request("body_encoding must be IDENTITY or GZIP", f"{f}.body_encoding")
    if not body:
        raise ApiError(400, "message_body_empty", "the message body is empty", f"{f}.body")
    out: dict[str, Any] = {"body_base64": base64.b64encode(body).decode("ascii")}
    props = dict(m.user_properties)
    level = props.pop(DELAY_PROPERTY, None)
    client_id = sp.message_id
    if client_id:
        if not _ID_RE.fullmatch(client_id):
            raise ApiError(
                400,
                "illegal_message_id",
                f"message_id must be 1 to {MAX_MESSAGE_ID_CHARS} letters, digits, _ or -",
                f"{f}.system_properties.message_id",
            )
        out["message_id"] = client_id
    if props:
        out["properties"] = props
    if sp.tag:
        out["tags"] = sp.tag
    if sp.keys:
        out["keys"] = list(sp.keys)
    if sp.HasField("delivery_timestamp"):
        if level is not None:
            raise bad_request(
                "give delivery_timestamp or the DELAY property, not both",
                f"{f}.user_properties.{DELAY_PROPERTY}",
            )
        out["deliver_at_ms"] = timestamp_ms(
            sp.delivery_timestamp,
            f"{f}.system_properties.delivery_timestamp",
            "invalid_deliver_time",
        )
    elif level is not None:
        if not (level.isascii() and level.isdigit()) or len(level) > 9:
            raise ApiError(
                400,
                "invalid_delay_level",
                f"the DELAY property must be a delay level (a non-negative integer), got {level!r}",
                f"{f}.user_properties.{DELAY_PROPERTY}",
            )
        out["delay_level"] = int(level)
    return out, client_id


def timestamp_ms(ts: Any, field: str, code: str = "invalid_input") -> int:
    """A protobuf ``Timestamp`` in ms since the epoch; 400 ``code`` naming ``field`` when it
    lies before the epoch or beyond what a ``Timestamp`` may hold (checked here, before the
    value is forwarded as JSON or compared with anything)."""
    if not 0 <= ts.seconds <= MAX_TIMESTAMP_SECONDS or not 0 <= ts.nanos < 1_000_000_000:
        raise ApiError(
            400,
            code,
            f"{field.rsplit('.', 1)[-1]} must be a time from the epoch to the year 9999",
            field,
        )
    return int(ts.seconds) * 1000 + int(ts.nanos) // 1_000_000


def produce_request(req: spb.SendMessageRequest, max_message_bytes: int) -> ProduceRequest:
    """``req`` as our produce request; an :class:`ApiError` names what is wrong."""
    if not req.messages:
        raise bad_request("a send needs at least one message", "messages")
    topic = req.messages[0].topic.name
    record.validate_topic(topic, "topic")
    messages = []
    ids = []
    size = 0
    for i, m in enumerate(req.messages):
        if m.topic.name != topic:
            raise bad_request(
                "every message of one send must have the same topic", f"messages[{i}].topic"
            )
        raw, client_id = _message(m, i, max_message_bytes)
        messages.append(raw)
        ids.append(client_id)
        size += len(m.body)
    return ProduceRequest(topic, tuple(messages), tuple(ids), idempotency_key(ids), size)


def idempotency_key(client_ids: list[str]) -> str | None:
    """The request's ``Idempotency-Key``: the client's message id. None for a message without
    one, and for a batch (which the broker refuses when its messages carry ids: each id is
    its own message's key, see :func:`chronomq.cluster.node.idempotency.message_id_key`)."""
    if len(client_ids) != 1 or not client_ids[0]:
        return None
    return IDEMPOTENCY_PREFIX + client_ids[0]


# ---------------------------------------------------------------------- recall handles


class RecallHandles:
    """Recall handles: ``c2.<timer msg id>.<client message id>.<tag>``, where the tag is the
    first 16 bytes (hex) of HMAC-SHA256(key, id, topic, client id) and ``key`` is
    HMAC-SHA256(cluster secret, ``"chronomq/recall-handle/v2"``). Any node of the cluster
    checks a handle any other made; a handle is good only for the topic it was sent to, and
    no one without the secret can make one for a message id they learnt."""

    __slots__ = ("_key",)

    def __init__(self, secret: bytes) -> None:
        if not secret:
            raise ValueError("recall handles need a non-empty secret")
        self._key = hmac.new(secret, _RECALL_KEY_LABEL, hashlib.sha256).digest()

    def _tag(self, hex_id: str, topic: str, client_id: str) -> str:
        text = "\0".join((hex_id, topic, client_id)).encode("utf-8", "surrogatepass")
        return hmac.new(self._key, text, hashlib.sha256).digest()[:_RECALL_TAG_BYTES].hex()

    def make(self, timer_msg_id_hex: str, topic: str, client_id: str) -> str:
        """The handle a timer message's send receipt carries."""
        hex_id = timer_msg_id_hex.upper()
        return f"{RECALL_PREFIX}{hex_id}.{client_id}.{self._tag(hex_id, topic, client_id)}"

    def parse(self, handle: str, topic: str) -> tuple[str, str]:
        """``(timer msg id hex, client message id)`` of a handle this cluster made for
        ``topic``; 400 ``invalid_input`` naming recall_handle otherwise."""
        refused = bad_request(
            f"not a recall handle this cluster issued for topic {topic}", "recall_handle"
        )
        if not handle.startswith(RECALL_PREFIX) or len(handle) > 250:
            raise refused
        parts = handle[len(RECALL_PREFIX) :].split(".")
        if len(parts) != 3:
            raise refused
        hex_id, client_id, tag = parts
        if (
            not _HEX_RE.fullmatch(hex_id)
            or (client_id and not _ID_RE.fullmatch(client_id))
            or not _TAG_RE.fullmatch(tag)
        ):
            raise refused
        hex_id = hex_id.upper()
        if not hmac.compare_digest(tag, self._tag(hex_id, topic, client_id)):
            raise refused
        return hex_id, client_id
