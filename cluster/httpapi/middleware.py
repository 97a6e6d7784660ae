"""The HTTP API's middlewares: errors as ``{"error", "message", "field"}`` (a stack trace never
reaches a client), request counts and latency, and the 410 of a node removed from the cluster.
The bearer token's is :func:`chronomq.cluster.node.auth.auth_middleware`, the connection
bounds' :class:`chronomq.cluster.httpapi.httpconn.ConnectionGuard`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable

import aiohttp
from aiohttp import web

from chronomq.cluster.config.nodeconfig import ConfigError
from chronomq.cluster.httpapi.base import BROKER, METRICS
from chronomq.cluster.node.errors import ApiError, from_exception

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(
            exc.status, "http_error"
        )
        message = (
            exc.reason if exc.status != 413 else "the request body is larger than max_request_bytes"
        )
        return ApiError(exc.status, code, message).response()
    except ConfigError as exc:
        return ApiError(400, "invalid_config", str(exc), exc.key).response()
    except (ConnectionResetError, aiohttp.ClientConnectionResetError) as exc:
        # The client went away mid-request: nothing to answer, nothing to alarm anyone.
        log.debug("client disconnected during %s %s: %s", request.method, request.path, exc)
        raise
    except Exception as exc:
        broker = request.app[BROKER]
        api = from_exception(exc, broker.leader_url())
        if api is not None:
            return api.response()
        log.exception("unexpected error on %s %s", request.method, request.path)
        return ApiError(500, "internal", "internal error; see the node's log").response()


@web.middleware
async def metrics_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    metrics = request.app[METRICS]
    route = (
        request.match_info.route.resource.canonical
        if request.match_info.route.resource
        else "unmatched"
    )
    t0 = time.perf_counter()
    status = 500
    try:
        resp = await handler(request)
        status = resp.status
        return resp
    finally:
        metrics.requests.labels(route, str(status)).inc()
        metrics.latency.labels(route).observe(time.perf_counter() - t0)


REMOVED_NODE_ROUTES: frozenset[tuple[str, str]] = frozenset(
    {
        ("GET", "/healthz"),
        ("GET", "/readyz"),
        ("GET", "/metrics"),
        ("GET", "/openapi.json"),
        ("GET", "/v1/admin/node"),
        ("POST", "/v1/admin/node/removal"),
    }
)
"""What a node removed from the cluster still serves; everything else answers 410."""


@web.middleware
async def removed_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    if (request.method, request.path) not in REMOVED_NODE_ROUTES:
        gone = request.app[BROKER].removed_error()
        if gone is not None:
            return gone.response()
    return await handler(request)
