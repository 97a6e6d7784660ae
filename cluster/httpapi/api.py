"""The HTTP API: routes, thin handlers and middlewares (errors, auth, metrics).

Every node serves every route. Writes that reach a follower are forwarded to the leader (through
:class:`chronomq.cluster.node.peerhttp.PeerHttp`, which carries the node's own token); if the leader is unknown
the answer is 503 with ``Retry-After``. Errors are always ``{"error", "message", "field"}``
JSON; a stack trace never reaches a client. With ``auth_token`` set every route but the probes
needs the bearer token (:mod:`chronomq.cluster.node.auth`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import aiohttp
import msgspec
import orjson
from aiohttp import web
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from chronomq.cluster.config.nodeconfig import (
    ConfigError,
    Peer,
    host_port_problem,
    http_url_problem,
)
from chronomq.cluster.httpapi import api_console, api_lookup, api_pop, api_schedule, api_timer
from chronomq.cluster.httpapi.base import (
    BROKER,
    CONFIG_HOOKS,
    CONNECTIONS,
    METRICS,
    RUNTIME_CONFIG,
    client_gone,
    forward_to_leader,
    int_param,
    json_response,
    path_int,
    read_json,
)
from chronomq.cluster.httpapi.httpconn import ConnectionGuard, HttpLimits
from chronomq.cluster.httpapi.openapi import spec
from chronomq.cluster.logs import stdlog as logs
from chronomq.cluster.node import models, reserved, runtimeconfig
from chronomq.cluster.node.auth import auth_middleware
from chronomq.cluster.node.broker import Broker
from chronomq.cluster.node.disk import install_metrics as install_disk_metrics
from chronomq.cluster.node.errors import ApiError, bad_request, from_exception
from chronomq.cluster.node.metrics import GroupLagCollector, RaftCollector
from chronomq.cluster.node.runtimeconfig import RUNTIME_KEYS, RuntimeConfig
from chronomq.pop import install_metrics as install_pop_metrics
from chronomq.raftlog import record
from chronomq.raftlog.record import validate_topic
from chronomq.raftlog.removal import SIGNATURE_HEADER
from chronomq.raftlog.transfer import TransferResult
from chronomq.raftlog.transfer_driver import (
    DEFAULT_TIMEOUT_MS,
    MAX_TIMEOUT_MS,
    transfer_leadership,
)

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class Metrics:
    """The node's registry: the gauges set on each scrape (:meth:`refresh`), the collectors
    of :mod:`chronomq.cluster.node.metrics` and the services', and the process collector
    (``process_resident_memory_bytes``, ``process_cpu_seconds_total``, open fds, ...)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        GCCollector(registry=r)
        self.requests = Counter(
            "chronomq_http_requests", "HTTP requests", ["route", "status"], registry=r
        )
        self.latency = Histogram(
            "chronomq_http_request_seconds",
            "HTTP request latency",
            ["route"],
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=r,
        )
        self.produced = Counter(
            "chronomq_messages_produced", "Messages produced through this node", registry=r
        )
        self.consumed = Counter(
            "chronomq_messages_pulled", "Messages returned by pulls", registry=r
        )
        self.role = Gauge(
            "chronomq_raft_role", "1 when this node is the confirmed leader", registry=r
        )
        self.term = Gauge("chronomq_raft_term", "Current Raft term", registry=r)
        self.commit_index = Gauge("chronomq_raft_commit_index", "Raft commit index", registry=r)
        self.applied_index = Gauge("chronomq_raft_applied_index", "Raft applied index", registry=r)
        self.max_tick = Gauge(
            "chronomq_raft_max_tick_seconds", "Longest Raft tick since start", registry=r
        )
        self.commitlog_bytes = Gauge(
            "chronomq_commitlog_bytes", "CommitLog length in bytes", registry=r
        )
        self.queued = Gauge(
            "chronomq_group_commit_queued_messages", "Messages waiting for commit", registry=r
        )
        self.inflight = Gauge(
            "chronomq_group_commit_inflight_commands",
            "Commands proposed, not committed",
            registry=r,
        )
        self.transfers = Counter(
            "chronomq_leadership_transfers",
            "Leadership transfers asked of this node while it led, by result",
            ["result"],
            registry=r,
        )
        self.collectors: list[Callable[[], None]] = []

    def refresh(self, broker: Broker) -> None:
        st = broker.raftlog.status()
        self.role.set(1 if broker.raftlog.is_leader else 0)
        self.term.set(st["term"])
        self.commit_index.set(st["commit_index"])
        self.applied_index.set(st["applied_index"])
        self.max_tick.set(st["max_tick_ms"] / 1000)
        self.commitlog_bytes.set(broker.raftlog.store.applied_length)
        self.queued.set(st["queued_messages"])
        self.inflight.set(st["inflight_commands"])
        for collect in self.collectors:
            collect()


