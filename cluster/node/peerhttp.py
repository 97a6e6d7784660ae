"""Every HTTP request a node sends to another node goes through :class:`PeerHttp`.

Forwarding a write to the leader, gathering the cluster view, pushing timer switches and
fetching TimerLog records all need the cluster's bearer token. The token is attached only
to a URL whose origin (scheme, host, port) is a member's: one of the ``peers`` the node was
configured with or one an admin added with ``POST /v1/admin/members`` (replicated). Any
other URL gets the request without it. When the node itself serves HTTPS, the token is never
sent over plain http. Redirects are not followed and proxies from the environment are not
used, so the token cannot be carried on to a third party.
"""

from __future__ import annotations

import contextlib
import ssl
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

import aiohttp
from yarl import URL

from chronomq.cluster.config.nodeconfig import NodeConfig
from chronomq.cluster.node import tls

Origin = tuple[str, str, int]


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
    ) -> None:
        self._token = token
        self._member_urls = member_urls
        self._ssl = ssl_context
        self._https_only = https_only
        self._session: aiohttp.ClientSession | None = None
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
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(ssl=self._ssl),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=1.0),
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    @contextlib.asynccontextmanager
    async def request(
        self, method: str, url: str, *, headers: dict[str, str] | None = None, **kwargs: Any
    ) -> AsyncIterator[aiohttp.ClientResponse]:
        if self._session is None:
            raise RuntimeError("PeerHttp.start() was not awaited")
        async with self._session.request(
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
