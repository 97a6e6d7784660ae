"""The catch-up channel's messages and their MACs: bytes in, typed values out, no sockets.

A connection carries one request. Both ends prove knowledge of the cluster secret with an
HMAC-SHA256 challenge-response over nonces from both sides, and the request and the answer's
header are covered by those MACs. All integers are big-endian::

    HELLO, client -> server (24 bytes)
    0               8                               24
    +---------------+-------------------------------+
    | "CMQHELO1"    | client nonce (16 random)      |
    +---------------+-------------------------------+

    CHALLENGE, server -> client (24 bytes)
    0               8                               24
    +---------------+-------------------------------+
    | "CMQCHAL1"    | server nonce (16 random)      |
    +---------------+-------------------------------+

    REQUEST, client -> server (56 bytes)
    0               8               16              24                              56
    +---------------+---------------+---------------+-------------------------------+
    | "CMQFTCH1"    | start (u64)   | end (u64)     | request MAC (32)              |
    +---------------+---------------+---------------+-------------------------------+

    RESPONSE, server -> client (49 bytes), then ``count`` CommitLog bytes from ``start``
    0               8   9               17                              49
    +---------------+---+---------------+-------------------------------+
    | "CMQBYTE1"    |st | count (u64)   | response MAC (32)             |
    +---------------+---+---------------+-------------------------------+
    st: 0 OK, 1 BUSY (no transfer slot free: ask another peer), 2 BAD_RANGE (end < start)

    DENIED, server -> client (8 bytes), then the server closes: "CMQDENY1"

The MACs, with ``K = HMAC-SHA256(cluster_secret, "chronomq catch-up v1")`` (a key of its own,
so no MAC made here is valid on another channel that uses the same secret)::

    request MAC  = HMAC-SHA256(K, "CMQ catch-up request\\0"  | client nonce | server nonce
                                  | start | end)
    response MAC = HMAC-SHA256(K, "CMQ catch-up response\\0" | client nonce | server nonce
                                  | start | end | st | count)

Why this shape:

* The server answers nothing but its nonce before the client has proved the secret, so it is
  no MAC oracle, and an unauthenticated client never sees a CommitLog byte.
* The client checks the server's MAC before it reads a byte: a server without the secret
  cannot feed it bytes. Each side's MAC covers the other side's fresh nonce, so a recorded
  exchange does not replay, and the two roles sign under different labels, so a MAC taken from
  one side is never valid for the other (no reflection).
* The CommitLog bytes themselves are not MACed: they go out by ``sendfile`` without passing
  through Python. The client checks them against the snapshot's hash chain, which came through
  Raft (:class:`chronomq.raftlog.chain.RangeCheck`), before it accepts them.
* An empty secret (allowed on loopback only) still runs the same exchange; it then proves
  nothing, which is why it is refused off loopback by the node's configuration.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import struct
from dataclasses import dataclass

NONCE_BYTES = 16
MAC_BYTES = 32

HELLO_MAGIC = b"CMQHELO1"
CHALLENGE_MAGIC = b"CMQCHAL1"
REQUEST_MAGIC = b"CMQFTCH1"
RESPONSE_MAGIC = b"CMQBYTE1"
DENIED = b"CMQDENY1"

_HELLO = struct.Struct(">8s16s")
_CHALLENGE = struct.Struct(">8s16s")
_REQUEST = struct.Struct(">8sQQ32s")
_RESPONSE = struct.Struct(">8sBQ32s")
_RANGE = struct.Struct(">QQ")
_ANSWER = struct.Struct(">BQ")

HELLO_SIZE = _HELLO.size
CHALLENGE_SIZE = _CHALLENGE.size
REQUEST_SIZE = _REQUEST.size
RESPONSE_SIZE = _RESPONSE.size
DENIED_SIZE = len(DENIED)

_KEY_LABEL = b"chronomq catch-up v1"
_REQUEST_LABEL = b"CMQ catch-up request\x00"
_RESPONSE_LABEL = b"CMQ catch-up response\x00"


class CatchupError(ConnectionError):
    """A catch-up exchange failed; what it says names whose fault."""


class ProtocolError(CatchupError):
    """The other side sent bytes that are not this protocol."""


class AuthFailed(CatchupError):
    """The other side's MAC does not verify: it does not hold the cluster secret."""


class Refused(CatchupError):
    """The server refused us (it could not verify our MAC)."""


class Busy(CatchupError):
    """The server has no transfer slot free."""


class Gone(CatchupError):
    """The server no longer holds the start of the range: retention deleted it."""