class _BoundsCollector:
    """Long-poll waiters, pull reads moved off the loop, and the HTTP connection guard."""

    def __init__(self, broker: Broker, guard: ConnectionGuard) -> None:
        self._broker = broker
        self._guard = guard

    def collect(self) -> Iterator[Metric]:
        b, g = self._broker, self._guard
        yield GaugeMetricFamily(
            "chronomq_pull_waiters", "Long-polling pulls waiting now", value=b.waiters.waiting
        )
        yield CounterMetricFamily(
            "chronomq_pull_offloaded_reads",
            "Pull pages read on the pull executor (larger than the inline limit)",
            value=b.offloaded_pulls,
        )
        yield GaugeMetricFamily(
            "chronomq_http_connections", "Open HTTP connections", value=g.open_connections
        )
        for name, what in (
            ("refused", "refused at max_http_connections (all busy)"),
            ("displaced", "closed at max_http_connections to admit a new one"),
            ("header_timeouts", "closed for missing http_header_timeout_ms"),
            ("body_timeouts", "answered 408 for missing http_body_timeout_ms"),
        ):
            yield CounterMetricFamily(
                f"chronomq_http_connections_{name}",
                f"HTTP connections {what}",
                value=getattr(g, name),
            )


# ---------------------------------------------------------------------- middlewares


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


class _MembershipCollector:
    """This node's removal and its pre-vote counters."""

    def __init__(self, broker: Broker) -> None:
        self._broker = broker

    def collect(self) -> Iterator[Metric]:
        machine = self._broker.raftlog.machine
        yield GaugeMetricFamily(
            "chronomq_removed_from_cluster",
            "1 when this node was removed from the cluster",
            value=1 if machine.removal is not None else 0,
        )
        for name, value, what in (
            ("prevotes_started", machine.prevotes_started, "pre-vote rounds this node started"),
            ("prevotes_won", machine.prevotes_won, "pre-vote rounds won (elections started)"),
            (
                "votes_ignored",
                machine.votes_ignored,
                "vote requests ignored (a live leader was heard, or this node was removed)",
            ),
        ):
            yield CounterMetricFamily(f"chronomq_raft_{name}", what, value=value)


# ---------------------------------------------------------------------- data plane


async def produce(request: web.Request) -> web.Response:
    forwarded = await forward_to_leader(request)
    if forwarded is not None:
        return forwarded
    broker = request.app[BROKER]
    idem = request.headers.get("Idempotency-Key")
    if idem is not None and not 1 <= len(idem) <= 200:
        raise bad_request("Idempotency-Key must be 1 to 200 characters", "Idempotency-Key")
    # Back-pressure in bytes, before the body is read: a chunked body (no length) counts as
    # the largest one allowed.
    size = request.content_length
    with broker.hold_request(size if size is not None else broker.config.max_request_bytes):
        body = models.decode(await request.read(), models.ProduceRequest)
        result = await broker.produce(request.match_info["topic"], body.messages, idem)
    request.app[METRICS].produced.inc(len(result["results"]))
    return json_response(result)


async def pull(request: web.Request) -> web.Response:
    broker = request.app[BROKER]
    cfg = broker.config
    queue = path_int(request, "queue")
    offset = int_param(request, "offset", 0, 0, 2**62)
    max_messages = int_param(request, "max", 32, 1, cfg.max_pull_messages)
    wait_ms = int_param(request, "wait_ms", 0, 0, cfg.max_wait_ms)
    prev = request.query.get("prev")
    if prev is not None:
        prev = record.msg_id_hex(record.parse_msg_id(prev, "prev"))
    async with client_gone(request, wait_ms) as gone:
        page, max_offset = await broker.pull(
            request.match_info["topic"],
            queue,
            offset,
            max_messages,
            wait_ms,
            gone,
            prev,
        )
    request.app[METRICS].consumed.inc(len(page.messages))
    return web.Response(body=page.answer(max_offset), content_type="application/json")


