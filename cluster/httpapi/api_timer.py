"""HTTP routes of the timer service (arbitrary-time messages) and its metrics.

Cancel and the runtime switches are writes: a follower forwards them to the leader, which
answers from the apply of the command it proposed. ``/v1/admin/timer`` is this node's view
(any node). ``/v1/admin/timer/log`` serves raw TimerLog records to a peer that installed a
snapshot and must complete its own TimerLog (see :mod:`chronomq.timer.files`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from typing import Any

import msgspec
from aiohttp import web
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from chronomq.cluster.httpapi.base import (
    BROKER,
    METRICS,
    forward_to_leader,
    int_param,
    json_response,
)
from chronomq.cluster.node import models
from chronomq.cluster.node.errors import ApiError, bad_request
from chronomq.timer.errors import TimerStateError

log = logging.getLogger(__name__)

_STATS = {"type": "object", "description": "see the timer page of the docs"}

# (method, path): (summary, request schema or None, 200 response schema, query parameters)
ROUTES: dict[tuple[str, str], tuple[str, Any, Any, list[str]]] = {
    ("DELETE", "/v1/timers/{msg_id}"): (
        "Cancel a timer message by the msg_id its produce returned: cancelled, delivered or "
        "unknown. A cancel answered 'cancelled' is never delivered.",
        None,
        {
            "type": "object",
            "required": ["status"],
            "properties": {
                "msg_id": {"type": "string"},
                "status": {"enum": ["cancelled", "delivered", "unknown"]},
                "reason": {"type": "string"},
                "deliver_ms": {"type": "integer"},
            },
        },
        [],
    ),
    ("GET", "/v1/admin/timer"): (
        "Timer state on this node: backlog (total, per topic), read-behind ms, offset-behind, "
        "congestion, enqueue/dequeue rates, checkpoint, switches, takeover time.",
        None,
        _STATS,
        [],
    ),
    ("GET", "/v1/admin/timer/histogram"): (
        "What falls due in the next minutes (default 60, at most 60) in buckets equal buckets "
        "(default 60, at most 120), from this node's wheel: messages and cancels per bucket, "
        "and the overdue messages in slots the read cursor has not passed yet.",
        None,
        {
            "type": "object",
            "properties": {
                "from_ms": {"type": "integer"},
                "to_ms": {"type": "integer"},
                "bucket_ms": {"type": "integer"},
                "precision_ms": {"type": "integer"},
                "total": {"type": "integer"},
                "buckets": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "start_ms": {"type": "integer"},
                            "messages": {"type": "integer"},
                            "cancels": {"type": "integer"},
                        },
                    },
                },
                "overdue": {
                    "type": "object",
                    "properties": {
                        "messages": {"type": "integer"},
                        "from_ms": {"type": ["integer", "null"]},
                        "complete": {"type": "boolean"},
                    },
                },
            },
        },
        ["minutes", "buckets"],
    ),
    ("POST", "/v1/admin/timer/switches"): (
        "Stop or start timer enqueue and delivery cluster-wide (replicated).",
        models.TimerSwitches,
        {"type": "object"},
        [],
    ),
    ("GET", "/v1/admin/timer/log"): (
        "Raw TimerLog records [from, to) for a peer completing its TimerLog (internal).",
        None,
        {"type": "string", "format": "binary"},
        ["from", "to"],
    ),
}


def _service(request: web.Request) -> Any:
    service = request.app[BROKER].timer
    if service is None:
        raise ApiError(503, "timer_unavailable", "the timer service is not running on this node")
    return service


async def cancel_timer(request: web.Request) -> web.Response:
    forwarded = await forward_to_leader(request)
    if forwarded is not None:
        return forwarded
    return json_response(await _service(request).cancel(request.match_info["msg_id"]))


async def timer_admin(request: web.Request) -> web.Response:
    return json_response(_service(request).stats())


async def timer_histogram(request: web.Request) -> web.Response:
    minutes = int_param(request, "minutes", 60, 1, 60)
    buckets = int_param(request, "buckets", 60, 1, 120)
    service = _service(request)
    try:
        answer = await asyncio.to_thread(service.due_histogram, minutes * 60_000, buckets)
    except TimerStateError as exc:  # the files are being realigned right now
        raise ApiError(503, "timer_unavailable", str(exc), None, {"Retry-After": "1"}) from None
    return json_response(answer)


def _switch_changes(raw: bytes) -> dict[str, bool]:
    switches = models.decode(raw, models.TimerSwitches)
    return {
        name: value
        for name in ("stop_enqueue", "stop_dequeue")
        if (value := getattr(switches, name)) is not msgspec.UNSET
    }


async def timer_switches(request: web.Request) -> web.Response:
    forwarded = await forward_to_leader(request)
    if forwarded is not None:
        return forwarded
    changes = _switch_changes(await request.read())
    service = _service(request)
    return json_response({"switches": await service.set_switches(**changes)})


def _position(request: web.Request, name: str) -> int:
    raw = request.query.get(name)
    if raw is None or not (raw.isascii() and raw.isdigit()) or len(raw) > 18:
        raise bad_request(f"{name} must be a non-negative integer", name)
    return int(raw)


async def timer_log(request: web.Request) -> web.Response:
    service = _service(request)
    start, end = _position(request, "from"), _position(request, "to")
    if end < start:
        raise bad_request("to must not be below from", "to")
    try:
        data, nxt = await asyncio.to_thread(service.read_log, start, end)
    except TimerStateError as exc:
        raise ApiError(409, "timerlog_unavailable", str(exc), "to") from None
    return web.Response(
        body=data, content_type="application/octet-stream", headers={"X-Timer-Next": str(nxt)}
    )


def add_routes(app: web.Application) -> None:
    """Register the routes of :data:`ROUTES`."""
    r = app.router
    r.add_delete("/v1/timers/{msg_id}", cancel_timer)
    r.add_get("/v1/admin/timer", timer_admin)
    r.add_get("/v1/admin/timer/histogram", timer_histogram)
    r.add_post("/v1/admin/timer/switches", timer_switches)
    r.add_get("/v1/admin/timer/log", timer_log)


# ---------------------------------------------------------------------- metrics


class _TimerCollector:
    """The timer's gauges and counters, read on every scrape."""

    def __init__(self, app: web.Application) -> None:
        self._app = app

    def collect(self) -> Iterator[Metric]:
        service = self._app[BROKER].timer
        if service is None:
            return
        st = service.stats()
        for name, doc, value in (
            ("active", "1 while this node drives the timer", 1 if st["active"] else 0),
            ("backlog", "Messages waiting in the wheel", st["backlog"]["total"]),
            (
                "read_behind_seconds",
                "How far the read cursor is behind now",
                st["read_behind_ms"] / 1000,
            ),
            (
                "offset_behind",
                "Timer-topic messages not yet put into the wheel",
                st["offset_behind"],
            ),
            (
                "enqueue_per_second",
                "Messages enqueued per second",
                st["rates"]["enqueue_per_s"],
            ),
            (
                "dequeue_per_second",
                "Messages delivered per second",
                st["rates"]["dequeue_per_s"],
            ),
            (
                "inflight_commands",
                "Timer commands proposed, not settled",
                st["inflight_commands"],
            ),
        ):
            yield GaugeMetricFamily(f"chronomq_timer_{name}", doc, value=value)
        yield CounterMetricFamily(
            "chronomq_timer_rejected",
            "Produces refused for a congested slot, on this node since start",
            value=st["congestion"]["rejected"],
        )
        totals = CounterMetricFamily(
            "chronomq_timer_messages",
            "Running totals of the timer (replicated: the same on every node)",
            labels=["event"],
        )
        for event, value in st["totals"].items():
            totals.add_metric([event], value)
        yield totals
        by_topic = GaugeMetricFamily(
            "chronomq_timer_backlog_by_topic",
            "Messages waiting in the wheel per real topic (largest 50)",
            labels=["topic"],
        )
        top = sorted(st["backlog"]["by_topic"].items(), key=lambda kv: -kv[1])[:50]
        for topic, value in top:
            by_topic.add_metric([topic], value)
        yield by_topic


def install_metrics(app: web.Application) -> None:
    """Add the service's Prometheus metrics to the app's registry. (``timer_stop_enqueue`` and
    ``timer_stop_dequeue`` in ``PATCH /v1/admin/config`` are these switches:
    :mod:`chronomq.cluster.node.runtimeconfig`.)"""
    app[METRICS].registry.register(_TimerCollector(app))
