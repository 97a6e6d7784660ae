"""The asyncio transport: one aiohttp session, the request policy of :mod:`chronomq._policy`."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import yarl

from chronomq._api import Req
from chronomq._policy import RequestPolicy
from chronomq._wire import Done


class AioTransport:
    """JSON requests to the cluster with failover and retries (see
    :class:`chronomq._policy.RequestPolicy`); this class only sends and sleeps. The session is
    made on first use, inside the caller's event loop."""

    def __init__(self, policy: RequestPolicy) -> None:
        self.policy = policy
        self._session: aiohttp.ClientSession | None = None

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            ssl_context = self.policy.ssl_context()
            connector = aiohttp.TCPConnector(ssl=True if ssl_context is None else ssl_context)
            self._session = aiohttp.ClientSession(connector=connector)
        return self._session

    async def call(self, req: Req, deadline_s: float | None = None) -> Any:
        """Send until answered or the deadline passes; the decoded JSON answer."""
        return (await self.answer(req, deadline_s)).body

    async def answer(self, req: Req, deadline_s: float | None = None) -> Done:
        """:meth:`call`, with the answer's HTTP status beside its body."""
        session = self._open()
        out = self.policy.prepare(req)
        timeout = aiohttp.ClientTimeout(total=out.timeout_s)
        attempts = self.policy.attempts(req, time.monotonic(), deadline_s)
        while True:
            base = attempts.target()
            # encoded=True: the path is sent as written; yarl would otherwise decode
            # escapes such as %de in %25RETRY%25default's unencoded form.
            url = yarl.URL(base + out.target, encoded=True)
            try:
                async with session.request(
                    out.method, url, data=out.body, headers=out.headers, timeout=timeout
                ) as r:
                    raw = await r.read()
                    step = attempts.answered(base, r.status, r.headers.get, raw, time.monotonic())
            except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                step = attempts.failed(base, exc, time.monotonic())
            if isinstance(step, Done):
                return step
            await asyncio.sleep(step.sleep_s)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
