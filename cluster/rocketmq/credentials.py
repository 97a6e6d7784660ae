"""The ``auth_token`` on gRPC calls: the same secret as the HTTP API's bearer token.

With ``auth_token`` set, a call must carry one of, in its ``authorization`` metadata:

- ``Bearer <token>`` (scheme in any case), as HTTP clients send it;
- the RocketMQ 5 clients' own signature, ``MQv2-HMAC-SHA1 Credential=<access key>,
  SignedHeaders=x-mq-date-time, Signature=<hex>``, where the signature is HMAC-SHA1 of the
  ``x-mq-date-time`` metadata value keyed with the token: the official clients send it when
  given ``Credentials(<any access key>, <token>)``, so they work unchanged.

Both are compared in constant time. The date is not checked against the clock (the token is
the secret, as for HTTP; TLS protects it on the wire); the signature only proves the token.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable

from chronomq.cluster.node.auth import bearer_token_matches

SIGNATURE_SCHEME = "MQv2-HMAC-SHA1"
DATE_METADATA = "x-mq-date-time"
MAX_METADATA_CHARS = 1024
"""A longer authorization or date value is refused unread."""


def _metadata(pairs: Iterable[tuple[str, str | bytes]]) -> dict[str, str]:
    out: dict[str, str] = {}
    for key, value in pairs:
        if isinstance(value, bytes):  # only "-bin" keys carry bytes
            continue
        out.setdefault(key.lower(), value)
    return out


def _signature_matches(authorization: str, date: str | None, token: bytes) -> bool:
    scheme, _, rest = authorization.strip().partition(" ")
    if scheme != SIGNATURE_SCHEME or not date:
        return False
    fields = {}
    for part in rest.split(","):
        name, _, value = part.strip().partition("=")
        fields[name.strip()] = value.strip()
    given = fields.get("Signature", "")
    expected = hmac.new(token, date.encode("utf-8", "surrogatepass"), hashlib.sha1).hexdigest()
    return hmac.compare_digest(given.lower().encode(), expected.encode())


def call_is_authorized(metadata: Iterable[tuple[str, str | bytes]] | None, token: bytes) -> bool:
    """True when there is no token to check, or ``metadata`` proves it."""
    if not token:
        return True
    md = _metadata(metadata or ())
    authorization = md.get("authorization")
    if not authorization or len(authorization) > MAX_METADATA_CHARS:
        return False
    if bearer_token_matches(authorization, token):
        return True
    date = md.get(DATE_METADATA)
    if date is not None and len(date) > MAX_METADATA_CHARS:
        return False
    return _signature_matches(authorization, date, token)
