"""The authenticated Raft wire, without I/O: hello, proof and frame, encoded and checked.

Both ends of every Raft connection prove they hold the cluster secret before any pickled
byte is read, then every frame carries a MAC under a key of its direction. The bytes come
from and go to :mod:`chronomq.raftlog.wire`, which owns the sockets; everything here takes bytes and
gives bytes, so it is tested alone (golden bytes in ``tests/raftlog/test_wire.py``).

Conversation (each side sends its hello at once: the initiator on connect, the acceptor on
accept; each sends its proof once it has the other's hello)::

    initiator                                   acceptor
    hello(I, Ni)            ------------->
                            <-------------      hello(A, Na)
    proof(I, Ni, Na)        ------------->
                            <-------------      proof(A, Na, Ni)
    frame 0, 1, ... (key I) ------------->
                            <-------------      frame 0, 1, ... (key A)

Hello, 40 bytes and the sender's "about"::

    +------------------+--------+--------+-----------------------+
    | magic "CMQR" (4) | ver u8 | role u8| about length u16 (BE) |
    +------------------+--------+--------+-----------------------+
    | nonce: 32 random bytes, fresh for every connection         |
    +------------------------------------------------------------+
    | about: the sender's chronomq version, ASCII (0..64 bytes)  |
    +------------------------------------------------------------+

    ver = 2 (the wire version: hello, proof, frames and the messages they carry);
    role = 1 (initiator, the side that connected) or 2 (acceptor)

Every wire version keeps these 40 bytes and the about after them, so a node can always name
the versions of a peer it cannot talk to. Version 1 (builds before the version exchange) sent
the 40 bytes with a zero length and no about. A node refuses a peer of another wire version
(:class:`VersionMismatch`: the caller logs it at ERROR with both versions); a peer of the same
wire version and another chronomq version is accepted, its version recorded.

Proof, 32 bytes::

    +-------------------------------------------------------------------------------------+
    | HMAC-SHA256(secret, "chronomq-raft-proof-v2" | role u8 | own nonce | peer nonce | about) |
    +-------------------------------------------------------------------------------------+

    role and about are the sender's: a proof sent back to its author (reflection) names the
    wrong role and fails; fresh nonces on both sides make a recorded proof useless; the about
    a node records for its peer is the one the peer proved.

Session keys, one per direction (the key of the side that sends)::

    key(role) = HMAC-SHA256(secret, "chronomq-raft-key-v1" | role u8 | Ni | Na)

Frame, 37 bytes of header then the payload::

    +------------------+----------+---------------------------------+----------------+
    | length u32 (BE)  | flags u8 | mac (32)                        | payload        |
    |  of the payload  |          | HMAC-SHA256(key(sender role),   |  (length bytes)|
    |                  |          |   seq u64 BE | flags | payload) |                |
    +------------------+----------+---------------------------------+----------------+

    seq counts the frames of one direction from 0 and is not sent: a frame injected,
    dropped, reordered or replayed (even from another connection: other nonces, other keys)
    fails its MAC. flags bit 0: payload is zlib-compressed; other bits must be 0.
    payload = pickle (protocol 5) of one pysyncobj message, read with
    :mod:`chronomq.raftlog.safepickle` after the MAC is checked.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import pickle
import struct
import zlib
from dataclasses import dataclass
from typing import Any

from chronomq.raftlog import safepickle

MAGIC = b"CMQR"
VERSION = 2
MAX_ABOUT_BYTES = 64
NONCE_BYTES = 32
MAC_BYTES = 32
PROOF_LABEL = b"chronomq-raft-proof-v2"
KEY_LABEL = b"chronomq-raft-key-v1"
FLAG_ZLIB = 0x01
PICKLE_PROTOCOL = 5

_HELLO = struct.Struct(">4sBBH32s")
_FRAME_HEADER = struct.Struct(">IB32s")
_SEQ = struct.Struct(">Q")
_FLAGS = struct.Struct(">B")

HELLO_BYTES = _HELLO.size  # 40, then the about
PROOF_BYTES = MAC_BYTES  # 32
FRAME_HEADER_BYTES = _FRAME_HEADER.size  # 37


class WireError(Exception):
    """The peer broke the protocol or does not hold the secret (never our own fault)."""


class HandshakeRefused(WireError):
    pass


class VersionMismatch(HandshakeRefused):
    """The peer speaks another wire version: no node of either version can fix it but an
    upgrade of every node to one version."""

    def __init__(self, peer_wire: int, peer_about: str, own_wire: int, own_about: str) -> None:
        self.peer_wire = peer_wire
        self.peer_about = peer_about
        self.own_wire = own_wire
        self.own_about = own_about
        peer = (
            f"chronomq {peer_about}"
            if peer_about
            else "a chronomq build from before the version exchange"
        )
        super().__init__(
            f"the peer runs {peer} with Raft wire version {peer_wire}; this node runs chronomq "
            f"{own_about or 'unknown'} with wire version {own_wire}. Nodes of different wire "
            "versions cannot form a cluster: upgrade every node to one version together"
        )


class FrameRefused(WireError):
    pass


class Role(enum.IntEnum):
    INITIATOR = 1
    ACCEPTOR = 2

    @property
    def peer(self) -> Role:
        return Role.ACCEPTOR if self is Role.INITIATOR else Role.INITIATOR


# ------------------------------------------------------------------ hello


@dataclass(frozen=True, slots=True)
class Hello:
    role: Role
    nonce: bytes
    version: int = VERSION
    about: str = ""  # the sender's chronomq version

    def __post_init__(self) -> None:
        if len(self.nonce) != NONCE_BYTES:
            raise ValueError(f"nonce must be {NONCE_BYTES} bytes")
        if len(self.about_bytes) > MAX_ABOUT_BYTES:
            raise ValueError(f"about must be at most {MAX_ABOUT_BYTES} ASCII bytes")

    @property
    def about_bytes(self) -> bytes:
        return self.about.encode("ascii", "replace")

    def encode(self) -> bytes:
        about = self.about_bytes
        return _HELLO.pack(MAGIC, self.version, self.role, len(about), self.nonce) + about

    @staticmethod
    def length(head: bytes | bytearray) -> int | None:
        """The whole hello's length from its first 40 bytes; None with fewer."""
        if len(head) < HELLO_BYTES:
            return None
        (about_len,) = struct.unpack_from(">H", head, 6)
        if about_len > MAX_ABOUT_BYTES:
            raise HandshakeRefused(f"malformed hello (about of {about_len} bytes)")
        return HELLO_BYTES + int(about_len)

    @classmethod
    def decode(cls, data: bytes) -> Hello:
        """Any wire version's hello (see the module); the caller judges the version."""
        if len(data) < HELLO_BYTES:
            raise HandshakeRefused(f"hello must be {HELLO_BYTES} bytes, got {len(data)}")
        magic, version, role, about_len, nonce = _HELLO.unpack_from(data)
        if magic != MAGIC:
            raise HandshakeRefused(f"not a chronomq Raft hello (starts {bytes(data[:8])!r})")
        if role not in (Role.INITIATOR, Role.ACCEPTOR):
            raise HandshakeRefused(f"malformed hello (role {role})")
        if len(data) != HELLO_BYTES + about_len or about_len > MAX_ABOUT_BYTES:
            raise HandshakeRefused(
                f"malformed hello ({len(data)} bytes for an about of {about_len})"
            )
        raw = bytes(data[HELLO_BYTES:])
        if not all(32 <= b < 127 for b in raw):
            raise HandshakeRefused(f"malformed hello (about {raw[:16]!r} is not printable ASCII)")
        return cls(Role(role), nonce, version, raw.decode("ascii"))


