"""What a page on another site may not make a browser send: a body that is not JSON, and a
write.

A browser lets any page send a "simple" cross-origin request without asking the server first:
a ``<form>`` POST (``text/plain``, ``application/x-www-form-urlencoded``, ``multipart``) or a
``fetch(..., {mode: "no-cors"})``. Without ``auth_token`` such a request reaches every route;
with it, the page cannot add the ``Authorization`` header, but the rules here hold anyway.

- Every request with a body must say ``Content-Type: application/json`` (415 otherwise,
  naming the type it gave): no simple request can, so a body always comes from a client that
  chose to send JSON (or from a page the browser asked this node about first, which it never
  allows: the node answers no CORS preflight).
- A request that may change state (any method but GET, HEAD and OPTIONS) is refused (403)
  when its ``Sec-Fetch-Site`` says it comes from another origin (``same-site`` included: a
  page on another port of the same host is another origin) or its ``Origin`` names another
  host than the one it was sent to. Clients that are not browsers send neither header and
  pass; the console, served by the node itself, sends ``same-origin``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from urllib.parse import urlsplit

from aiohttp import web

from chronomq.cluster.node.errors import ApiError

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

JSON = "application/json"
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
"""Methods that change nothing on any route."""
_FROM_HERE = frozenset({"same-origin", "none"})
"""``Sec-Fetch-Site`` values of a request this node's own page (or the user) made."""
_DEFAULT_PORTS = {"http": 80, "https": 443}


def body_type_error(content_type: str | None) -> ApiError | None:
    """The 415 for a body whose ``Content-Type`` header is not JSON; None when it is."""
    if content_type is not None and content_type.split(";")[0].strip().lower() == JSON:
        return None
    given = "none was given" if content_type is None else f"got {content_type[:100]!r}"
    return ApiError(
        415,
        "unsupported_media_type",
        f"a request body must be sent as Content-Type: {JSON}; {given}",
        "Content-Type",
    )


def _authority(netloc: str, scheme: str) -> str:
    """``host:port`` in lower case, the scheme's default port written out."""
    netloc = netloc.lower()
    if netloc.endswith("]") or ":" not in netloc.rpartition("]")[2]:
        return f"{netloc}:{_DEFAULT_PORTS.get(scheme, 0)}"
    return netloc


def cross_origin_reason(headers: Mapping[str, str], host: str) -> str | None:
    """Why a write with these headers, sent with ``Host: host``, comes from a page on another
    origin; None when nothing says so. A browser leaves the port out of ``Host`` when it is
    the default of the scheme it used, which is the ``Origin``'s (so a proxy in front that
    ends TLS changes nothing)."""
    site = headers.get("Sec-Fetch-Site")
    if site is not None and site.strip().lower() not in _FROM_HERE:
        return f"Sec-Fetch-Site is {site[:40]!r}: the request comes from a page on another origin"
    origin = headers.get("Origin")
    if origin is None:
        return None
    parts = urlsplit(origin.strip())
    if parts.scheme not in _DEFAULT_PORTS or not parts.netloc:
        return f"Origin is {origin[:100]!r}, not this node's"
    if _authority(parts.netloc, parts.scheme) != _authority(host, parts.scheme):
        return f"Origin {origin[:100]!r} is not this node ({host[:100]})"
    return None


@web.middleware
async def same_origin_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Refuse a non-JSON body (415) and a write from another origin (403), before the token
    is looked at and before any handler reads the body."""
    if request.body_exists:
        refused = body_type_error(request.headers.get("Content-Type"))
        if refused is not None:
            return refused.response()
    if request.method not in SAFE_METHODS:
        reason = cross_origin_reason(request.headers, request.host)
        if reason is not None:
            return ApiError(403, "cross_origin", f"refused: {reason}", "Origin").response()
    return await handler(request)
