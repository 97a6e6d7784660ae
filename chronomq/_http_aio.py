"""The asyncio transport: one aiohttp session, the request policy of :mod:`chronomq._wire`."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from typing import Any

import aiohttp
import orjson
import yarl

from chronomq._http_sync import client_ssl_context
from chronomq._wire import USER_AGENT, Attempts, Done, Nodes, parse_urls


class AioTransport:
    """JSON requests to the cluster with failover and retries (see :class:`Attempts`).
    The session is made on first use, inside the caller's event loop."""

    def __init__(
        self,
        urls: str | Sequence[str],
        *,
        token: str | None = None,
        ca_file: str | None = None,
        deadline_s: float = 30.0,
        request_timeout_s: float = 15.0,
    ) -> None:
        self.nodes = Nodes(parse_urls(urls))
        self.deadline_s = deadline_s
        self.request_timeout_s = request_timeout_s
        self._headers = {"User-Agent": USER_AGENT, "Content-Type": "application/json"}
        if token:
            self._headers["Authorization"] = f"Bearer {token}"
        self._ca_file = ca_file
        self._session: aiohttp.ClientSession | None = None

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            needs_tls = any(u.startswith("https://") for u in self.nodes.urls)
            connector = aiohttp.TCPConnector(
                ssl=client_ssl_context(self._ca_file) if needs_tls else True
            )
            self._session = aiohttp.ClientSession(headers=self._headers, connector=connector)
        return self._session

    async def call(
        self,
        method: str,
        target: str,
        *,
        json: Any = None,
        headers: Mapping[str, str] | None = None,
        write: bool = False,
        wait_ms: int = 0,
        deadline_s: float | None = None,
    ) -> Any:
        """Send until answered or the deadline passes; the decoded JSON answer.
        ``target`` is an encoded path and query (see :func:`chronomq._wire.path`)."""
        session = self._open()
        body = orjson.dumps(json) if json is not None else None
        timeout = aiohttp.ClientTimeout(total=self.request_timeout_s + wait_ms / 1000)
        start = time.monotonic()
        attempts = Attempts(
            self.nodes, write, start + (self.deadline_s if deadline_s is None else deadline_s)
        )
        while True:
            base = attempts.target()
            # encoded=True: the path is sent as written; yarl would otherwise decode
            # escapes such as %de in %25RETRY%25default's unencoded form.
            url = yarl.URL(base + target, encoded=True)
            try:
                async with session.request(
                    method, url, data=body, headers=headers, timeout=timeout
                ) as r:
                    raw = await r.read()
                    step = attempts.answered(base, r.status, r.headers.get, raw, time.monotonic())
            except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                step = attempts.failed(base, exc, time.monotonic())
            if isinstance(step, Done):
                return step.body
            await asyncio.sleep(step.sleep_s)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