async def describe_topic(request: web.Request) -> web.Response:
    return json_response(request.app[BROKER].describe_topic(request.match_info["topic"]))


async def list_topics(request: web.Request) -> web.Response:
    """Topics in name order, a page of at most ``max_topics_listed`` (or ``?limit=``) after
    ``?after=``; ``truncated`` says more follow, from ``next_after``."""
    broker = request.app[BROKER]
    cap = broker.config.max_topics_listed
    limit = _int_query(request, "limit", cap)
    if not 1 <= limit <= cap:
        raise bad_request(f"limit must be between 1 and {cap} (max_topics_listed)", "limit")
    after = request.query.get("after", "")
    items = list(broker.raftlog.store.topics.items())  # the Raft thread adds topics: copy
    names = sorted(t for t, _ in items if t > after)
    page = names[:limit]
    queues = dict(items)
    topics = [{"topic": t, "queues": len(queues[t]), "messages": sum(queues[t])} for t in page]
    truncated = len(names) > limit
    return json_response(
        {"topics": topics, "truncated": truncated, "next_after": page[-1] if truncated else None}
    )


def _int_query(request: web.Request, name: str, default: int) -> int:
    raw = request.query.get(name)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError:
        raise bad_request(f"{name} must be an integer", name) from None


async def create_topic(request: web.Request) -> web.Response:
    forwarded = await forward_to_leader(request)
    if forwarded is not None:
        return forwarded
    broker = request.app[BROKER]
    body = models.decode(await request.read(), models.CreateTopic)
    queues = broker.config.default_topic_queues if body.queues is msgspec.UNSET else body.queues
    topic = request.match_info["topic"]
    reserved.check_user_topic(topic)
    existing = broker.raftlog.store.queue_count(topic)
    if existing is not None:
        if existing != queues:
            raise ApiError(
                409, "topic_exists", f"topic {topic} exists with {existing} queues", "queues"
            )
        return json_response(broker.describe_topic(topic))
    if 1 <= queues <= 1024:  # a bad count is the caller's 400 first (raftlog checks it)
        broker.check_topic_room({topic: queues})
    await broker.commit(broker.raftlog.create_topic(topic, queues))
    return json_response(broker.describe_topic(topic), status=201)


async def put_offset(request: web.Request) -> web.Response:
    forwarded = await forward_to_leader(request)
    if forwarded is not None:
        return forwarded
    broker = request.app[BROKER]
    group = request.match_info["group"]
    body = models.decode(await request.read(), models.OffsetCommit)
    topic, queue, offset = body.topic, body.queue, body.offset
    broker.queue_count(topic)  # 404 for an unknown topic
    broker.check_queue(topic, queue)
    validate_topic(group, "group")
    await broker.commit_offset(group, topic, queue, offset)
    return json_response({"group": group, "topic": topic, "queue": queue, "offset": offset})


async def get_offsets(request: web.Request) -> web.Response:
    # Offsets are read where they are written: a follower may not have applied the latest
    # commit, and a consumer resuming from a stale offset would see messages twice.
    forwarded = await forward_to_leader(request)
    if forwarded is not None:
        return forwarded
    broker = request.app[BROKER]
    group = request.match_info["group"]
    return json_response(
        {"group": group, "offsets": broker.group_offsets(group, request.query.get("topic"))}
    )


# ---------------------------------------------------------------------- admin


async def admin_node(request: web.Request) -> web.Response:
    return json_response(request.app[BROKER].node_status())


async def admin_cluster(request: web.Request) -> web.Response:
    return json_response(await request.app[BROKER].cluster_view())


async def admin_digest(request: web.Request) -> web.Response:
    return json_response(request.app[BROKER].raftlog.digest())


def _config_view(request: web.Request) -> dict[str, Any]:
    runtime = request.app[RUNTIME_CONFIG]
    return {
        "config": request.app[BROKER].config.masked(),
        "runtime": runtime.overrides(),
        "runtime_keys": list(RUNTIME_KEYS),
    }


