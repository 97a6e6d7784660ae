"""The catch-up side channel: serve and fetch CommitLog byte ranges between nodes.

Snapshots are thin (see :mod:`chronomq.raftlog.store`), so a node that restores one may lack CommitLog
bytes it references. It fetches them here, over TCP on the Raft port + 1000, with ``sendfile``
on the serving side so Python never touches the bytes. The messages, the mutual HMAC
authentication and why it is built so are in :mod:`chronomq.raftlog.catchup_proto`.

The port is reachable by anyone, so every connection is bounded:

* **Handshake**: a connection must complete its handshake (hello, request with a valid MAC)
  within ``handshake_s`` (3 s) of being accepted, or it is closed.
* **Transfer**: once authenticated, every read and write must progress within ``idle_s``
  (10 s), and the whole answer must be sent within ``total_floor_s + count /
  min_rate_bytes_per_s`` (10 s + 1 s per MiB): a peer that reads a byte now and then is cut off.
* **Slots**: handshakes and transfers have separate budgets, so a flood of unauthenticated
  connections cannot take the slots that restores need. ``transfer_slots`` (8) authenticated
  transfers run at a time; an authenticated request that finds none free is answered BUSY and
  its client asks another peer. ``handshake_slots`` (32) connections may be in their handshake
  at a time; when one more arrives, the *oldest* is dropped. An attacker holding every
  handshake slot must therefore open connections faster than a peer completes its handshake (a
  round trip), and each one lives at most ``handshake_s`` anyway; dropping the newest instead
  would let a few slow connections, re-opened every 3 s, lock peers out for good.

Every refused connection (bad bytes, a MAC that does not verify, a handshake too slow or
dropped) is logged at WARNING with the peer's address, at most once per ``_REFUSAL_LOG_S`` per
host with a count of those not logged.

On the fetching side (:func:`fetch_range`) a node asks every other peer in turn, checks what
it is sent against the snapshot's hash chain (a peer whose bytes fail is a failed peer, its
bytes are thrown away and it is asked last), then tries them all again after an exponential
back-off with jitter, until its deadline. Giving up is one ERROR line naming the range, the
peers tried and what each answered.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import secrets
import select
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from chronomq.raftlog import catchup_proto as proto
from chronomq.raftlog.commitlog import CommitLog

log = logging.getLogger(__name__)

Address = tuple[str, int]

_REFUSAL_LOG_S = 10.0
_REFUSAL_HOSTS = 1024
_CHUNK_BYTES = 4 << 20


@dataclass(frozen=True, slots=True)
class Limits:
    """Time and slot bounds of the catch-up channel, on both ends."""

    handshake_s: float = 3.0
    idle_s: float = 10.0
    total_floor_s: float = 10.0
    min_rate_bytes_per_s: int = 1 << 20
    handshake_slots: int = 32
    transfer_slots: int = 8

    def transfer_s(self, count: int) -> float:
        """How long an answer of ``count`` bytes may take."""
        return self.total_floor_s + count / self.min_rate_bytes_per_s


DEFAULT_LIMITS = Limits()


# ---------------------------------------------------------------------- socket helpers


def _recv_exact(sock: socket.socket, n: int, deadline: float, idle_s: float) -> bytes:
    """``n`` bytes, each read within ``idle_s`` and all before ``deadline`` (monotonic)."""
    chunks = []
    while n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("deadline passed")
        sock.settimeout(min(idle_s, left))
        chunk = sock.recv(min(n, _CHUNK_BYTES))
        if not chunk:
            raise ConnectionError("peer closed the connection")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def _send_all(sock: socket.socket, data: bytes, deadline: float, idle_s: float) -> None:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("deadline passed")
    sock.settimeout(min(idle_s, left))
    sock.sendall(data)


def _wait_writable(sock: socket.socket, deadline: float, idle_s: float) -> None:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("transfer deadline passed")
    poller = select.poll()  # not select.select: fds may be above FD_SETSIZE
    poller.register(sock, select.POLLOUT)
    if not poller.poll(min(idle_s, left) * 1000):
        raise TimeoutError("peer stopped reading")


class _RefusalLog:
    """Rate-limited WARNINGs for refused connections: one per host per ``interval_s``."""

    def __init__(self, interval_s: float = _REFUSAL_LOG_S, max_hosts: int = _REFUSAL_HOSTS):
        self._interval_s = interval_s
        self._max_hosts = max_hosts
        self._hosts: OrderedDict[str, tuple[float, int]] = OrderedDict()  # last logged, muted
        self._lock = threading.Lock()

    def note(self, host: str, now: float) -> int | None:
        """How many refusals of ``host`` went unlogged before this one, if this one is to
        be logged; None to stay quiet."""
        with self._lock:
            last, muted = self._hosts.get(host, (float("-inf"), 0))
            if now - last < self._interval_s:
                self._hosts[host] = (last, muted + 1)
                return None
            self._hosts[host] = (now, 0)
            self._hosts.move_to_end(host)
            while len(self._hosts) > self._max_hosts:
                self._hosts.popitem(last=False)
            return muted


# ---------------------------------------------------------------------- server


class ListenError(OSError):
    """The catch-up listener could not bind its address (another process has it)."""


class CatchupServer:
    """Serves ``[start, end)`` of the local CommitLog, up to what has been applied, to peers
    that prove the cluster secret."""

    def __init__(
        self,
        host: str,
        port: int,
        commitlog: CommitLog,
        available: Callable[[], int],
        *,
        secret: bytes,
        limits: Limits = DEFAULT_LIMITS,
    ) -> None:
        self._commitlog = commitlog
        self._available = available
        self._key = proto.derive_key(secret)
        self.limits = limits
        try:
            self._sock = socket.create_server((host, port), reuse_port=False)
        except OSError as exc:
            raise ListenError(f"cannot listen for catch-up on {host}:{port}: {exc}") from None
        self._sock.settimeout(0.5)
        self._stopped = threading.Event()
        self._transfers = threading.BoundedSemaphore(limits.transfer_slots)
        self._lock = threading.Lock()
        self._handshaking: OrderedDict[int, socket.socket] = OrderedDict()
        self._evicted: set[int] = set()  # handshakes dropped to make room
        self._ids = 0
        self._transferring = 0
        self._refusals = _RefusalLog()
        self._thread = threading.Thread(target=self._serve, name="catchup-server", daemon=True)
        self.address: Address = self._sock.getsockname()[:2]
        #: Counters, for tests and metrics.
        self.served = 0
        self.refused = 0

    def start(self) -> None:
        self._thread.start()

    @property
    def handshaking(self) -> int:
        """Connections in their handshake now."""
        with self._lock:
            return len(self._handshaking)

    @property
    def transferring(self) -> int:
        """Authenticated transfers running now."""
        with self._lock:
            return self._transferring

    def _serve(self) -> None:
        while not self._stopped.is_set():
            try:
                conn, peer = self._sock.accept()
            except TimeoutError:
                continue
            except OSError as exc:
                if self._stopped.is_set():
                    return
                # Out of file descriptors under a flood, say: keep serving once there is room.
                log.warning("accepting a catch-up connection failed: %s", exc)
                self._stopped.wait(0.1)
                continue
            with self._lock:
                self._ids += 1
                conn_id = self._ids
                self._handshaking[conn_id] = conn
                while len(self._handshaking) > self.limits.handshake_slots:
                    # The oldest handshake makes room: see the module's docstring.
                    oldest_id, oldest = self._handshaking.popitem(last=False)
                    self._evicted.add(oldest_id)
                    with contextlib.suppress(OSError):
                        oldest.shutdown(socket.SHUT_RDWR)
            threading.Thread(
                target=self._handle, args=(conn, peer, conn_id), name="catchup-conn", daemon=True
            ).start()

    def _refuse(self, conn: socket.socket, peer: Address, why: str, conn_id: int) -> None:
        """Count and answer a refused handshake. It leaves the handshaking set in the same
        step as it is counted, so that no one sees it refused and still handshaking."""
        muted = self._refusals.note(peer[0], time.monotonic())
        if muted is not None:
            more = f" ({muted} more refused since last logged)" if muted else ""
            log.warning("refused catch-up connection from %s:%s: %s%s", peer[0], peer[1], why, more)
        with self._lock:
            self._handshaking.pop(conn_id, None)
            self.refused += 1
        with contextlib.suppress(OSError):
            conn.settimeout(0.1)
            conn.send(proto.DENIED)

    def _handshake(
        self, conn: socket.socket, peer: Address, conn_id: int
    ) -> tuple[proto.Session, proto.FetchRequest] | None:
        lim = self.limits
        deadline = time.monotonic() + lim.handshake_s
        try:
            client_nonce = proto.decode_hello(
                _recv_exact(conn, proto.HELLO_SIZE, deadline, lim.handshake_s)
            )
            session = proto.Session(self._key, client_nonce, secrets.token_bytes(16))
            _send_all(conn, proto.encode_challenge(session.server_nonce), deadline, lim.idle_s)
            request = session.decode_request(
                _recv_exact(conn, proto.REQUEST_SIZE, deadline, lim.handshake_s)
            )
        except proto.CatchupError as exc:
            self._refuse(conn, peer, str(exc), conn_id)
            return None
        except (OSError, ConnectionError) as exc:
            with self._lock:
                evicted = conn_id in self._evicted
            if evicted:
                why = "dropped in its handshake: every handshake slot was taken"
            elif isinstance(exc, TimeoutError):
                why = f"no valid request within {lim.handshake_s} s"
            else:
                why = f"no valid request: {exc}"
            self._refuse(conn, peer, why, conn_id)
            return None
        return session, request

    def _handle(self, conn: socket.socket, peer: Address, conn_id: int) -> None:
        try:
            done = self._handshake(conn, peer, conn_id)
            with self._lock:
                still_waiting = self._handshaking.pop(conn_id, None) is not None
            if done is None or not still_waiting:
                return
            session, request = done
            if not self._transfers.acquire(blocking=False):
                self._answer(conn, session, request, proto.Answer(proto.Status.BUSY, 0))
                return
            with self._lock:
                self._transferring += 1
            try:
                self._transfer(conn, peer, session, request)
            finally:
                with self._lock:
                    self._transferring -= 1
                self._transfers.release()
        except (OSError, ConnectionError) as exc:
            log.warning("catch-up transfer to %s:%s failed: %s", peer[0], peer[1], exc)
        finally:
            with self._lock:
                self._handshaking.pop(conn_id, None)
                self._evicted.discard(conn_id)
            conn.close()

    def _answer(
        self,
        conn: socket.socket,
        session: proto.Session,
        request: proto.FetchRequest,
        answer: proto.Answer,
    ) -> float:
        """Send the answer's header; returns the deadline of the whole answer."""
        deadline = time.monotonic() + self.limits.transfer_s(answer.count)
        _send_all(conn, session.encode_response(request, answer), deadline, self.limits.idle_s)
        return deadline

    def _transfer(
        self,
        conn: socket.socket,
        peer: Address,
        session: proto.Session,
        request: proto.FetchRequest,
    ) -> None:
        start, end = request.start, request.end
        if end < start:
            self._answer(conn, session, request, proto.Answer(proto.Status.BAD_RANGE, 0))
            return
        if start < self._commitlog.min_offset:
            # Retention deleted the start of the range: say so instead of sending nothing.
            held = self._commitlog.min_offset
            self._answer(conn, session, request, proto.Answer(proto.Status.GONE, held))
            log.warning(
                "%s:%s asked for CommitLog [%d, %d), deleted below %d by retention",
                peer[0],
                peer[1],
                start,
                end,
                held,
            )
            return
        stop = max(start, min(end, self._available()))
        deadline = self._answer(conn, session, request, proto.Answer(proto.Status.OK, stop - start))
        conn.settimeout(self.limits.idle_s)
        for fd, off, n in self._commitlog.ranges(start, stop):
            while n:
                if time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"transfer of [{start}, {stop}) not done within its deadline"
                    )
                try:
                    sent = os.sendfile(conn.fileno(), fd, off, n)
                except BlockingIOError:
                    # A socket with a timeout is non-blocking underneath: wait for room.
                    _wait_writable(conn, deadline, self.limits.idle_s)
                    continue
                if sent == 0:
                    raise ConnectionError("peer stopped reading")
                off += sent
                n -= sent
        with self._lock:
            self.served += 1
        log.info("served CommitLog [%d, %d) to %s:%s", start, stop, peer[0], peer[1])

    def close(self) -> None:
        self._stopped.set()
        self._sock.close()
        self._thread.join(timeout=2)


