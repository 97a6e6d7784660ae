"""What a transport does with a request but send it, without I/O.

A transport (``_http_sync`` with http.client, ``_http_aio`` with aiohttp) holds one
:class:`RequestPolicy`. For each :class:`chronomq._api.Req` it asks it for the
:class:`Outgoing` request (the JSON body, every header, the timeout of one attempt) and for an
:class:`chronomq._wire.Attempts` that runs to the deadline (or to the request's own limit of
attempts); then it only sends, reports back and sleeps. The token, the user agent, TLS and the timeouts are decided here, once for both.
"""

from __future__ import annotations

import ssl
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import orjson

from chronomq._api import Req
from chronomq._wire import USER_AGENT, Attempts, Nodes, parse_urls


def client_ssl_context(ca_file: str | None) -> ssl.SSLContext:
    """A verifying context: ``ca_file`` alone when given, else the system's store."""
    ctx = ssl.create_default_context(cafile=ca_file or None)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    return ctx


@dataclass(frozen=True, slots=True)
class Outgoing:
    """A request as every attempt sends it, to whichever node: ``target`` is the encoded path
    and query, ``headers`` all of them (the client's and the request's own)."""

    method: str
    target: str
    body: bytes | None
    headers: Mapping[str, str]
    timeout_s: float


class RequestPolicy:
    """The nodes of one client, the headers its requests carry (the token among them), the
    timeout of one attempt and the deadline of all of them, and whether the nodes want TLS.
    Shared by every request of the client."""

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
        self.ca_file = ca_file
        self.deadline_s = deadline_s
        self.request_timeout_s = request_timeout_s
        self.headers = {"User-Agent": USER_AGENT, "Content-Type": "application/json"}
        if token:
            self.headers["Authorization"] = f"Bearer {token}"

    def ssl_context(self) -> ssl.SSLContext | None:
        """A verifying context when a node is reached over https, else None."""
        if any(u.startswith("https://") for u in self.nodes.urls):
            return client_ssl_context(self.ca_file)
        return None

    def prepare(self, req: Req) -> Outgoing:
        """What goes on the wire; a long-poll's attempts may take its ``wait_ms`` longer, a
        request with a ``timeout_s`` of its own that long."""
        timeout_s = req.timeout_s
        if timeout_s is None:
            timeout_s = self.request_timeout_s + req.wait_ms / 1000
        return Outgoing(
            req.method,
            req.target,
            orjson.dumps(req.json) if req.json is not None else None,
            {**self.headers, **req.headers},
            timeout_s,
        )

    def attempts(self, req: Req, now: float, deadline_s: float | None = None) -> Attempts:
        """The retry state of ``req`` started at ``now`` (monotonic seconds), which ends
        ``deadline_s`` later (the client's deadline when None), after ``req.attempts``
        attempts if it says so."""
        deadline = now + (self.deadline_s if deadline_s is None else deadline_s)
        return Attempts(self.nodes, req.write, deadline, pinned=req.node, limit=req.attempts)