# ------------------------------------------------------------------ proof and keys


def proof(
    secret: bytes, sender: Role, sender_nonce: bytes, receiver_nonce: bytes, about: bytes = b""
) -> bytes:
    msg = PROOF_LABEL + bytes([sender]) + sender_nonce + receiver_nonce + about
    return hmac.digest(secret, msg, hashlib.sha256)


def session_key(
    secret: bytes, sender: Role, initiator_nonce: bytes, acceptor_nonce: bytes
) -> bytes:
    msg = KEY_LABEL + bytes([sender]) + initiator_nonce + acceptor_nonce
    return hmac.digest(secret, msg, hashlib.sha256)


# ------------------------------------------------------------------ frames


class _Direction:
    """One direction's key and sequence number."""

    def __init__(self, key: bytes) -> None:
        self._mac = hmac.new(key, digestmod=hashlib.sha256)
        self.seq = 0

    def mac(self, flags: int, payload: bytes | bytearray | memoryview) -> bytes:
        m = self._mac.copy()
        m.update(_SEQ.pack(self.seq) + _FLAGS.pack(flags))
        m.update(payload)
        return m.digest()


class Session:
    """Seals outgoing frames and opens incoming ones, for one established connection."""

    def __init__(self, send_key: bytes, recv_key: bytes, max_payload_bytes: int) -> None:
        self._send = _Direction(send_key)
        self._recv = _Direction(recv_key)
        self.max_payload_bytes = max_payload_bytes
        self.macs_checked = 0  # incoming frames whose MAC was computed (each exactly once)

    def seal(self, payload: bytes, flags: int = 0) -> bytes:
        """The header to send before ``payload`` (not copied: the caller writes both)."""
        if len(payload) > self.max_payload_bytes:
            raise ValueError(
                f"frame of {len(payload)} bytes exceeds the limit of {self.max_payload_bytes}"
            )
        header = _FRAME_HEADER.pack(len(payload), flags, self._send.mac(flags, payload))
        self._send.seq += 1
        return header

    def open(self, buf: bytearray) -> tuple[int, bytes] | None:
        """Take one whole frame from the front of ``buf``: (flags, payload); None if ``buf``
        does not hold one yet. Only the bytes of the frame are copied, once."""
        if len(buf) < FRAME_HEADER_BYTES:
            return None
        length, flags, mac = _FRAME_HEADER.unpack_from(buf)
        if length > self.max_payload_bytes:
            raise FrameRefused(
                f"frame of {length} bytes announced, above the limit of {self.max_payload_bytes}"
            )
        if flags & ~FLAG_ZLIB:
            raise FrameRefused(f"unknown frame flags {flags:#04x}")
        end = FRAME_HEADER_BYTES + length
        if len(buf) < end:
            return None
        view = memoryview(buf)
        try:
            with view[FRAME_HEADER_BYTES:end] as payload_view:
                self.macs_checked += 1
                ok = hmac.compare_digest(self._recv.mac(flags, payload_view), mac)
                payload = bytes(payload_view) if ok else b""
        finally:
            view.release()  # before ``del``: a bytearray with views cannot shrink
        if not ok:
            raise FrameRefused(f"bad MAC on frame {self._recv.seq}")
        self._recv.seq += 1
        del buf[:end]
        return flags, payload


