"""The HTTP API: the app factory (:func:`create_app`), every route registered in one place
(:func:`add_routes`, the feature modules' included) and the probes, ``/metrics`` and
``/openapi.json``. The handlers live in the ``api_*`` modules, the middlewares in
:mod:`~chronomq.cluster.httpapi.middleware`, the registry in
:mod:`~chronomq.cluster.httpapi.metrics`.

Every node serves every route. Writes that reach a follower are forwarded to the leader (through
:class:`chronomq.cluster.node.peerhttp.PeerHttp`, which carries the node's own token); if the leader is unknown
the answer is 503 with ``Retry-After``. Errors are always ``{"error", "message", "field"}``
JSON; a stack trace never reaches a client. A body must be JSON and a write from a page on
another origin is refused (:mod:`~chronomq.cluster.httpapi.sameorigin`). With ``auth_token``
set every route but the probes needs the bearer token (:mod:`chronomq.cluster.node.auth`).
"""

from __future__ import annotations

from typing import Any

from aiohttp import web
from prometheus_client import generate_latest

from chronomq.cluster.httpapi import (
    api_admin,
    api_console,
    api_lookup,
    api_messages,
    api_pop,
    api_schedule,
    api_timer,
)
from chronomq.cluster.httpapi.base import (
    BROKER,
    CONFIG_HOOKS,
    CONNECTIONS,
    METRICS,
    RUNTIME_CONFIG,
    json_response,
)
from chronomq.cluster.httpapi.httpconn import ConnectionGuard, HttpLimits
from chronomq.cluster.httpapi.metrics import BoundsCollector, MembershipCollector, Metrics
from chronomq.cluster.httpapi.middleware import (
    error_middleware,
    metrics_middleware,
    removed_middleware,
)
from chronomq.cluster.httpapi.openapi import spec
from chronomq.cluster.httpapi.sameorigin import same_origin_middleware
from chronomq.cluster.logs import stdlog as logs
from chronomq.cluster.node.auth import auth_middleware
from chronomq.cluster.node.broker import Broker
from chronomq.cluster.node.disk import install_metrics as install_disk_metrics
from chronomq.cluster.node.errors import ApiError
from chronomq.cluster.node.metrics import GroupLagCollector, RaftCollector
from chronomq.cluster.node.runtimeconfig import RuntimeConfig
from chronomq.pop import install_metrics as install_pop_metrics


async def healthz(request: web.Request) -> web.Response:
    broker = request.app.get(BROKER)  # the probe answers before anything else is set up
    removed = broker is not None and broker.raftlog.removal is not None
    # Whether the other routes need the token: what a 401 would say anyway, and what lets
    # the console ask for the token before its first call.
    auth_required = broker is not None and bool(broker.config.auth_token)
    return json_response(
        {"status": "ok", "removed_from_cluster": removed, "auth_required": auth_required}
    )


async def readyz(request: web.Request) -> web.Response:
    broker = request.app[BROKER]
    # Not ready answers are errors like any other (and keep the status field probes read).
    if broker.raftlog.removal is not None:
        # Not ready, and not something a retry fixes: 410, as the client routes answer.
        gone = "this node was removed from the cluster"
        raise ApiError(410, "removed_from_cluster", gone, extra={"status": "removed_from_cluster"})
    readiness = broker.raftlog.readiness()
    if not readiness.ready:
        # Ready means a write sent here can commit now: a leader this node hears from,
        # holding a quorum (raftlog/readiness.py), not merely the last leader it heard of.
        raise ApiError(
            503,
            "no_leader",
            f"not ready: {readiness.reason}; retry shortly",
            None,
            {"Retry-After": "1"},
            {"status": "no_leader"},
        )
    return json_response({"status": "ready", "leader": broker.node_id_of(readiness.leader)})


async def openapi(request: web.Request) -> web.Response:
    config = request.app[BROKER].config
    return json_response(spec(config.metrics_public, auth_required=bool(config.auth_token)))


async def metrics(request: web.Request) -> web.Response:
    m = request.app[METRICS]
    m.refresh(request.app[BROKER])
    return web.Response(
        body=generate_latest(m.registry), content_type="text/plain", charset="utf-8"
    )


def add_routes(app: web.Application) -> None:
    r = app.router
    r.add_get("/healthz", healthz)
    r.add_get("/readyz", readyz)
    r.add_get("/metrics", metrics)
    r.add_get("/openapi.json", openapi)
    api_messages.add_routes(app)
    api_admin.add_routes(app)
    api_schedule.add_routes(app)
    api_timer.add_routes(app)
    api_pop.add_routes(app)
    api_lookup.add_routes(app)
    api_console.add_routes(app)


def create_app(broker: Broker) -> web.Application:
    limits = HttpLimits.from_config(broker.config)
    guard = ConnectionGuard(limits)
    app = web.Application(
        client_max_size=broker.config.max_request_bytes,
        handler_args=limits.handler_args(),
        middlewares=[
            guard.arrival,
            metrics_middleware,
            error_middleware,
            same_origin_middleware,
            auth_middleware(
                broker.config.auth_token,
                metrics_public=broker.config.metrics_public,
                console_files=api_console.console_files().keys(),
            ),
            removed_middleware,
            guard.body,
        ],
    )
    app[BROKER] = broker
    app[METRICS] = Metrics()
    app[CONNECTIONS] = guard
    broker.connections = guard
    registry = app[METRICS].registry
    registry.register(BoundsCollector(broker, guard))
    registry.register(MembershipCollector(broker))
    registry.register(RaftCollector(broker))
    registry.register(GroupLagCollector(broker))
    registry.register(broker.lateness.histogram)
    app[CONFIG_HOOKS] = []
    app[RUNTIME_CONFIG] = RuntimeConfig(broker, app[CONFIG_HOOKS], logs.set_level)

    async def broker_ctx(app: web.Application) -> Any:
        await broker.start()
        await app[RUNTIME_CONFIG].start()
        yield
        await app[RUNTIME_CONFIG].stop()
        await broker.stop()

    app.cleanup_ctx.append(broker_ctx)
    add_routes(app)
    api_schedule.install_metrics(app)
    api_timer.install_metrics(app)
    if broker.disk is not None:
        metrics = app[METRICS]
        install_disk_metrics(metrics.registry, metrics.collectors, broker.disk)
    if broker.pop is not None:
        install_pop_metrics(app[METRICS].registry, app[METRICS].collectors, broker.pop)
    return app
