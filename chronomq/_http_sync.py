"""The synchronous transport: http.client connections kept alive, no event loop.

Why http.client and not urllib3 or aiohttp on a thread: it is in the standard library (a web
app that installs chronomq for its client gets no HTTP stack it did not ask for), it works
under gevent's monkey-patching as well as under threads, and the client needs little from it:
JSON requests to a handful of nodes. The pool keeps idle connections per node (a few per
node, so threads do not queue behind each other) and retries once on a fresh connection when
a kept-alive one turns out to be closed by the node.
"""

from __future__ import annotations

import contextlib
import http.client
import socket
import ssl
import threading
import time
from typing import Any
from urllib.parse import urlsplit

from chronomq._api import Req
from chronomq._policy import Outgoing, RequestPolicy, client_ssl_context
from chronomq._wire import Done, Wait
from chronomq.errors import UnavailableError

MAX_IDLE_PER_NODE = 8
_STALE = (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError)


class ConnectionPool:
    """Idle keep-alive connections per node URL, at most :data:`MAX_IDLE_PER_NODE` each."""

    def __init__(self, ssl_context: ssl.SSLContext | None) -> None:
        self._ssl = ssl_context
        self._idle: dict[str, list[http.client.HTTPConnection]] = {}
        self._busy: set[http.client.HTTPConnection] = set()
        self._lock = threading.Lock()
        self._closed = False

    def _new(self, base: str, timeout_s: float) -> http.client.HTTPConnection:
        u = urlsplit(base)
        host = u.hostname or "localhost"
        if u.scheme == "https":
            return http.client.HTTPSConnection(
                host, u.port, timeout=timeout_s, context=self._ssl or client_ssl_context(None)
            )
        return http.client.HTTPConnection(host, u.port, timeout=timeout_s)

    def _take(self, base: str) -> http.client.HTTPConnection | None:
        with self._lock:
            if self._closed:
                raise ConnectionAbortedError("the client is closed")
            idle = self._idle.get(base)
            return idle.pop() if idle else None

    def _give_back(self, base: str, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            self._busy.discard(conn)
            idle = self._idle.setdefault(base, [])
            if not self._closed and len(idle) < MAX_IDLE_PER_NODE:
                idle.append(conn)
                return
        conn.close()

    def request(self, base: str, out: Outgoing) -> tuple[int, http.client.HTTPMessage, bytes]:
        prefix = urlsplit(base).path
        timeout_s = out.timeout_s
        conn = self._take(base)
        reused = conn is not None
        while True:
            if conn is None:
                if self._closed:
                    raise ConnectionAbortedError("the client is closed")
                conn = self._new(base, timeout_s)
            else:
                conn.timeout = timeout_s
                if conn.sock is not None:
                    conn.sock.settimeout(timeout_s)
            with self._lock:
                self._busy.add(conn)
            try:
                conn.request(
                    out.method, prefix + out.target, body=out.body, headers=dict(out.headers)
                )
                r = conn.getresponse()
                raw = r.read()
            except _STALE:
                self._drop(conn)
                if not reused:
                    raise
                conn, reused = None, False  # the node closed an idle connection: once more
                continue
            except BaseException:
                self._drop(conn)
                raise
            if r.will_close:
                self._drop(conn)
            else:
                self._give_back(base, conn)
            return r.status, r.headers, raw

    def _drop(self, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            self._busy.discard(conn)
        conn.close()

    def close(self) -> None:
        """Close idle connections and cut those in use (a long-poll ends at once)."""
        with self._lock:
            self._closed = True
            conns = [c for idle in self._idle.values() for c in idle]
            self._idle.clear()
            busy = list(self._busy)
        for c in conns:
            c.close()
        for c in busy:
            sock = c.sock
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)


class SyncTransport:
    """JSON requests to the cluster with failover and retries (see
    :class:`chronomq._policy.RequestPolicy`); this class only sends and sleeps."""

    def __init__(self, policy: RequestPolicy) -> None:
        self.policy = policy
        self._pool = ConnectionPool(policy.ssl_context())
        self._closed = False

    def call(self, req: Req, deadline_s: float | None = None) -> Any:
        """Send until answered or the deadline passes; the decoded JSON answer."""
        out = self.policy.prepare(req)
        attempts = self.policy.attempts(req, time.monotonic(), deadline_s)
        while True:
            base = attempts.target()
            try:
                status, answer_headers, raw = self._pool.request(base, out)
            except (OSError, http.client.HTTPException) as exc:
                if self._closed:
                    raise UnavailableError("the client is closed") from exc
                step: Done | Wait = attempts.failed(base, exc, time.monotonic())
            else:
                step = attempts.answered(base, status, answer_headers.get, raw, time.monotonic())
            if isinstance(step, Done):
                return step.body
            time.sleep(step.sleep_s)

    def close(self) -> None:
        self._closed = True
        self._pool.close()
