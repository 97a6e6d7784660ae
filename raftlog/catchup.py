"""The catch-up side channel: serve and fetch CommitLog byte ranges between nodes.

Snapshots are thin (see :mod:`raftlog.store`), so a node that restores one may lack CommitLog
bytes it references. It fetches them here, over a plain TCP connection, with ``sendfile`` on
the serving side so Python never touches the bytes::

    request  : magic "CMQFETCH" (8) | start (u64) | end (u64)
    response : magic "CMQBYTES" (8) | count (u64) | count bytes of the CommitLog from start

``count`` is what the server has of ``[start, end)``; it may be less than asked (a peer that is
itself behind) and the client then asks another peer for the rest.
"""

from __future__ import annotations

import logging
import os
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence

from raftlog.commitlog import CommitLog

log = logging.getLogger(__name__)

_REQUEST = struct.Struct(">8sQQ")
_RESPONSE = struct.Struct(">8sQ")
_REQ_MAGIC = b"CMQFETCH"
_RESP_MAGIC = b"CMQBYTES"
_MAX_CONNECTIONS = 8
_IO_TIMEOUT_S = 30.0


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks = []
    while n:
        chunk = sock.recv(min(n, 1 << 20))
        if not chunk:
            raise ConnectionError("peer closed the connection")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def _wait_writable(sock: socket.socket) -> None:
    poller = select.poll()  # not select.select: fds may be above FD_SETSIZE
    poller.register(sock, select.POLLOUT)
    if not poller.poll(_IO_TIMEOUT_S * 1000):
        raise TimeoutError("peer stopped reading")


class CatchupServer:
    """Serves ``[start, end)`` of the local CommitLog, up to what has been applied."""

    def __init__(
        self, host: str, port: int, commitlog: CommitLog, available: Callable[[], int]
    ) -> None:
        self._commitlog = commitlog
        self._available = available
        self._sock = socket.create_server((host, port), reuse_port=False)
        self._sock.settimeout(0.5)
        self._stopped = threading.Event()
        self._slots = threading.BoundedSemaphore(_MAX_CONNECTIONS)
        self._thread = threading.Thread(target=self._serve, name="catchup-server", daemon=True)
        self.address = self._sock.getsockname()

    def start(self) -> None:
        self._thread.start()

    def _serve(self) -> None:
        while not self._stopped.is_set():
            try:
                conn, peer = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._stopped.is_set():
                    return
                raise
            if not self._slots.acquire(blocking=False):
                conn.close()
                continue
            threading.Thread(
                target=self._handle, args=(conn, peer), name="catchup-conn", daemon=True
            ).start()

    def _handle(self, conn: socket.socket, peer: object) -> None:
        try:
            conn.settimeout(_IO_TIMEOUT_S)
            magic, start, end = _REQUEST.unpack(_recv_exact(conn, _REQUEST.size))
            if magic != _REQ_MAGIC or end < start:
                log.warning("bad catch-up request from %s", peer)
                return
            have = self._available()
            stop = max(start, min(end, have))
            conn.sendall(_RESPONSE.pack(_RESP_MAGIC, stop - start))
            for fd, off, n in self._commitlog.ranges(start, stop):
                while n:
                    try:
                        sent = os.sendfile(conn.fileno(), fd, off, n)
                    except BlockingIOError:
                        # A socket with a timeout is non-blocking underneath: wait for room.
                        _wait_writable(conn)
                        continue
                    if sent == 0:
                        raise ConnectionError("peer stopped reading")
                    off += sent
                    n -= sent
            log.info("served CommitLog [%d, %d) to %s", start, stop, peer)
        except (OSError, ConnectionError, struct.error) as exc:
            log.warning("catch-up transfer to %s failed: %s", peer, exc)
        finally:
            conn.close()
            self._slots.release()

    def close(self) -> None:
        self._stopped.set()
        self._sock.close()
        self._thread.join(timeout=2)


def fetch_from(
    address: tuple[str, int], start: int, end: int, write: Callable[[int, bytes], None]
) -> int:
    """Fetch ``[start, end)`` from one peer, handing chunks to ``write(at, data)``.

    Returns how many bytes were written (the peer may have fewer than asked).
    """
    with socket.create_connection(address, timeout=_IO_TIMEOUT_S) as sock:
        sock.sendall(_REQUEST.pack(_REQ_MAGIC, start, end))
        magic, count = _RESPONSE.unpack(_recv_exact(sock, _RESPONSE.size))
        if magic != _RESP_MAGIC or count > end - start:
            raise ConnectionError(f"bad catch-up response from {address}")
        at = start
        left = count
        while left:
            chunk = sock.recv(min(left, 4 << 20))
            if not chunk:
                raise ConnectionError(
                    f"{address} closed the connection after {at - start} of {count} bytes"
                )
            write(at, chunk)
            at += len(chunk)
            left -= len(chunk)
        return count


def fetch_bytes(address: tuple[str, int], start: int, end: int) -> bytes:
    """``[start, end)`` of one peer's CommitLog, or the part of it the peer has."""
    chunks: list[bytes] = []
    fetch_from(address, start, end, lambda _at, data: chunks.append(data))
    return b"".join(chunks)


def fetch_range(
    peers: Callable[[], Sequence[tuple[str, int]]],
    start: int,
    end: int,
    write: Callable[[int, bytes], None],
    position: Callable[[], int],
    deadline_s: float = 300.0,
) -> None:
    """Fetch ``[start, end)`` from whichever peers have it, until done or the deadline passes."""
    give_up = time.monotonic() + deadline_s
    delay = 0.1
    t0 = time.monotonic()
    while position() < end:
        progressed = False
        for address in peers():
            at = position()
            if at >= end:
                break
            try:
                got = fetch_from(address, at, end, write)
                progressed = progressed or got > 0
            except (OSError, ConnectionError) as exc:
                log.warning("catch-up from %s failed at %d: %s", address, position(), exc)
        if position() >= end:
            break
        if time.monotonic() > give_up:
            raise TimeoutError(f"could not fetch CommitLog [{position()}, {end}) from any peer")
        if not progressed:
            time.sleep(delay)
            delay = min(delay * 2, 2.0)
    took = time.monotonic() - t0
    log.info(
        "fetched CommitLog [%d, %d) (%.1f MB) in %.2f s", start, end, (end - start) / 1e6, took
    )
