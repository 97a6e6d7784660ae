"""Client idempotency keys at the edge: the request's fingerprint and the early 422.

A produce request's ``Idempotency-Key`` is remembered by apply (:mod:`chronomq.raftlog.store`) with a
fingerprint of the request, decided here on the leader before proposing: a hash of the topic
and of each message as the client gave it once parsed (body bytes, whether sent as ``body`` or
``body_base64``; properties; keys; tags; queue; the delay field and its value). Absent and
``null`` fields are the same request. Nothing the leader decides (ids, store time, due times,
queue choice) is in it, so a retry of the same request has the same fingerprint on any leader.

Apply is the authority: two requests racing with one key are told apart there. The check here
only answers a mismatch already applied without a Raft round trip.
"""

from __future__ import annotations

import base64
import hashlib
import struct
from collections.abc import Sequence

import orjson

from chronomq.cluster.node.errors import ApiError, bad_request
from chronomq.cluster.node.models import MessageIn
from chronomq.raftlog.store import Store

FIELD = "Idempotency-Key"
_DELAY_FIELDS = ("delay_level", "delay_ms", "deliver_at_ms")
_LENGTHS = struct.Struct(">QQ")


def client_key(topic: str, idempotency_key: str) -> str:
    """A client's key as apply holds it: scoped to the topic."""
    return f"http:{topic}:{idempotency_key}"


def request_fingerprint(topic: str, raw: Sequence[MessageIn]) -> str:
    """The fingerprint (32 hex digits) of a produce request that parsed without error."""
    h = hashlib.blake2b(digest_size=16, person=b"chronomq-idem-1")
    t = topic.encode("utf-8", "surrogatepass")
    h.update(_LENGTHS.pack(len(t), len(raw)) + t)
    for m in raw:
        if m.body_base64 is not None:
            body = base64.b64decode(m.body_base64)
        else:
            body = str(m.body).encode("utf-8", "surrogatepass")
        meta = orjson.dumps(
            [
                m.properties or {},
                m.keys or [],
                m.tags,
                m.queue,
                [[k, getattr(m, k)] for k in _DELAY_FIELDS if getattr(m, k) is not None],
                # Only when given: a request without one fingerprints as it always did.
                *([m.message_id] if m.message_id is not None else []),
            ],
            option=orjson.OPT_SORT_KEYS,
        )
        h.update(_LENGTHS.pack(len(body), len(meta)))
        h.update(body)
        h.update(meta)
    return h.hexdigest()


MESSAGE_ID_KEY_PREFIX = "rmq5:"
"""The idempotency key of a message sent with a client-made ``message_id``: the prefix, then
the id (the RocketMQ 5 endpoint's key for a send, since it maps the client's id there)."""


def message_id_key(raw: Sequence[MessageIn], given: str | None) -> str | None:
    """The idempotency key of a request whose message carries a ``message_id``: the id itself,
    so that no other message of the topic takes it within the window (a second send with
    another content is refused, the same one answers the first placement); ``given`` (the
    request's ``Idempotency-Key``) when no message carries one. 400 for a message with an id
    sent with others, or a header that names another key."""
    with_id = [i for i, m in enumerate(raw) if m.message_id is not None]
    if not with_id:
        return given
    if len(raw) != 1:
        raise bad_request(
            "a message with a message_id is sent alone: its id is the request's idempotency key",
            f"messages[{with_id[0]}].message_id",
        )
    key = MESSAGE_ID_KEY_PREFIX + str(raw[0].message_id)
    if given is not None and given != key:
        raise bad_request(f"with a message_id the Idempotency-Key is {key!r} or absent", FIELD)
    return key


def key_fingerprint(key: str) -> str:
    """A fingerprint that depends on the key alone, for requests whose key names them whole
    (sending one consumed message back): every repeat is a replay, never a reuse."""
    return hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()


def check_reuse(store: Store, key: str, fingerprint: str, now_ms: int, window_s: int) -> None:
    """422 when ``key`` was applied with another request within the window (as this node
    knows it: what it has applied is committed)."""
    known = store.client_key(key)
    if known is None or known.propose_ms <= now_ms - window_s * 1000:
        return
    if known.fingerprint.hex() != fingerprint:
        raise reused()


def reused() -> ApiError:
    return ApiError(
        422,
        "idempotency_key_reused",
        "this Idempotency-Key was used with a different request within the idempotency "
        "window; send a new key for a new request",
        FIELD,
    )
