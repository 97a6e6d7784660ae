"""What every route module of the HTTP API shares: the app's keys (the broker, the metrics,
the connection guard, runtime config), JSON in and out, query and path integers, forwarding a
write to the leader, and noticing that a long-polling client went away."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from chronomq.cluster.httpapi.httpconn import ConnectionGuard
from chronomq.cluster.httpapi.metrics import Metrics
from chronomq.cluster.node.broker import Broker
from chronomq.cluster.node.errors import ApiError, bad_request
from chronomq.cluster.node.peerhttp import Lane
from chronomq.cluster.node.runtimeconfig import RuntimeConfig
from chronomq.pop import group_problem

BROKER: web.AppKey[Broker] = web.AppKey("broker", Broker)
METRICS: web.AppKey[Metrics] = web.AppKey("metrics", Metrics)
CONNECTIONS: web.AppKey[ConnectionGuard] = web.AppKey("connections", ConnectionGuard)
CONFIG_HOOKS: web.AppKey[list[Callable[[dict[str, Any]], None]]] = web.AppKey("config_hooks", list)
"""Run on every node with ``{key: new value}`` when the effective runtime config changes."""
RUNTIME_CONFIG: web.AppKey[RuntimeConfig] = web.AppKey("runtime_config", RuntimeConfig)

_FORWARD_HEADERS = ("Idempotency-Key", "Content-Type")


def json_response(
    data: Any, status: int = 200, headers: dict[str, str] | None = None
) -> web.Response:
    return web.Response(
        body=orjson.dumps(data, option=orjson.OPT_APPEND_NEWLINE),
        status=status,
        content_type="application/json",
        headers=headers,
    )


async def read_json(request: web.Request) -> Any:
    raw = await request.read()
    if not raw:
        raise bad_request("the request body is empty; a JSON object is required", "body")
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise bad_request(f"the body is not valid JSON: {exc}", "body", "invalid_json") from None


def int_param(request: web.Request, name: str, default: int | None, lo: int, hi: int) -> int:
    raw = request.query.get(name)
    if raw is None:
        if default is None:
            raise bad_request(f"query parameter {name} is required", name)
        return default
    try:
        value = int(raw)
    except ValueError:
        raise bad_request(f"{name} must be an integer, got {raw!r}", name) from None
    if not lo <= value <= hi:
        raise bad_request(f"{name} must be between {lo} and {hi}, got {value}", name)
    return value


def path_group(request: web.Request) -> str:
    """The consumer group the path names; 400 naming ``group`` unless it is one (letters,
    digits, ``_``, ``-``, ``|``; as pop and consumer retry take it)."""
    group = request.match_info["group"]
    problem = group_problem(group)
    if problem is not None:
        raise bad_request(problem, "group")
    return group


def path_int(request: web.Request, name: str) -> int:
    raw = request.match_info[name]
    if not (raw.isascii() and raw.isdigit()) or len(raw) > 18:
        raise bad_request(f"{name} must be a non-negative integer, got {raw!r}", name)
    return int(raw)


async def forward_to_leader(
    request: web.Request,
    timeout_s: float | None = None,
    *,
    body: bytes | None = None,
    lane: Lane = "write",
) -> web.Response | None:
    """On a follower, send a write to the leader and relay its answer; None on the leader.
    ``timeout_s``: how long the leader may take (default: the commit timeout and 5 s);
    ``body``: sent instead of the request's; ``lane``: the peer pool it goes on."""
    broker = request.app[BROKER]
    if broker.raftlog.is_leader:
        return None
    leader = broker.leader_url()
    if leader is None or leader == broker.config.http_url:
        raise ApiError(
            503, "no_leader", "no leader is known yet; retry shortly", None, {"Retry-After": "1"}
        )
    if request.headers.get("X-Chronomq-Forwarded"):
        # Forwarded here by a node that took this one for the leader: forwarding again could
        # loop, so the answer names the leader, and the client goes there.
        raise ApiError(
            503,
            "not_leader",
            f"this node does not lead; the leader is {leader}",
            None,
            {"Retry-After": "1"},
            {"leader": leader},
        )
    headers = {h: request.headers[h] for h in _FORWARD_HEADERS if h in request.headers}
    headers["X-Chronomq-Forwarded"] = broker.config.http_url
    if body is None:
        body = await request.read()
    try:
        async with broker.peer_client.request(
            request.method,
            f"{leader}{request.rel_url}",
            data=body,
            headers=headers,
            lane=lane,
            timeout=aiohttp.ClientTimeout(
                total=timeout_s
                if timeout_s is not None
                else broker.config.commit_timeout_ms / 1000 + 5
            ),
        ) as r:
            payload = await r.read()
            out_headers = {"X-Chronomq-Leader": leader}
            if "Retry-After" in r.headers:
                out_headers["Retry-After"] = r.headers["Retry-After"]
            return web.Response(
                body=payload, status=r.status, content_type="application/json", headers=out_headers
            )
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise ApiError(
            503,
            "leader_unreachable",
            f"the leader at {leader} did not answer: {exc}",
            None,
            {"Retry-After": "1"},
        ) from None


@contextlib.asynccontextmanager
async def client_gone(
    request: web.Request, wait_ms: int
) -> AsyncIterator[asyncio.Future[None] | None]:
    """A future resolved when the client of a long-poll goes away. The connection guard
    knows at once; under a server without it (tests) the transport is looked at twice a
    second."""
    if not wait_ms:
        yield None
        return
    gone = request.app[CONNECTIONS].gone(request)
    if gone is not None:
        yield gone
        return
    fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def watch() -> None:
        while request.transport is not None and not request.transport.is_closing():
            await asyncio.sleep(0.5)
        fut.set_result(None)

    task = asyncio.create_task(watch())
    try:
        yield fut
    finally:
        task.cancel()
        fut.cancel()