def encode_frame(session: Session, payload: bytes, flags: int = 0) -> bytes:
    """Header and payload as one string (tests; the connection writes the two apart)."""
    return session.seal(payload, flags) + payload


# ------------------------------------------------------------------ payloads


def encode_payload(message: Any, compression_level: int = 0) -> tuple[int, bytes]:
    data = pickle.dumps(message, PICKLE_PROTOCOL)
    if compression_level > 0:
        return FLAG_ZLIB, zlib.compress(data, compression_level)
    return 0, data


def decode_payload(flags: int, payload: bytes, max_bytes: int) -> Any:
    """The message of an authenticated frame; raises FrameRefused for anything but plain data."""
    data = payload
    if flags & FLAG_ZLIB:
        inflater = zlib.decompressobj()
        try:
            data = inflater.decompress(payload, max_bytes)
        except zlib.error as exc:
            raise FrameRefused(f"bad compressed payload: {exc}") from exc
        if inflater.unconsumed_tail:
            raise FrameRefused(f"payload inflates beyond {max_bytes} bytes")
    try:
        return safepickle.loads(data, safepickle.WIRE_GLOBALS)
    except safepickle.ForbiddenGlobal as exc:
        raise FrameRefused(f"refused to unpickle: {exc}") from exc
    except Exception as exc:  # a truncated or garbled pickle: the peer's fault
        raise FrameRefused(f"bad payload: {exc!r}") from exc


# ------------------------------------------------------------------ handshake


class Handshake:
    """One side's handshake: send :meth:`hello`, feed the peer's hello to :meth:`on_hello` and
    send what it returns (our proof), feed the peer's proof to :meth:`on_proof` for the
    :class:`Session`. Raises :class:`HandshakeRefused` on any mismatch."""

    def __init__(
        self,
        secret: bytes,
        role: Role,
        nonce: bytes,
        max_payload_bytes: int,
        *,
        about: str = "",
        version: int = VERSION,
    ) -> None:
        """``about``: this node's chronomq version; ``version``: the wire version it
        advertises (another than :data:`VERSION` only in tests of a mixed cluster)."""
        self._secret = secret
        self.role = role
        self._hello = Hello(role, nonce, version, about)
        self._peer: Hello | None = None
        self._max_payload_bytes = max_payload_bytes

    @property
    def peer(self) -> Hello | None:
        """The peer's hello, once received (its about is proved once :meth:`on_proof` passed)."""
        return self._peer

    def hello(self) -> bytes:
        return self._hello.encode()

    def on_hello(self, data: bytes) -> bytes:
        peer = Hello.decode(data)
        if peer.version != self._hello.version:
            raise VersionMismatch(peer.version, peer.about, self._hello.version, self._hello.about)
        if peer.role != self.role.peer:
            raise HandshakeRefused(f"peer says it is the {peer.role.name.lower()} too")
        if hmac.compare_digest(peer.nonce, self._hello.nonce):
            raise HandshakeRefused("peer sent our own nonce back")
        self._peer = peer
        return proof(
            self._secret, self.role, self._hello.nonce, peer.nonce, self._hello.about_bytes
        )

    def on_proof(self, data: bytes) -> Session:
        peer = self._peer
        if peer is None:
            raise HandshakeRefused("proof before hello")
        expected = proof(
            self._secret, self.role.peer, peer.nonce, self._hello.nonce, peer.about_bytes
        )
        if len(data) != PROOF_BYTES or not hmac.compare_digest(data, expected):
            raise HandshakeRefused("proof does not match the cluster secret")
        mine, theirs = self._hello.nonce, peer.nonce
        ni, na = (mine, theirs) if self.role is Role.INITIATOR else (theirs, mine)
        return Session(
            session_key(self._secret, self.role, ni, na),
            session_key(self._secret, self.role.peer, ni, na),
            self._max_payload_bytes,
        )
