"""The ``auth_token`` on gRPC calls: the same secret as the HTTP API's bearer token.

With ``auth_token`` set, a call must carry exactly one ``authorization`` metadata entry, one of:

- ``Bearer <token>`` (scheme in any case), as HTTP clients send it;
- the RocketMQ 5 clients' own signature, ``MQv2-HMAC-SHA1 Credential=<access key>,
  SignedHeaders=x-mq-date-time, Signature=<hex>``, where the signature is HMAC-SHA1 of the
  ``x-mq-date-time`` metadata value keyed with the token: the official clients send it when
  given ``Credentials(<access key>, <token>)``, so they work unchanged.

A signature is checked further: each of its fields appears once, ``SignedHeaders`` is the date
alone, the access key is ``access_key`` when one is configured, and the date (one entry,
``yyyyMMddTHHmmssZ``) lies within ``grpc_signature_window_s`` of the node's clock, so a
captured (date, signature) pair stops working. The official clients write their local time
with a ``Z``; a date within the window of the node's local time is accepted too (a client in
the node's time zone). Tokens and signatures are compared in constant time.

:func:`call_is_authorized` reads no clock: the caller gives the time.
"""

from __future__ import annotations

import calendar
import hashlib
import hmac
import time
from collections.abc import Iterable
from dataclasses import dataclass

from chronomq.cluster.node.auth import bearer_token_matches

SIGNATURE_SCHEME = "MQv2-HMAC-SHA1"
DATE_METADATA = "x-mq-date-time"
DATE_FORMAT = "%Y%m%dT%H%M%SZ"
SIGNED_HEADERS = DATE_METADATA
MAX_METADATA_CHARS = 1024
"""A longer authorization or date value is refused unread."""
_SIGNATURE_FIELDS = frozenset({"Credential", "SignedHeaders", "Signature"})


@dataclass(frozen=True, slots=True)
class GrpcCredentials:
    """What a node accepts: its token, the access key it names (empty: any) and the window
    a signature's date must fall in."""

    token: bytes
    access_key: str = ""
    window_s: int = 900


@dataclass(frozen=True, slots=True)
class Clock:
    """The node's time as a signature check needs it."""

    now_s: float
    local_offset_s: int
    """The node's time zone's offset from UTC (what a client in that zone writes as UTC)."""

    @classmethod
    def read(cls) -> Clock:
        now = time.time()
        offset = time.localtime(now).tm_gmtoff or 0
        return cls(now, int(offset))


def _entries(pairs: Iterable[tuple[str, str | bytes]], name: str) -> list[str]:
    return [v for k, v in pairs if k.lower() == name and isinstance(v, str)]


def _date_s(text: str) -> int | None:
    try:
        return calendar.timegm(time.strptime(text, DATE_FORMAT))
    except ValueError:
        return None


def _signature_matches(
    authorization: str, date: str | None, creds: GrpcCredentials, clock: Clock
) -> bool:
    scheme, _, rest = authorization.strip().partition(" ")
    if scheme != SIGNATURE_SCHEME or not date:
        return False
    fields: dict[str, str] = {}
    for part in rest.split(","):
        name, sep, value = part.strip().partition("=")
        name = name.strip()
        if not sep or name not in _SIGNATURE_FIELDS or name in fields:
            return False  # an unknown, bare or repeated field: not what a client sends
        fields[name] = value.strip()
    if fields.keys() != _SIGNATURE_FIELDS or fields["SignedHeaders"].lower() != SIGNED_HEADERS:
        return False
    if creds.access_key and not hmac.compare_digest(
        fields["Credential"].encode("utf-8", "surrogatepass"),
        creds.access_key.encode("utf-8", "surrogatepass"),
    ):
        return False
    signed_s = _date_s(date)
    if signed_s is None or not any(
        abs(signed_s - (clock.now_s + offset)) <= creds.window_s
        for offset in {0, clock.local_offset_s}
    ):
        return False
    expected = hmac.new(creds.token, date.encode("utf-8", "surrogatepass"), hashlib.sha1)
    return hmac.compare_digest(fields["Signature"].lower().encode(), expected.hexdigest().encode())


def call_is_authorized(
    metadata: Iterable[tuple[str, str | bytes]] | None, creds: GrpcCredentials, clock: Clock
) -> bool:
    """True when there is no token to check, or ``metadata`` proves it."""
    if not creds.token:
        return True
    pairs = list(metadata or ())
    authorizations = _entries(pairs, "authorization")
    if len(authorizations) != 1 or len(authorizations[0]) > MAX_METADATA_CHARS:
        return False
    authorization = authorizations[0]
    if bearer_token_matches(authorization, creds.token):
        return True
    dates = _entries(pairs, DATE_METADATA)
    if len(dates) > 1 or (dates and len(dates[0]) > MAX_METADATA_CHARS):
        return False
    return _signature_matches(authorization, dates[0] if dates else None, creds, clock)