async def admin_config(request: web.Request) -> web.Response:
    """This node's effective config: its file's, overlaid with the cluster's runtime values."""
    request.app[RUNTIME_CONFIG].refresh()  # a snapshot installed since the last apply
    return json_response(_config_view(request))


async def admin_config_patch(request: web.Request) -> web.Response:
    """Change runtime keys cluster-wide: validated here, committed by the leader (one kv update,
    and the timer's switch command for its keys), answered once applied on this node."""
    broker = request.app[BROKER]
    changes = runtimeconfig.validate(await read_json(request))
    forwarded = await forward_to_leader(request)
    if forwarded is not None:
        return await _applied_here(request, forwarded, sorted(changes))
    todo = runtimeconfig.plan(changes)
    if todo.kv:
        await broker.commit(broker.raftlog.update(todo.kv))
    if todo.timer:
        if broker.timer is None:
            raise ApiError(503, "timer_unavailable", "the timer service is not running here")
        await asyncio.wait_for(
            broker.timer.set_switches(**todo.timer), broker.config.commit_timeout_ms / 1000 + 1
        )
    request.app[RUNTIME_CONFIG].refresh()
    return json_response(
        {
            **_config_view(request),
            "changed": sorted(changes),
            "applied_index": broker.raftlog.store.applied_index,
        }
    )


async def _applied_here(
    request: web.Request, forwarded: web.Response, changed: list[str]
) -> web.Response:
    """The leader's answer to a forwarded PATCH, once this node has applied as far as the
    leader had: then this node's own view. If it lags past the commit timeout, the leader's."""
    if forwarded.status != 200 or not isinstance(forwarded.body, bytes):
        return forwarded
    try:
        index = orjson.loads(forwarded.body).get("applied_index")
    except (orjson.JSONDecodeError, AttributeError):
        return forwarded
    if type(index) is not int:
        return forwarded
    store = request.app[BROKER].raftlog.store
    loop = asyncio.get_running_loop()
    deadline = loop.time() + request.app[BROKER].config.commit_timeout_ms / 1000
    while store.applied_index < index:
        if loop.time() > deadline:
            log.warning("config change committed at %d, not applied here yet; relaying", index)
            return forwarded
        await asyncio.sleep(0.01)
    request.app[RUNTIME_CONFIG].refresh()
    return json_response(
        {
            **_config_view(request),
            "changed": changed,
            "applied_index": store.applied_index,
        },
        headers={k: v for k, v in forwarded.headers.items() if k == "X-Chronomq-Leader"},
    )


async def leadership_transfer(request: web.Request) -> web.Response:
    """Hand the leadership to node ``to`` (or the most caught-up follower) and answer once it
    has moved (200) or why not (404/409/503/504); see :mod:`chronomq.raftlog.transfer_driver`."""
    broker = request.app[BROKER]
    if not broker.raftlog.is_leader:
        forwarded = await forward_to_leader(request, MAX_TIMEOUT_MS / 1000 + 5)
        if forwarded is not None:
            return forwarded
    body = (
        models.decode(await request.read(), models.TransferRequest)
        if request.body_exists
        else models.TransferRequest()
    )
    target = body.to
    timeout_ms = DEFAULT_TIMEOUT_MS if body.timeout_ms is msgspec.UNSET else body.timeout_ms

    result = await transfer_leadership(broker, target, timeout_ms / 1000)
    request.app[METRICS].transfers.labels(result.outcome.value).inc()
    return _transfer_answer(broker, result)


_TRANSFER_ERRORS = {
    # outcome: (status, error code)
    "unknown_member": (400, "unknown_member"),
    "target_not_member": (409, "target_not_member"),
    "target_unreachable": (409, "target_unreachable"),
    "no_target": (409, "transfer_refused"),
    "not_caught_up": (409, "transfer_refused"),
    "election_lost": (409, "transfer_refused"),
    "in_progress": (409, "transfer_in_progress"),
    "not_leader": (503, "not_leader"),
    "timeout": (504, "transfer_timeout"),
}


