"""Bounds on the HTTP server's connections: a cap, a header deadline, a body deadline.

aiohttp bounds the request line (``max_line_size``), each header (``max_field_size``), their
count (``max_headers``) and an idle keep-alive connection (``keepalive_timeout``, also armed
when a connection opens), but a client that trickles header bytes, or opens thousands of
connections and sends nothing, costs the node a socket each for as long as it likes. Here:

- :class:`ConnectionGuard` wraps the protocol factory of the listening socket
  (:class:`GuardedSite`). It counts open connections; a connection must bring the complete
  headers of its first request within ``http_header_timeout_ms`` or is closed; at
  ``max_http_connections`` a new connection displaces the oldest one still waiting for its
  first request, or, when every open connection is inside a request, is answered 503 and
  closed. Nothing past the cap reaches aiohttp.
- A connection's first request has arrived once its headers' blank line is read (also
  :meth:`ConnectionGuard.arrival`, for a request aiohttp parsed another way);
  :meth:`ConnectionGuard.body` reads the body within ``http_body_timeout_ms`` (408 and close
  otherwise).
- :meth:`ConnectionGuard.gone` is a future that resolves when the connection carrying a
  request is lost, so a long-poll ends as soon as its client goes away.

Later requests on a kept-alive connection are bounded by aiohttp's ``keepalive_timeout``
(``http_keepalive_timeout_ms``): an idle connection, or one whose next headers are not
complete in time, is closed.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import errno
import logging
import socket
import ssl
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from chronomq.cluster.node.errors import ApiError

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

#: aiohttp's request-line, header-field and header-count limits, pinned (and documented) here.
MAX_LINE_BYTES = 8190
MAX_FIELD_BYTES = 8190
MAX_HEADERS = 128
#: Connections accepted per readiness event of the listening socket.
ACCEPT_BATCH = 64
#: Out of descriptors, the listener pauses this long, doubling up to the maximum.
ACCEPT_BACKOFF_MIN_S = 0.01
ACCEPT_BACKOFF_MAX_S = 1.0
#: At most one warning about failed accepts per this interval.
ACCEPT_LOG_INTERVAL_S = 10.0
_OUT_OF_RESOURCES = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)

_REFUSAL = (
    b"HTTP/1.1 503 Service Unavailable\r\n"
    b"Content-Type: application/json\r\n"
    b"Retry-After: 1\r\n"
    b"Connection: close\r\n"
    b"Content-Length: %d\r\n\r\n%s"
)
_REFUSAL_BODY = (
    b'{"error":"too_many_connections","message":"this node serves max_http_connections '
    b'connections already; retry shortly","field":null}\n'
)


@dataclass(frozen=True, slots=True)
class HttpLimits:
    max_connections: int
    header_timeout_s: float
    body_timeout_s: float
    keepalive_timeout_s: float

    @classmethod
    def from_config(cls, config: Any) -> HttpLimits:
        return cls(
            max_connections=config.max_http_connections,
            header_timeout_s=config.http_header_timeout_ms / 1000,
            body_timeout_s=config.http_body_timeout_ms / 1000,
            keepalive_timeout_s=config.http_keepalive_timeout_ms / 1000,
        )

    def handler_args(self) -> dict[str, Any]:
        """aiohttp's own per-connection limits (``web.Application(handler_args=...)``)."""
        return {
            "keepalive_timeout": self.keepalive_timeout_s,
            "max_line_size": MAX_LINE_BYTES,
            "max_field_size": MAX_FIELD_BYTES,
            "max_headers": MAX_HEADERS,
        }