# ---------------------------------------------------------------------- client


def fetch_from(
    address: Address,
    start: int,
    end: int,
    write: Callable[[int, bytes], None],
    *,
    secret: bytes,
    limits: Limits = DEFAULT_LIMITS,
) -> int:
    """Fetch ``[start, end)`` from one peer, handing chunks to ``write(at, data)``.

    Returns how many bytes were written (the peer may have fewer than asked). Raises
    :class:`chronomq.raftlog.catchup_proto.CatchupError` (refused, busy, not a peer) or ``OSError``.
    """
    key = proto.derive_key(secret)
    request = proto.FetchRequest(start, end)
    deadline = time.monotonic() + limits.handshake_s
    with socket.create_connection(address, timeout=limits.handshake_s) as sock:
        client_nonce = secrets.token_bytes(proto.NONCE_BYTES)
        _send_all(sock, proto.encode_hello(client_nonce), deadline, limits.idle_s)
        server_nonce = proto.decode_challenge(
            _recv_maybe_denied(sock, proto.CHALLENGE_SIZE, deadline, limits)
        )
        session = proto.Session(key, client_nonce, server_nonce)
        _send_all(sock, session.encode_request(request), deadline, limits.idle_s)
        answer = session.decode_response(
            _recv_maybe_denied(sock, proto.RESPONSE_SIZE, deadline, limits), request
        )
        if answer.status is proto.Status.BUSY:
            raise proto.Busy(f"{address[0]}:{address[1]} has no transfer slot free")
        if answer.status is proto.Status.GONE:
            raise proto.Gone(
                f"{address[0]}:{address[1]} deleted its CommitLog below {answer.count} "
                f"(retention, file_reserved_time_h), and this node needs it from {start}: "
                "it cannot catch up by fetching; stop it and copy a stopped peer's data "
                "directory over its own"
            )
        if answer.status is not proto.Status.OK:
            raise proto.ProtocolError(f"{address[0]}:{address[1]} answered {answer.status.name}")
        deadline = time.monotonic() + limits.transfer_s(answer.count)
        at = start
        left = answer.count
        while left:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"transfer not done in time after {at - start} bytes")
            sock.settimeout(min(limits.idle_s, remaining))
            chunk = sock.recv(min(left, _CHUNK_BYTES))
            if not chunk:
                raise ConnectionError(
                    f"closed the connection after {at - start} of {answer.count} bytes"
                )
            write(at, chunk)
            at += len(chunk)
            left -= len(chunk)
        return answer.count