def _transfer_answer(broker: Broker, result: TransferResult) -> web.Response:
    leader_url = broker.peer_http(result.leader_address)
    answer = {
        "from": result.from_id,
        "to": result.target_id,
        "leader": result.leader_id,
        "leader_url": leader_url,
        "term": result.term,
        "waited_ms": result.waited_ms,
        "catch_up_ms": result.catch_up_ms,
        "held_ms": result.held_ms,
        "attempts": result.attempts,
    }
    outcome = result.outcome.value
    if outcome in ("transferred", "already_leader"):
        return json_response({"status": outcome, **answer, "message": result.message})
    # In an error, "leader" is the leader's URL, as in every 503 not_leader (clients follow it).
    answer["leader_id"] = answer["leader"]
    answer["leader"] = leader_url
    status, code = _TRANSFER_ERRORS[outcome]
    headers = {"Retry-After": "1"} if status in (503, 504) else None
    raise ApiError(
        status,
        code,
        result.message,
        "to" if outcome in ("unknown_member", "target_not_member", "target_unreachable") else None,
        headers,
        {"reason": outcome, **answer},
    )


async def add_member(request: web.Request) -> web.Response:
    forwarded = await forward_to_leader(request)
    if forwarded is not None:
        return forwarded
    body = models.decode(await request.read(), models.AddMember)
    pid, raft, http = body.id, body.raft, body.http
    problem = host_port_problem(raft)
    if problem:
        raise bad_request(f"raft {problem}", "raft")
    problem = http_url_problem(http)
    if problem:
        raise bad_request(f"http {problem}", "http")
    host, _, port = str(raft).rpartition(":")
    fetch = body.fetch or f"{host}:{int(port) + 1000}"
    problem = host_port_problem(fetch)
    if problem:
        raise bad_request(f"fetch {problem}", "fetch")
    await request.app[BROKER].add_member(Peer(pid, str(raft), str(http).rstrip("/"), fetch))
    return json_response({"status": "added", "id": pid}, status=201)


async def remove_member(request: web.Request) -> web.Response:
    forwarded = await forward_to_leader(request)
    if forwarded is not None:
        return forwarded
    return json_response(await request.app[BROKER].remove_member(path_int(request, "id")))


async def receive_removal(request: web.Request) -> web.Response:
    """The leader's signed notice that this node was removed (sent by the leader itself)."""
    body = await request.read()
    signature = request.headers.get(SIGNATURE_HEADER, "")
    return json_response(request.app[BROKER].receive_removal(body, signature))


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
    leader = broker.raftlog.leader_address()
    if leader is None:
        raise ApiError(
            503,
            "no_leader",
            "no leader is known yet; retry shortly",
            None,
            {"Retry-After": "1"},
            {"status": "no_leader"},
        )
    return json_response({"status": "ready", "leader": broker.node_id_of(leader)})


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
    r.add_post("/v1/topics/{topic}/messages", produce)
    r.add_get("/v1/topics/{topic}/queues/{queue}/messages", pull)
    r.add_get("/v1/topics", list_topics)
    r.add_get("/v1/topics/{topic}", describe_topic)
    r.add_put("/v1/topics/{topic}", create_topic)
    r.add_put("/v1/groups/{group}/offsets", put_offset)
    r.add_get("/v1/groups/{group}/offsets", get_offsets)
    r.add_get("/v1/admin/node", admin_node)
    r.add_get("/v1/admin/cluster", admin_cluster)
    r.add_get("/v1/admin/digest", admin_digest)
    r.add_get("/v1/admin/config", admin_config)
    r.add_patch("/v1/admin/config", admin_config_patch)
    r.add_post("/v1/admin/leadership/transfer", leadership_transfer)
    r.add_post("/v1/admin/members", add_member)
    r.add_delete("/v1/admin/members/{id}", remove_member)
    r.add_post("/v1/admin/node/removal", receive_removal)
    r.add_get("/healthz", healthz)
    r.add_get("/readyz", readyz)
    r.add_get("/metrics", metrics)
    r.add_get("/openapi.json", openapi)
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
            auth_middleware(broker.config.auth_token, metrics_public=broker.config.metrics_public),
            removed_middleware,
            guard.body,
        ],
    )
    app[BROKER] = broker
    app[METRICS] = Metrics()
    app[CONNECTIONS] = guard
    broker.connections = guard
    registry = app[METRICS].registry
    registry.register(_BoundsCollector(broker, guard))
    registry.register(_MembershipCollector(broker))
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
