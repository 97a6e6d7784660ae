"""An authenticated connection for pysyncobj's TCP transport (the bytes: :mod:`chronomq.raftlog.wireproto`).

:class:`AuthConnection` has the interface pysyncobj's ``TcpConnection`` offers its transport
and server (constructor keywords, ``setOn*Callback``, ``connect``, ``send``, ``fileno``,
``disconnect``, ``getSendBufferSize``, ``state``, and the ``encryptor`` / ``sendRandKey`` /
``recvRandKey`` attributes of pysyncobj's password feature, which we leave unused). It differs
where it matters:

* nothing is unpickled before both sides proved the cluster secret, and then only an
  authenticated frame, with :mod:`chronomq.raftlog.safepickle`;
* an outgoing connection reports "connected" to the transport once the handshake succeeded,
  not when TCP connects, so pysyncobj counts only authenticated peers towards its quorum;
  messages the transport sends earlier are queued and sent after the handshake;
* a refused connection is closed and logged (WARNING, peer address, rate-limited by
  :class:`RefusalLog`); a connection still in the handshake after ``handshake_timeout_s`` is
  closed by :meth:`WireContext.sweep` (called for every accepted connection and every tick),
  and at most ``max_handshakes`` accepted connections may be in the handshake at once
  (:class:`HandshakeGate`);
* buffers are bytearrays consumed from the front (``del buf[:n]``): a large frame arrives in
  linear time, where pysyncobj's ``bytes +=`` copies the whole buffer for every read.

A connection finds its settings through the poller it is built with: each
:class:`chronomq.raftlog.transport.GuardedTransport` registers its :class:`WireContext` for its SyncObj's
poller with :func:`register`, and :func:`connection` (what pysyncobj builds as
``TcpConnection``) refuses a poller without one.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import weakref
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from pysyncobj.poller import POLL_EVENT_TYPE
from pysyncobj.tcp_connection import CONNECTION_STATE, _getAddrType, set_keepalive

from chronomq.raftlog.wireproto import (
    MAGIC,
    NONCE_BYTES,
    PROOF_BYTES,
    FrameRefused,
    Handshake,
    HandshakeRefused,
    Hello,
    Role,
    Session,
    VersionMismatch,
    decode_payload,
    encode_payload,
)
from chronomq.raftlog.wireproto import VERSION as WIRE_VERSION

log = logging.getLogger(__name__)

_READ_CHUNK_BYTES = 256 * 1024
_MAX_PENDING_MESSAGES = 4096  # sent by the transport before the handshake ended


@dataclass(frozen=True, slots=True)
class WireSettings:
    secret: bytes
    max_payload_bytes: int  # a longer frame is refused (and the connection closed)
    compression_level: int = 0  # zlib level for payloads; 0 sends them as they are
    handshake_timeout_s: float = 5.0
    max_handshakes: int = 64  # accepted connections in the handshake at once
    about: str = ""  # this node's chronomq version, sent in its hello
    wire_version: int = WIRE_VERSION  # advertised in the hello; another only in tests


# ------------------------------------------------------------------ refusal log


class RefusalLog:
    """At most ``burst`` WARNING lines per ``window_s``; the refusals beyond are counted and
    their number is logged with the next line, so a flood of connections cannot fill the disk.
    """

    def __init__(self, logger: logging.Logger, burst: int = 20, window_s: float = 60.0) -> None:
        self._log = logger
        self._burst = burst
        self._window_s = window_s
        self._window_start = float("-inf")
        self._logged = 0
        self.suppressed = 0
        self.total = 0

    def refuse(self, peer: str, reason: str, now: float) -> bool:
        """Record a refusal; True if it was logged."""
        self.total += 1
        self._roll(now)
        if self._logged >= self._burst:
            self.suppressed += 1
            return False
        self._logged += 1
        self._log.warning("refused Raft connection %s: %s", peer, reason)
        return True

    def flush(self, now: float) -> None:
        self._roll(now)

    def _roll(self, now: float) -> None:
        if now - self._window_start < self._window_s:
            return
        if self.suppressed:
            self._log.warning(
                "refused %d more Raft connections in the last %.0f s (not logged one by one)",
                self.suppressed,
                now - self._window_start,
            )
        self._window_start = now
        self._logged = 0
        self.suppressed = 0


# ------------------------------------------------------------------ peers' versions


@dataclass(frozen=True, slots=True)
class PeerVersion:
    """What a peer's hello said: its chronomq version and wire version, and whether this
    node can talk to it."""

    version: str  # "" for a build from before the version exchange
    wire_version: int
    compatible: bool

    def as_json(self) -> dict[str, Any]:
        return {
            "version": self.version or None,
            "wire_version": self.wire_version,
            "compatible": self.compatible,
        }


class VersionLog:
    """Peers' versions by Raft address, and the ERROR line for a peer this node cannot talk
    to: once per peer and version pair per ``window_s``, however often it reconnects."""

    def __init__(self, logger: logging.Logger, window_s: float = 60.0) -> None:
        self._log = logger
        self._window_s = window_s
        self._logged: dict[tuple[str, int, str], float] = {}
        self.peers: dict[str, PeerVersion] = {}
        self.mismatches = 0

    def seen(self, address: str | None, hello: Hello) -> None:
        if address is not None:
            self.peers[address] = PeerVersion(hello.about, hello.version, True)

    def mismatch(self, address: str | None, peer: str, exc: VersionMismatch, now: float) -> bool:
        """Record a peer of another wire version; True if the ERROR line was logged now."""
        self.mismatches += 1
        if address is not None:
            self.peers[address] = PeerVersion(exc.peer_about, exc.peer_wire, False)
        key = (address or peer.rsplit(":", 1)[0], exc.peer_wire, exc.peer_about)
        last = self._logged.get(key)
        if last is not None and now - last < self._window_s:
            return False
        if len(self._logged) > 1024:
            self._logged.clear()  # bounded: a flood of odd peers logs again, no more
        self._logged[key] = now
        self._log.error("cannot talk to Raft peer %s: %s", peer, exc)
        return True


# ------------------------------------------------------------------ handshake gate

C = TypeVar("C")


class HandshakeGate(Generic[C]):
    """Connections still in the handshake and their deadlines; a cap on accepted ones."""

    def __init__(self, timeout_s: float, max_accepted: int) -> None:
        self.timeout_s = timeout_s
        self.max_accepted = max_accepted
        self._deadlines: dict[C, float] = {}
        self._accepted: set[C] = set()

    def admit(self, conn: C, now: float) -> bool:
        """An accepted connection starts its handshake; False when too many already are."""
        if len(self._accepted) >= self.max_accepted:
            return False
        self._accepted.add(conn)
        self._deadlines[conn] = now + self.timeout_s
        return True

    def track(self, conn: C, now: float) -> None:
        """An outgoing connection starts (no cap: one per peer)."""
        self._deadlines[conn] = now + self.timeout_s

    def done(self, conn: C) -> None:
        self._deadlines.pop(conn, None)
        self._accepted.discard(conn)

    def expired(self, now: float) -> list[C]:
        return [c for c, deadline in self._deadlines.items() if deadline <= now]

    @property
    def accepted(self) -> int:
        return len(self._accepted)

    def __len__(self) -> int:
        return len(self._deadlines)


class WireContext:
    """What the connections of one SyncObj share."""

    def __init__(self, settings: WireSettings, refusals: RefusalLog | None = None) -> None:
        self.settings = settings
        self.gate: HandshakeGate[AuthConnection] = HandshakeGate(
            settings.handshake_timeout_s, settings.max_handshakes
        )
        self.refusals = refusals if refusals is not None else RefusalLog(log)
        self.versions = VersionLog(log)

    def sweep(self, now: float) -> None:
        """Close the connections whose handshake outlived its deadline."""
        for conn in self.gate.expired(now):
            conn.refuse(f"no handshake within {self.settings.handshake_timeout_s:g} s")
        self.refusals.flush(now)


_CONTEXTS: weakref.WeakKeyDictionary[Any, WireContext] = weakref.WeakKeyDictionary()


def register(poller: Any, context: WireContext) -> None:
    _CONTEXTS[poller] = context


def connection(poller: Any, **kwargs: Any) -> AuthConnection:
    """What pysyncobj's transport and server build as ``TcpConnection``."""
    context = _CONTEXTS.get(poller)
    if context is None:
        raise RuntimeError(
            "a pysyncobj connection on a poller without wire settings "
            "(raftlog.transport.GuardedTransport registers them)"
        )
    return AuthConnection(poller, context=context, **kwargs)