def _recv_maybe_denied(sock: socket.socket, n: int, deadline: float, limits: Limits) -> bytes:
    head = _recv_exact(sock, proto.DENIED_SIZE, deadline, limits.handshake_s)
    if head == proto.DENIED:
        raise proto.Refused("refused us: it does not accept our MAC (wrong cluster secret?)")
    return head + _recv_exact(sock, n - len(head), deadline, limits.handshake_s)


def fetch_bytes(
    address: Address, start: int, end: int, *, secret: bytes, limits: Limits = DEFAULT_LIMITS
) -> bytes:
    """``[start, end)`` of one peer's CommitLog, or the part of it the peer has."""
    chunks: list[bytes] = []
    fetch_from(
        address, start, end, lambda _at, data: chunks.append(data), secret=secret, limits=limits
    )
    return b"".join(chunks)


class Target(Protocol):
    """Where fetched bytes go (:class:`chronomq.raftlog.snapshot.FetchTarget`)."""

    @property
    def start(self) -> int: ...

    @property
    def end(self) -> int: ...

    @property
    def position(self) -> int: ...

    def write(self, data: bytes) -> None: ...

    def verdict(self) -> str | None: ...

    def rewind(self) -> None: ...


class FetchFailed(TimeoutError):
    """No peer could serve a range before the deadline."""


