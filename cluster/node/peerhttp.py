"""Every HTTP request a node sends to another node goes through :class:`PeerHttp`.

Forwarding a write to the leader, gathering the cluster view, pushing timer switches and
fetching TimerLog records all need the cluster's bearer token. The token is attached only
to a URL whose origin (scheme, host, port) is a member's: one of the ``peers`` the node was
configured with or one an admin added with ``POST /v1/admin/members`` (replicated). Any
other URL gets the request without it. When the node itself serves HTTPS, the token is never
sent over plain http. Redirects are not followed and proxies from the environment are not
used, so the token cannot be carried on to a third party.

Requests go on one of two lanes, each its own connection pool to the peer: ``write`` (writes
forwarded to the leader, the cluster view, timer switches, TimerLog fetches) and ``poll``
(receives forwarded with a long-poll wait, which hold their connection for the whole wait).
The poll lane admits ``forward_long_polls`` at once (:meth:`PeerHttp.long_poll_slot`), so a
follower full of waiting consumers still forwards a produce at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import time
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any, Literal

import aiohttp
from yarl import URL

from chronomq.cluster.config.nodeconfig import NodeConfig
from chronomq.cluster.node import tls

Origin = tuple[str, str, int]
Lane = Literal["write", "poll"]


def origin(url: str) -> Origin | None:
    """``(scheme, host, port)`` of an http(s) URL; None for anything else."""
    try:
        u = URL(url)
    except (ValueError, TypeError):
        return None
    if u.scheme not in ("http", "https") or not u.host or u.port is None:
        return None
    return u.scheme, u.host.lower(), u.port


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None  # the 3xx surfaces as an HTTPError


class PeerHttp:
    def __init__(
        self,
        *,
        token: str,
        member_urls: Callable[[], Iterable[str]],
        ssl_context: ssl.SSLContext,
        https_only: bool = False,
        long_polls: int = 256,
    ) -> None:
        self._token = token
        self._member_urls = member_urls
        self._ssl = ssl_context
        self._https_only = https_only
        self._session: aiohttp.ClientSession | None = None
        self._polls: aiohttp.ClientSession | None = None
        self.long_polls = long_polls
        self._poll_gate: asyncio.Semaphore | None = None
        self.polls_forwarded = 0
        """Long polls holding a poll-lane slot now."""
        self.polls_waiting = 0
        """Long polls waiting for a slot now."""
        self.polls_unserved = 0
        """Long polls that ended their wait without a slot (answered with no messages)."""
        self._opener = urllib.request.build_opener(
            urllib.request.ProxyHandler({}),
            urllib.request.HTTPSHandler(context=ssl_context),
            _NoRedirect(),
        )

    @classmethod
    def for_node(cls, config: NodeConfig, member_urls: Callable[[], Iterable[str]]) -> PeerHttp:
        return cls(
            token=config.auth_token,
            member_urls=member_urls,
            ssl_context=tls.peer_context(config),
            https_only=bool(config.tls_cert_file),
            long_polls=config.forward_long_polls,
        )

    # ------------------------------------------------------------------ the token's rule

    def is_member(self, url: str) -> bool:
        """True when ``url`` is on a member's origin (and, for a TLS node, is https)."""
        target = origin(url)
        if target is None or (self._https_only and target[0] != "https"):
            return False
        return any(origin(m) == target for m in self._member_urls())

    def headers(self, url: str, headers: dict[str, str] | None = None) -> dict[str, str]:
        """``headers`` plus the token when ``url`` is a member's; any Authorization given by
        the caller is dropped (a node speaks for itself, never relays a client's header)."""
        out = {k: v for k, v in (headers or {}).items() if k.lower() != "authorization"}
        if self._token and self.is_member(url):
            out["Authorization"] = f"Bearer {self._token}"
        return out

    # ------------------------------------------------------------------ asyncio

    async def start(self) -> None:
        self._session = self._pool(100)
        self._polls = self._pool(self.long_polls)
        self._poll_gate = asyncio.Semaphore(self.long_polls)

    def _pool(self, connections: int) -> aiohttp.ClientSession:
        return aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(ssl=self._ssl, limit=connections),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=1.0),
        )

    async def close(self) -> None:
        for session in (self._session, self._polls):
            if session is not None:
                await session.close()
        self._session = self._polls = None

    @contextlib.asynccontextmanager
    async def long_poll_slot(self, wait_s: float) -> AsyncIterator[float | None]:
        """A slot on the poll lane, waited for at most ``wait_s``: yields the seconds of the
        wait still left once one is free, or None when none came free in time (the receive
        then answers with no messages, as a long poll that found none)."""
        if self._poll_gate is None:
            raise RuntimeError("PeerHttp.start() was not awaited")
        t0 = time.monotonic()
        self.polls_waiting += 1
        try:
            async with asyncio.timeout(wait_s):
                await self._poll_gate.acquire()
            got = True
        except TimeoutError:
            got = False
        finally:
            self.polls_waiting -= 1
        if not got:
            self.polls_unserved += 1
            yield None
            return
        self.polls_forwarded += 1
        try:
            yield max(0.0, wait_s - (time.monotonic() - t0))
        finally:
            self.polls_forwarded -= 1
            self._poll_gate.release()

    @contextlib.asynccontextmanager
    async def request(
        self,
        method: str,
        url: str,
        *,
        headers: dict[str, str] | None = None,
        lane: Lane = "write",
        **kwargs: Any,
    ) -> AsyncIterator[aiohttp.ClientResponse]:
        """``lane="poll"`` only inside :meth:`long_poll_slot`."""
        session = self._polls if lane == "poll" else self._session
        if session is None:
            raise RuntimeError("PeerHttp.start() was not awaited")
        async with session.request(
            method, url, headers=self.headers(url, headers), allow_redirects=False, **kwargs
        ) as response:
            yield response

    # ------------------------------------------------------------------ blocking

    def urlopen(self, url: str, timeout_s: float) -> Any:
        """A blocking GET (for threads that are not on the loop); the caller closes it."""
        req = urllib.request.Request(url)
        for name, value in self.headers(url).items():
            req.add_unredirected_header(name, value)
        return self._opener.open(req, timeout=timeout_s)