class _Connection(asyncio.Protocol):
    """One accepted connection: aiohttp's protocol inside, the guard's bookkeeping around it."""

    def __init__(self, guard: ConnectionGuard) -> None:
        self._guard = guard
        self._inner: asyncio.Protocol | None = None
        self.transport: asyncio.BaseTransport | None = None
        self.requested = False
        self.gone: asyncio.Future[None] | None = None
        self._deadline: asyncio.TimerHandle | None = None
        self._head_tail = b""
        """The last bytes of the first request's headers so far (a blank line split between
        two reads is still found)."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        if not self._guard.admit(self):
            _refuse(transport)
            return
        self._deadline = asyncio.get_running_loop().call_later(
            self._guard.limits.header_timeout_s, self._header_timeout
        )
        self._inner = self._guard.factory()
        self._inner.connection_made(transport)

    def _header_timeout(self) -> None:
        self._deadline = None
        if not self.requested and self.transport is not None:
            self._guard.header_timeouts += 1
            self.close()

    def first_request(self) -> None:
        if self.requested:
            return
        self.requested = True
        self._guard.requested(self)
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def close(self) -> None:
        transport = self.transport
        if isinstance(transport, asyncio.Transport) and not transport.is_closing():
            transport.abort()

    def data_received(self, data: bytes) -> None:
        if not self.requested:
            # The headers are complete once their blank line is in: their deadline ends here,
            # not when the request's handler starts. A node busy past the deadline finds both
            # due at once, and the deadline's callback runs before the handler's first step:
            # it cut connections whose whole request had come in time.
            seen = self._head_tail + data
            if b"\r\n\r\n" in seen:
                self.first_request()
            else:
                self._head_tail = seen[-3:]
        if self._inner is not None:
            self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received() if self._inner is not None else None

    def pause_writing(self) -> None:
        if self._inner is not None:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._inner is not None:
            self._inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self._guard.release(self)
        if self.gone is not None and not self.gone.done():
            self.gone.set_result(None)
        inner, self._inner = self._inner, None
        self.transport = None
        if inner is not None:
            inner.connection_lost(exc)


def _refuse(transport: asyncio.BaseTransport) -> None:
    if isinstance(transport, asyncio.WriteTransport):
        with contextlib.suppress(Exception):
            transport.write(_REFUSAL % (len(_REFUSAL_BODY), _REFUSAL_BODY))
    transport.close()


class ConnectionGuard:
    """The node's HTTP connections: counted, capped, with a deadline for the first headers."""

    def __init__(self, limits: HttpLimits) -> None:
        self.limits = limits
        self.factory: Callable[[], asyncio.Protocol] = _no_factory
        # Open connections by transport; those still waiting for their first request in
        # arrival order, oldest first (the ones displaced at the cap).
        self._open: dict[asyncio.BaseTransport, _Connection] = {}
        self._waiting: collections.OrderedDict[_Connection, None] = collections.OrderedDict()
        self.accepted = 0
        self.refused = 0
        self.displaced = 0
        self.header_timeouts = 0
        self.body_timeouts = 0

    def __call__(self) -> asyncio.Protocol:
        """The protocol factory given to ``loop.create_server``."""
        return _Connection(self)

    @property
    def open_connections(self) -> int:
        return len(self._open)

    def stats(self) -> dict[str, int]:
        return {
            "open": len(self._open),
            "waiting_first_request": len(self._waiting),
            "max": self.limits.max_connections,
            "accepted": self.accepted,
            "refused": self.refused,
            "displaced": self.displaced,
            "header_timeouts": self.header_timeouts,
            "body_timeouts": self.body_timeouts,
        }

    # ------------------------------------------------------------------ bookkeeping

    def admit(self, conn: _Connection) -> bool:
        assert conn.transport is not None
        if len(self._open) >= self.limits.max_connections:
            if not self._waiting:
                self.refused += 1
                return False
            oldest, _ = self._waiting.popitem(last=False)
            self.displaced += 1
            oldest.close()
            # abort() reports connection_lost on the next loop turn; count it gone now.
            if oldest.transport is not None:
                self._open.pop(oldest.transport, None)
        self.accepted += 1
        self._open[conn.transport] = conn
        self._waiting[conn] = None
        return True

    def requested(self, conn: _Connection) -> None:
        self._waiting.pop(conn, None)

    def release(self, conn: _Connection) -> None:
        self._waiting.pop(conn, None)
        if conn.transport is not None and self._open.get(conn.transport) is conn:
            del self._open[conn.transport]

    def _connection(self, request: web.BaseRequest) -> _Connection | None:
        transport = request.transport
        return self._open.get(transport) if transport is not None else None

    # ------------------------------------------------------------------ per request

    def gone(self, request: web.BaseRequest) -> asyncio.Future[None] | None:
        """A future resolved when ``request``'s connection is lost (None when this guard does not
        serve it, e.g. under a test server)."""
        conn = self._connection(request)
        if conn is None:
            return None
        if conn.gone is None:
            conn.gone = asyncio.get_running_loop().create_future()
        return conn.gone

    @web.middleware
    async def arrival(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Outermost: the connection's first request has arrived (its header deadline ends)."""
        conn = self._connection(request)
        if conn is not None:
            conn.first_request()
        return await handler(request)

    @web.middleware
    async def body(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Innermost (after authentication): the whole body within ``http_body_timeout_ms``."""
        if request.body_exists:
            try:
                async with asyncio.timeout(self.limits.body_timeout_s):
                    await request.read()  # kept by aiohttp: handlers read it again for free
            except TimeoutError:
                self.body_timeouts += 1
                resp = ApiError(
                    408,
                    "request_timeout",
                    f"the request body did not arrive within {self.limits.body_timeout_s:g} s "
                    "(http_body_timeout_ms)",
                ).response()
                resp.force_close()
                # Sent here, then the connection closed: aiohttp would otherwise linger for
                # the rest of the body.
                await resp.prepare(request)
                await resp.write_eof()
                if request.transport is not None:
                    request.transport.close()
                return resp
        return await handler(request)


def _no_factory() -> asyncio.Protocol:
    raise RuntimeError("ConnectionGuard used before GuardedSite started")


class GuardedSite(web.BaseSite):
    """A TCP site whose connections pass through a :class:`ConnectionGuard`."""

    def __init__(
        self,
        runner: web.BaseRunner,
        host: str,
        port: int,
        guard: ConnectionGuard,
        *,
        ssl_context: ssl.SSLContext | None = None,
        backlog: int = 128,
    ) -> None:
        super().__init__(runner, ssl_context=ssl_context, backlog=backlog)
        self._host = host
        self._port = port
        self._guard = guard

    @property
    def name(self) -> str:
        scheme = "https" if self._ssl_context else "http"
        return f"{scheme}://{self._host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        server = self._runner.server
        assert server is not None
        self._guard.factory = server
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(
            self._host, self._port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
        family, type_, proto, _, address = infos[0]
        sock = socket.socket(family, type_, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(address)
            sock.listen(self._backlog)
            sock.setblocking(False)
        except OSError:
            sock.close()
            raise
        self._server = Acceptor(
            sock,
            self._guard,
            ssl_context=self._ssl_context,
            ssl_handshake_timeout=self._guard.limits.header_timeout_s
            if self._ssl_context
            else None,
        )


class Acceptor(asyncio.AbstractServer):
    """Accepts connections on a listening socket and hands them to the guard's protocol.

    asyncio's own accept loop, out of descriptors (EMFILE), logs an error with a traceback for
    every pending connection of the backlog and schedules as many retries, each of which
    does the same: a node short of descriptors filled its disk with those lines. Here a
    failed ``accept`` pauses the listener (the kernel keeps the backlog) for a back-off that
    doubles from :data:`ACCEPT_BACKOFF_MIN_S` to :data:`ACCEPT_BACKOFF_MAX_S`, and one
    warning per :data:`ACCEPT_LOG_INTERVAL_S` says how many accepts failed meanwhile.
    """

    def __init__(
        self,
        sock: socket.socket,
        protocol_factory: Callable[[], asyncio.Protocol],
        *,
        ssl_context: ssl.SSLContext | None = None,
        ssl_handshake_timeout: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._sock = sock
        self._factory = protocol_factory
        self._ssl = ssl_context
        self._ssl_handshake_timeout = ssl_handshake_timeout
        self._loop = asyncio.get_running_loop()
        self._clock = clock
        self._serving = True
        self._paused: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self.backoff_s = 0.0
        self.failures = 0  # accepts that failed for want of resources, in all
        self._unlogged = 0
        self._logged_at: float | None = None
        self._loop.add_reader(sock.fileno(), self._readable)

    @property
    def sockets(self) -> tuple[socket.socket, ...]:
        return (self._sock,) if self._serving else ()

    def _readable(self) -> None:
        for _ in range(ACCEPT_BATCH):
            try:
                conn, _addr = self._sock.accept()
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                return
            except OSError as exc:
                if exc.errno not in _OUT_OF_RESOURCES:
                    log.warning("accept() on %s failed: %s", self._sock.getsockname(), exc)
                    return
                self._out_of_resources(exc)
                return
            self.backoff_s = 0.0
            conn.setblocking(False)
            task = self._loop.create_task(self._start(conn))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _start(self, conn: socket.socket) -> None:
        try:
            await self._loop.connect_accepted_socket(
                self._factory,
                conn,
                ssl=self._ssl,
                ssl_handshake_timeout=self._ssl_handshake_timeout,
            )
        except (OSError, ssl.SSLError, TimeoutError) as exc:
            log.debug("connection setup failed: %s", exc)
            conn.close()

    def _out_of_resources(self, exc: OSError) -> None:
        self.failures += 1
        self._unlogged += 1
        self.backoff_s = min(max(self.backoff_s * 2, ACCEPT_BACKOFF_MIN_S), ACCEPT_BACKOFF_MAX_S)
        now = self._clock()
        if self._logged_at is None or now - self._logged_at >= ACCEPT_LOG_INTERVAL_S:
            log.warning(
                "accept() failed %d times since the last report (%s): pausing the listener "
                "%.0f ms; lower max_http_connections or raise the open-file limit",
                self._unlogged,
                exc.strerror,
                self.backoff_s * 1000,
            )
            self._logged_at = now
            self._unlogged = 0
        self._loop.remove_reader(self._sock.fileno())
        self._paused = self._loop.call_later(self.backoff_s, self._resume)

    def _resume(self) -> None:
        self._paused = None
        if self._serving:
            self._loop.add_reader(self._sock.fileno(), self._readable)

    # asyncio.AbstractServer

    def close(self) -> None:
        if not self._serving:
            return
        self._serving = False
        if self._paused is not None:
            self._paused.cancel()
            self._paused = None
        self._loop.remove_reader(self._sock.fileno())
        self._sock.close()

    def get_loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def is_serving(self) -> bool:
        return self._serving

    async def start_serving(self) -> None:
        return None

    async def serve_forever(self) -> None:
        raise NotImplementedError("the node's HTTP listener serves from start()")

    async def wait_closed(self) -> None:
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