# ------------------------------------------------------------------ the connection


def _peer_name(sock: socket.socket) -> str:
    try:
        peer = sock.getpeername()
    except OSError:
        return "?"
    return f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)


class AuthConnection:
    def __init__(
        self,
        poller: Any,
        onMessageReceived: Any = None,  # noqa: N803 - pysyncobj's keyword names
        onConnected: Any = None,  # noqa: N803
        onDisconnected: Any = None,  # noqa: N803
        socket: socket.socket | None = None,
        timeout: float = 10.0,
        sendBufferSize: int = 2**13,  # noqa: N803
        recvBufferSize: int = 2**13,  # noqa: N803
        keepalive: tuple[int, int, int] | None = None,
        *,
        context: WireContext,
    ) -> None:
        # pysyncobj's password feature sets and reads these; it is not used with this wire.
        self.sendRandKey: Any = None
        self.recvRandKey: Any = None
        self.recvLastTimestamp = 0
        self.encryptor: Any = None
        self._ctx = context
        self._poller = poller
        self._on_message = onMessageReceived
        self._on_connected = onConnected
        self._on_disconnected = onDisconnected
        self._timeout_s = timeout
        self._send_buffer_size = sendBufferSize
        self._recv_buffer_size = recvBufferSize
        self._keepalive = keepalive
        self._sock: Any = None
        self._fileno: int | None = None
        self._mask = 0
        self._state = CONNECTION_STATE.DISCONNECTED
        self._in = bytearray()
        self._out = bytearray()
        self._pending: list[tuple[int, bytes]] = []
        self._handshake: Handshake | None = None
        self._peer_hello_seen = False
        self._session: Session | None = None
        self._last_read = time.monotonic()
        self.peer = "?"
        self.address: str | None = None  # the Raft address connected to (outgoing)
        self.peer_hello: Hello | None = None  # once the handshake passed
        self.outgoing = socket is None
        if socket is None:
            return
        self._sock = socket
        self._fileno = socket.fileno()
        self._state = CONNECTION_STATE.CONNECTED
        self.peer = f"from {_peer_name(socket)}"
        now = time.monotonic()
        context.sweep(now)
        if not context.gate.admit(self, now):
            self.refuse(f"{context.gate.accepted} connections already in the handshake")
            return
        self._set_keepalive()
        self._begin(Role.ACCEPTOR)
        self._subscribe()
        self._flush()

    # ---------------------------------------------------------------- pysyncobj's interface

    @property
    def state(self) -> int:
        return self._state

    @property
    def session(self) -> Session | None:
        return self._session

    def setOnConnectedCallback(self, onConnected: Any) -> None:  # noqa: N802, N803
        self._on_connected = onConnected

    def setOnMessageReceivedCallback(self, onMessageReceived: Any) -> None:  # noqa: N802, N803
        self._on_message = onMessageReceived

    def setOnDisconnectedCallback(self, onDisconnected: Any) -> None:  # noqa: N802, N803
        self._on_disconnected = onDisconnected

    def fileno(self) -> int | None:
        return self._fileno

    def getSendBufferSize(self) -> int:  # noqa: N802
        return len(self._out) + sum(len(p) for _, p in self._pending)

    def connect(self, host: str | None, port: int) -> bool:
        if host is None:
            return False
        self.disconnect()
        sock = socket.socket(_getAddrType(host), socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self._send_buffer_size)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self._recv_buffer_size)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setblocking(False)
        self._sock = sock
        self._set_keepalive()
        self.peer = f"to {host}:{port}"
        self.address = f"{host}:{port}"
        self._last_read = time.monotonic()
        try:
            sock.connect((host, port))
        except BlockingIOError:
            pass
        except OSError:
            sock.close()
            self._sock = None
            return False
        self._fileno = sock.fileno()
        self._state = CONNECTION_STATE.CONNECTING
        self._ctx.gate.track(self, self._last_read)
        self._mask = 0
        self._subscribe(writable=True)
        return True

    def send(self, message: Any) -> None:
        if self._state == CONNECTION_STATE.DISCONNECTED:
            return
        if time.monotonic() - self._last_read > self._timeout_s:
            self.disconnect()
            return
        flags, payload = encode_payload(message, self._ctx.settings.compression_level)
        if self._session is None:
            if len(self._pending) >= _MAX_PENDING_MESSAGES:
                log.error("Raft connection %s: handshake pending too long, dropping", self.peer)
                self.disconnect()
                return
            self._pending.append((flags, payload))
            return
        self._write_frame(flags, payload)
        self._flush()

    def disconnect(self) -> None:
        notify = self._on_disconnected is not None and self._state != (
            CONNECTION_STATE.DISCONNECTED
        )
        self.sendRandKey = None
        self.recvRandKey = None
        self.recvLastTimestamp = 0
        self._ctx.gate.done(self)
        if self._fileno is not None:
            self._poller.unsubscribe(self._fileno)
            self._fileno = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self._mask = 0
        self._in = bytearray()
        self._out = bytearray()
        self._pending = []
        self._handshake = None
        self._peer_hello_seen = False
        self._session = None
        self._state = CONNECTION_STATE.DISCONNECTED
        if notify:
            self._on_disconnected()

    # ---------------------------------------------------------------- ours

    def refuse(self, reason: str) -> None:
        """Close this connection and log why (rate-limited)."""
        self._ctx.refusals.refuse(self.peer, reason, time.monotonic())
        self.disconnect()

    def _set_keepalive(self) -> None:
        if self._sock is not None and self._keepalive is not None:
            set_keepalive(self._sock, *self._keepalive)

    def _begin(self, role: Role) -> None:
        settings = self._ctx.settings
        self._handshake = Handshake(
            settings.secret,
            role,
            os.urandom(NONCE_BYTES),
            settings.max_payload_bytes,
            about=settings.about,
            version=settings.wire_version,
        )
        self._out += self._handshake.hello()

    def _subscribe(self, writable: bool = False) -> None:
        if self._fileno is None:
            return
        mask = POLL_EVENT_TYPE.READ | POLL_EVENT_TYPE.ERROR
        if writable or self._out:
            mask |= POLL_EVENT_TYPE.WRITE
        if mask != self._mask:
            self._poller.subscribe(self._fileno, self._process, mask)
            self._mask = mask

    def _process(self, descr: int, event: int) -> None:
        if descr != self._fileno:
            self._poller.unsubscribe(descr)
            return
        if event & POLL_EVENT_TYPE.ERROR:
            self.disconnect()
            return
        if time.monotonic() - self._last_read > self._timeout_s:
            self.disconnect()
            return
        if self._state == CONNECTION_STATE.CONNECTING and self._handshake is None:
            if self._sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
                self.disconnect()
                return
            self._begin(Role.INITIATOR)  # TCP is up: say hello
        if event & POLL_EVENT_TYPE.READ:
            self._read()
            if self._state == CONNECTION_STATE.DISCONNECTED:
                return
        self._flush()

    def _read(self) -> None:
        budget = max(self._ctx.settings.max_payload_bytes, 8 * _READ_CHUNK_BYTES)
        while budget > 0:
            try:
                chunk = self._sock.recv(max(self._recv_buffer_size, _READ_CHUNK_BYTES))
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                self.disconnect()
                return
            if not chunk:
                if self._session is None:
                    self.refuse("closed by the peer during the handshake")
                else:
                    self.disconnect()
                return
            budget -= len(chunk)
            self._in += chunk
            self._last_read = time.monotonic()
            self._consume()
            if self._state == CONNECTION_STATE.DISCONNECTED:
                return

    def _consume(self) -> None:
        """Hand every whole message in the input buffer to the transport."""
        while self._state != CONNECTION_STATE.DISCONNECTED:
            if self._session is None:
                if not self._advance_handshake():
                    return
                continue
            try:
                got = self._session.open(self._in)
                if got is None:
                    return
                message = decode_payload(*got, self._ctx.settings.max_payload_bytes)
            except FrameRefused as exc:
                self.refuse(str(exc))
                return
            if self._on_message is not None:
                self._on_message(message)

    def _advance_handshake(self) -> bool:
        """Take the peer's hello, then its proof, from the input; True once established."""
        handshake = self._handshake
        if handshake is None:  # bytes before our TCP connect was reported
            return False
        try:
            if not self._peer_hello_seen:
                head = bytes(self._in[: len(MAGIC)])
                if head != MAGIC[: len(head)]:
                    raise HandshakeRefused(f"not a chronomq Raft hello (starts {head!r})")
                size = Hello.length(self._in)
                if size is None or len(self._in) < size:
                    return False
                own_proof = handshake.on_hello(bytes(self._in[:size]))
                del self._in[:size]
                self._peer_hello_seen = True
                self._out += own_proof
                # Out before the peer's proof is judged: a peer we refuse learns why as well.
                self._flush()
                if self._state == CONNECTION_STATE.DISCONNECTED:
                    return False
            if len(self._in) < PROOF_BYTES:
                return False
            session = handshake.on_proof(bytes(self._in[:PROOF_BYTES]))
            del self._in[:PROOF_BYTES]
        except VersionMismatch as exc:
            # Not an intruder: a member of another version. Said at ERROR, with both.
            self._ctx.versions.mismatch(self.address, self.peer, exc, time.monotonic())
            self._flush()  # our hello, if still unsent: the peer can say it too
            self.disconnect()
            return False
        except HandshakeRefused as exc:
            self.refuse(str(exc))
            return False
        self._session = session
        self.peer_hello = handshake.peer
        if handshake.peer is not None:
            self._ctx.versions.seen(self.address, handshake.peer)
        self._handshake = None
        self._ctx.gate.done(self)
        pending, self._pending = self._pending, []
        for flags, payload in pending:
            self._write_frame(flags, payload)
        if self._state == CONNECTION_STATE.CONNECTING:
            self._state = CONNECTION_STATE.CONNECTED
            if self._on_connected is not None:
                self._on_connected()
        return self._state != CONNECTION_STATE.DISCONNECTED

    def _write_frame(self, flags: int, payload: bytes) -> None:
        assert self._session is not None
        try:
            header = self._session.seal(payload, flags)
        except ValueError as exc:  # our own message: the limit is too low for the config
            log.error("Raft connection %s: %s; closing it", self.peer, exc)
            self.disconnect()
            return
        self._out += header
        self._out += payload

    def _flush(self) -> None:
        while self._out and self._sock is not None:
            try:
                sent = self._sock.send(self._out)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                self.disconnect()
                return
            if sent <= 0:
                break
            del self._out[:sent]
        self._subscribe()
