"""Receipt handles: what a consumer hands back to ack, change the invisible time or forward to
the DLQ. Self-contained and tamper-evident (see the package docstring).

Text form: ``"v1." + base64url(body + tag)`` without padding, where::

     0         2              10             18             26        28   29      29+G 30+G
    +---------+--------------+--------------+--------------+---------+----+-------+----+-------+
    | queue   | offset       | pop id       | invisible    | attempt | G  | group | T  | topic |
    | u16     | u64          | u64          | until ms u64 | u16     | u8 | G B   | u8 | T B   |
    +---------+--------------+--------------+--------------+---------+----+-------+----+-------+
    followed by tag: the first 16 bytes of HMAC-SHA256(key, "v1." + body)

``key`` is HMAC-SHA256(cluster secret, ``"chronomq/pop-handle/v1"``): every node of a cluster
shares it, so any node verifies a handle any other made. A handle that does not decode or
whose tag is wrong raises :class:`InvalidHandle` (the client's fault: a 4xx).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import struct
from dataclasses import dataclass
from typing import Final

PREFIX: Final = "v1."
TAG_BYTES: Final = 16
#: Longest handle text accepted (group and topic at their limits fit well below it).
MAX_HANDLE_CHARS: Final = 512
_FIXED = struct.Struct(">HQQQH")
_KEY_LABEL = b"chronomq/pop-handle/v1"


class InvalidHandle(ValueError):
    """A receipt handle that is malformed, truncated, from another cluster or tampered with."""

    field = "receipt_handle"


@dataclass(frozen=True, slots=True)
class Handle:
    """What a receipt handle names: one hand-out of one message to one group."""

    group: str
    topic: str
    queue: int
    offset: int
    pop_id: int
    attempt: int
    invisible_until_ms: int


class HandleCodec:
    """Makes and checks handles with one cluster secret."""

    __slots__ = ("_key",)

    def __init__(self, secret: bytes) -> None:
        if not secret:
            raise ValueError("a handle codec needs a non-empty secret")
        self._key = hmac.new(secret, _KEY_LABEL, hashlib.sha256).digest()

    def _tag(self, body: bytes) -> bytes:
        return hmac.new(self._key, PREFIX.encode() + body, hashlib.sha256).digest()[:TAG_BYTES]

    def encode(self, h: Handle) -> str:
        group, topic = h.group.encode(), h.topic.encode()
        if len(group) > 255 or len(topic) > 255:
            raise ValueError("group and topic must be at most 255 bytes")
        body = (
            _FIXED.pack(h.queue, h.offset, h.pop_id, h.invisible_until_ms, h.attempt)
            + bytes([len(group)])
            + group
            + bytes([len(topic)])
            + topic
        )
        raw = body + self._tag(body)
        return PREFIX + base64.urlsafe_b64encode(raw).rstrip(b"=").decode()

    def decode(self, text: object) -> Handle:
        """The handle ``text`` names, or :class:`InvalidHandle`."""
        if not isinstance(text, str) or not text.startswith(PREFIX):
            raise InvalidHandle("not a receipt handle of this broker")
        if len(text) > MAX_HANDLE_CHARS:
            raise InvalidHandle(f"a receipt handle is at most {MAX_HANDLE_CHARS} characters")
        b64 = text[len(PREFIX) :]
        try:
            raw = base64.urlsafe_b64decode(b64 + "=" * (-len(b64) % 4))
        except (binascii.Error, ValueError):
            raise InvalidHandle("receipt handle is not base64url") from None
        if len(raw) < _FIXED.size + 2 + TAG_BYTES:
            raise InvalidHandle("receipt handle is truncated")
        body, tag = raw[:-TAG_BYTES], raw[-TAG_BYTES:]
        if not hmac.compare_digest(tag, self._tag(body)):
            raise InvalidHandle("receipt handle does not verify (altered, or from another cluster)")
        queue, offset, pop_id, until_ms, attempt = _FIXED.unpack_from(body)
        at = _FIXED.size
        try:
            g_len = body[at]
            group = body[at + 1 : at + 1 + g_len].decode()
            at += 1 + g_len
            t_len = body[at]
            topic = body[at + 1 : at + 1 + t_len].decode()
            at += 1 + t_len
        except (IndexError, UnicodeDecodeError):
            raise InvalidHandle("receipt handle is malformed") from None
        if at != len(body) or not group or not topic:
            raise InvalidHandle("receipt handle is malformed")
        return Handle(group, topic, queue, offset, pop_id, attempt, until_ms)