class Status(enum.IntEnum):
    OK = 0
    BUSY = 1
    BAD_RANGE = 2
    #: The range starts below the server's CommitLog minimum (deleted by retention); the
    #: answer's ``count`` is that minimum.
    GONE = 3


@dataclass(frozen=True, slots=True)
class FetchRequest:
    start: int
    end: int


@dataclass(frozen=True, slots=True)
class Answer:
    status: Status
    count: int


def derive_key(cluster_secret: bytes) -> bytes:
    """The catch-up channel's MAC key."""
    return hmac.new(cluster_secret, _KEY_LABEL, hashlib.sha256).digest()


# ---------------------------------------------------------------------- HELLO / CHALLENGE


def encode_hello(client_nonce: bytes) -> bytes:
    return _HELLO.pack(HELLO_MAGIC, _nonce(client_nonce))


def decode_hello(data: bytes) -> bytes:
    """The client nonce."""
    magic, nonce = _HELLO.unpack(data)
    if magic != HELLO_MAGIC:
        raise ProtocolError(f"not a catch-up hello (starts with {magic!r})")
    return bytes(nonce)


def encode_challenge(server_nonce: bytes) -> bytes:
    return _CHALLENGE.pack(CHALLENGE_MAGIC, _nonce(server_nonce))


def decode_challenge(data: bytes) -> bytes:
    """The server nonce."""
    magic, nonce = _CHALLENGE.unpack(data)
    if magic == DENIED:
        raise Refused("the server refused the connection")
    if magic != CHALLENGE_MAGIC:
        raise ProtocolError(f"not a catch-up challenge (starts with {magic!r})")
    return bytes(nonce)


def _nonce(nonce: bytes) -> bytes:
    if len(nonce) != NONCE_BYTES:
        raise ValueError(f"a nonce is {NONCE_BYTES} bytes, got {len(nonce)}")
    return nonce


# ---------------------------------------------------------------------- REQUEST / RESPONSE


@dataclass(frozen=True, slots=True)
class Session:
    """One connection's MAC key and nonces: signs and checks its request and answer."""

    key: bytes
    client_nonce: bytes
    server_nonce: bytes

    def _request_mac(self, start: int, end: int) -> bytes:
        msg = _REQUEST_LABEL + self.client_nonce + self.server_nonce + _RANGE.pack(start, end)
        return hmac.new(self.key, msg, hashlib.sha256).digest()

    def _response_mac(self, request: FetchRequest, answer: Answer) -> bytes:
        msg = (
            _RESPONSE_LABEL
            + self.client_nonce
            + self.server_nonce
            + _RANGE.pack(request.start, request.end)
            + _ANSWER.pack(answer.status, answer.count)
        )
        return hmac.new(self.key, msg, hashlib.sha256).digest()

    def encode_request(self, request: FetchRequest) -> bytes:
        mac = self._request_mac(request.start, request.end)
        return _REQUEST.pack(REQUEST_MAGIC, request.start, request.end, mac)

    def decode_request(self, data: bytes) -> FetchRequest:
        """The request, if its MAC verifies; :class:`AuthFailed` otherwise."""
        magic, start, end, mac = _REQUEST.unpack(data)
        if magic != REQUEST_MAGIC:
            raise ProtocolError(f"not a catch-up request (starts with {magic!r})")
        if not hmac.compare_digest(mac, self._request_mac(start, end)):
            raise AuthFailed("the request's MAC does not verify (wrong cluster secret?)")
        return FetchRequest(start, end)

    def encode_response(self, request: FetchRequest, answer: Answer) -> bytes:
        mac = self._response_mac(request, answer)
        return _RESPONSE.pack(RESPONSE_MAGIC, answer.status, answer.count, mac)

    def decode_response(self, data: bytes, request: FetchRequest) -> Answer:
        """The answer to ``request``, if its MAC verifies; :class:`AuthFailed` otherwise."""
        magic, status, count, mac = _RESPONSE.unpack(data)
        if magic != RESPONSE_MAGIC:
            raise ProtocolError(f"not a catch-up response (starts with {magic!r})")
        try:
            answer = Answer(Status(status), count)
        except ValueError:
            raise ProtocolError(f"unknown catch-up status {status}") from None
        if not hmac.compare_digest(mac, self._response_mac(request, answer)):
            raise AuthFailed(
                "the server's MAC does not verify: it does not hold this cluster's secret"
            )
        if answer.status is Status.OK and answer.count > request.end - request.start:
            raise ProtocolError(
                f"the server offers {answer.count} bytes of a {request.end - request.start}-byte range"
            )
        return answer
