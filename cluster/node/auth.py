"""The bearer token every HTTP route requires when ``auth_token`` is set.

Only the probes and the console's static files are open: ``GET /healthz``, ``GET /readyz``,
``GET /console`` and ``GET /console/{file}`` for the files the console has (the page then asks
for the token and sends it with every API call it makes), and ``GET /metrics`` when
``metrics_public``. Everything else, reads included (message bodies, group offsets, raw
TimerLog records, the topology) and paths that match no route (so a caller without the
token cannot tell which routes exist), answers 401 with ``WWW-Authenticate: Bearer`` and the
usual ``{"error", "message", "field"}`` body unless the request carries
``Authorization: Bearer <token>``. The scheme is matched case-insensitively (RFC 7235) and the
token in constant time.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, Collection
from typing import Any

from aiohttp import web

from chronomq.cluster.node.errors import ApiError

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

PROBE_ROUTES: tuple[tuple[str, str], ...] = (("GET", "/healthz"), ("GET", "/readyz"))
"""Routes that never need the token."""
CONSOLE_ROUTES: tuple[tuple[str, str], ...] = (("GET", "/console"), ("GET", "/console/{file}"))
"""The console's static files (no data: the page asks for the token itself)."""
CONSOLE_PREFIX = "/console/"
METRICS_ROUTE = ("GET", "/metrics")
"""Needs the token unless ``metrics_public``."""
REALM = "chronomq"


def open_routes(metrics_public: bool) -> tuple[tuple[str, str], ...]:
    """The (method, path) routes served without the token."""
    return PROBE_ROUTES + CONSOLE_ROUTES + ((METRICS_ROUTE,) if metrics_public else ())


def bearer_token_matches(authorization: str | None, token: bytes) -> bool:
    """True when ``authorization`` is ``Bearer <token>`` (scheme in any case)."""
    if not authorization or not token:
        return False
    scheme, _, credentials = authorization.strip().partition(" ")
    if scheme.lower() != "bearer":
        return False
    # surrogatepass: lossless for any str a header parser may produce, so no two different
    # header values can encode to the same bytes.
    given = credentials.strip().encode("utf-8", "surrogatepass")
    return hmac.compare_digest(given, token)


def unauthorized(invalid: bool) -> ApiError:
    if invalid:
        message = "the bearer token is not valid"
        challenge = f'Bearer realm="{REALM}", error="invalid_token"'
    else:
        message = "this route needs Authorization: Bearer <token>"
        challenge = f'Bearer realm="{REALM}"'
    return ApiError(401, "unauthorized", message, "Authorization", {"WWW-Authenticate": challenge})


def auth_middleware(
    token: str, *, metrics_public: bool = False, console_files: Collection[str] = ()
) -> Any:
    """The middleware; with an empty ``token`` it lets everything through. ``console_files``:
    the names the console serves under ``/console/``; any other path there needs the token,
    like every path that matches no route."""
    expected = token.encode("utf-8", "surrogatepass")
    open_paths = {path for _method, path in open_routes(metrics_public)}
    open_paths |= {CONSOLE_PREFIX + name for name in console_files}

    @web.middleware
    async def auth(request: web.Request, handler: Handler) -> web.StreamResponse:
        if not expected:
            return await handler(request)
        if request.method in ("GET", "HEAD") and request.path in open_paths:
            return await handler(request)
        header = request.headers.get("Authorization")
        if not bearer_token_matches(header, expected):
            # Answered here, before routing's 404/405 and before any handler reads the body.
            return unauthorized(invalid=header is not None).response()
        return await handler(request)

    return auth