class Backoff:
    """Exponential back-off with jitter: each delay is drawn from [d/2, d), d doubling from
    ``initial_s`` up to ``max_s``."""

    def __init__(
        self,
        initial_s: float = 0.2,
        max_s: float = 5.0,
        rng: Callable[[], float] = random.random,
    ) -> None:
        self._initial_s = initial_s
        self._max_s = max_s
        self._next_s = initial_s
        self._rng = rng

    def next_delay(self) -> float:
        d = self._next_s
        self._next_s = min(self._max_s, d * 2)
        return d * (0.5 + 0.5 * self._rng())

    def reset(self) -> None:
        self._next_s = self._initial_s


def _name(address: Address) -> str:
    return f"{address[0]}:{address[1]}"


def fetch_range(
    peers: Callable[[], Sequence[Address]],
    target: Target,
    *,
    secret: bytes,
    deadline_s: float = 300.0,
    limits: Limits = DEFAULT_LIMITS,
    backoff: Backoff | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> None:
    """Fill ``target`` (``[target.start, target.end)``) from the peers, checked against the
    hash chain; raise :class:`FetchFailed` when the deadline passes first.

    Each round asks every peer in turn (peers whose bytes failed the chain last) for what is
    still missing; a peer that has only part of it gives that part and the next the rest. At
    the end of the range the target checks the chain: bytes that fail are thrown away and
    every peer that gave some is suspect. Between rounds the fetcher backs off.
    """
    backoff = backoff or Backoff()
    t0 = clock()
    give_up = t0 + deadline_s
    errors: dict[str, str] = {}
    suspects: set[Address] = set()
    rounds = 0
    while target.position < target.end:
        rounds += 1
        listed = list(peers())
        order = [a for a in listed if a not in suspects] + [a for a in listed if a in suspects]
        contributors: set[Address] = set()
        progressed = False
        gone = 0
        for address in order:
            at = target.position
            try:
                got = fetch_from(
                    address,
                    at,
                    target.end,
                    lambda _at, data: target.write(data),
                    secret=secret,
                    limits=limits,
                )
                if got < target.end - at:
                    errors[_name(address)] = f"has only [{at}, {at + got})"
            except (OSError, ConnectionError) as exc:
                gone += isinstance(exc, proto.Gone)
                errors[_name(address)] = f"{type(exc).__name__}: {exc}"
                log.warning(
                    "catch-up from %s failed at %d: %s", _name(address), target.position, exc
                )
            if target.position > at:
                contributors.add(address)
                progressed = True
            if target.position < target.end:
                continue
            failed = target.verdict()
            if failed is None:
                break
            names = ", ".join(sorted(_name(a) for a in contributors))
            log.warning("CommitLog bytes from %s rejected: %s", names, failed)
            for a in contributors:
                errors[_name(a)] = failed
            suspects |= contributors
            contributors = set()
            target.rewind()
        if target.position >= target.end:
            break
        if listed and gone == len(listed):
            message = (
                f"no peer holds CommitLog [{target.position}, {target.end}) any more: "
                + "; ".join(errors.values())
            )
            log.critical("%s", message)
            raise FetchFailed(message)
        now = clock()
        if now >= give_up:
            tried = "; ".join(f"{a}: {e}" for a, e in errors.items()) or "no peer known"
            message = (
                f"giving up fetching CommitLog [{target.position}, {target.end}) after "
                f"{now - t0:.1f} s and {rounds} rounds; peers tried: {tried}"
            )
            log.error("%s", message)
            raise FetchFailed(message)
        if progressed:
            backoff.reset()
        sleep(min(backoff.next_delay(), give_up - now))
    log.info(
        "fetched CommitLog [%d, %d) (%.1f MB) in %.2f s",
        target.start,
        target.end,
        (target.end - target.start) / 1e6,
        clock() - t0,
    )
