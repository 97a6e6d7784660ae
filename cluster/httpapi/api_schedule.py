"""HTTP routes of the schedule service (delay levels) and consumer retry.

- ``GET /v1/admin/schedule``: per level delay, offset, max offset, backlog, oldest-due lag,
  pending, blocked; the mode and whether delivery is paused; ``loops``, the leader-only loops
  this node runs (schedule levels, timer driver: 0 on a follower), their term and how many
  were started and stopped. Any node answers from its replicated state; pending counts are
  the leader's.
- ``PATCH /v1/admin/schedule`` ``{"mode": "sync"|"async", "paused": bool}``: cluster-wide, through
  Raft, so a new leader keeps the setting.
- ``POST /v1/groups/{group}/retry`` ``{"topic", "queue", "offset", "delay_level"?}``: send a
  consumed message back (seed 001): ``%RETRY%{group}`` at level 3 + reconsume times, or the
  group's DLQ once ``max_reconsume_times`` is reached.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from aiohttp import web
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from chronomq.cluster.httpapi.base import BROKER, METRICS, forward_to_leader, json_response
from chronomq.cluster.node import models
from chronomq.cluster.node.errors import ApiError, bad_request

_LEVELS = {"type": "array", "items": {"type": "object"}}
_LOOPS = {
    "type": "object",
    "description": "Leader-only loops running on this node (0 on a follower): they run for one "
    "confirmed term and all stop before the next term's start.",
    "properties": {
        "running": {"type": "integer", "description": "Loops running now"},
        "schedule_levels": {"type": "integer", "description": "Schedule level loops running"},
        "timer_driver": {"type": "integer", "description": "1 while the timer driver runs"},
        "term": {
            "type": ["integer", "null"],
            "description": "The term the loops run for (null when none runs)",
        },
        "started": {"type": "integer", "description": "Loops started since the node started"},
        "stopped": {"type": "integer", "description": "Loops stopped since the node started"},
        "terms_started": {"type": "integer", "description": "Terms whose work was started"},
        "stopping": {"type": "boolean", "description": "A term's work is being stopped"},
        "stuck": {
            "type": "array",
            "items": {"type": "string"},
            "description": "Work that did not stop within the bound (the next term waits)",
        },
        "by_work": {"type": "object", "additionalProperties": {"type": "integer"}},
    },
}

# (method, path): (summary, request schema or None, 200 response schema, query parameters)
ROUTES: dict[tuple[str, str], tuple[str, Any, Any, list[str]]] = {
    ("GET", "/v1/admin/schedule"): (
        "Delay levels: per level delay, offset, max offset, backlog, oldest-due lag ms, "
        "pending, blocked; the delivery mode and pause switch; the leader-only loops running "
        "on this node.",
        None,
        {
            "type": "object",
            "properties": {
                "running": {"type": "boolean"},
                "mode": {"type": "string", "enum": ["sync", "async"]},
                "paused": {"type": "boolean"},
                "term": {"type": ["integer", "null"]},
                "levels": _LEVELS,
                "loops": _LOOPS,
            },
        },
        [],
    ),
    ("PATCH", "/v1/admin/schedule"): (
        "Switch the delivery mode (sync or async) or pause delivery, cluster-wide.",
        models.ScheduleControls,
        {"type": "object"},
        [],
    ),
    ("POST", "/v1/groups/{group}/retry"): (
        "Send a consumed message back for redelivery through the delay levels "
        "(%RETRY%{group}, then %DLQ%{group} after max_reconsume_times).",
        models.RetryRequest,
        {
            "type": "object",
            "properties": {
                "target": {"type": "string", "enum": ["retry", "dlq"]},
                "topic": {"type": "string"},
                "msg_id": {"type": "string"},
                "reconsume_times": {"type": "integer"},
                "delay_level": {"type": "integer"},
                "deliver_ms": {"type": "integer"},
            },
        },
        [],
    ),
}


def _service(request: web.Request) -> Any:
    service = request.app[BROKER].schedule
    if service is None:
        raise ApiError(503, "schedule_unavailable", "the schedule service is not running", None)
    return service


async def get_schedule(request: web.Request) -> web.Response:
    return json_response(_service(request).stats())


async def patch_schedule(request: web.Request) -> web.Response:
    forwarded = await forward_to_leader(request)
    if forwarded is not None:
        return forwarded
    controls = models.decode(await request.read(), models.ScheduleControls)
    mode, paused = models.unset_to_none(controls.mode), models.unset_to_none(controls.paused)
    if mode is None and paused is None:
        raise bad_request('the body must be an object such as {"mode": "async"}', "body")
    service = _service(request)
    await request.app[BROKER].commit(service.set_controls(mode=mode, paused=paused))
    return json_response(service.stats())


async def retry(request: web.Request) -> web.Response:
    forwarded = await forward_to_leader(request)
    if forwarded is not None:
        return forwarded
    body = models.decode(await request.read(), models.RetryRequest)
    answer = await request.app[BROKER].send_back(
        request.match_info["group"], body.topic, body.queue, body.offset, body.delay_level
    )
    return json_response(answer)


def add_routes(app: web.Application) -> None:
    """Register the routes of :data:`ROUTES`."""
    r = app.router
    r.add_get("/v1/admin/schedule", get_schedule)
    r.add_patch("/v1/admin/schedule", patch_schedule)
    r.add_post("/v1/groups/{group}/retry", retry)


_LEVEL_GAUGES = (
    ("offset", "offset", 1, "Delivered up to this queue offset (replicated)"),
    ("max_offset", "max_offset", 1, "Messages stored in the level's queue"),
    ("backlog", "backlog", 1, "Messages waiting in the level (due or not)"),
    (
        "oldest_due_lag_seconds",
        "oldest_due_lag_ms",
        1000,
        "How long the oldest due message of the level has been due",
    ),
    ("pending", "pending", 1, "Async deliveries in flight"),
    ("blocked", "blocked", 1, "1 when a failing message blocks the level"),
)
"""(metric suffix, field of the admin view, divisor to the metric's unit, help) per level."""
_LEVEL_COUNTERS = (
    ("delivered", "delivered", "Messages delivered by this node while leader"),
    ("failures", "failures", "Failed delivery attempts on this node"),
)


class _ScheduleCollector:
    """Per-level gauges and counters, and the leader-only loops, read on every scrape."""

    def __init__(self, app: web.Application) -> None:
        self._app = app

    def collect(self) -> Iterator[Metric]:
        service = self._app[BROKER].schedule
        if service is None:
            return
        stats = service.stats()
        view = stats["loops"]
        loops = GaugeMetricFamily(
            "chronomq_leader_loops",
            "Leader-only loops running on this node (schedule levels, timer driver)",
            labels=["work"],
        )
        loops.add_metric(["schedule"], view["schedule_levels"])
        loops.add_metric(["timer"], view["timer_driver"])
        yield loops
        yield GaugeMetricFamily(
            "chronomq_leader_loops_term",
            "The term the leader-only loops run for (0: none)",
            value=view["term"] or 0,
        )
        yield CounterMetricFamily(
            "chronomq_leader_loops_started",
            "Leader-only loops started since start",
            value=view["started"],
        )
        yield CounterMetricFamily(
            "chronomq_leader_loops_stopped",
            "Leader-only loops stopped since start",
            value=view["stopped"],
        )
        yield GaugeMetricFamily(
            "chronomq_leader_loops_stuck",
            "Leader-only work that did not stop within its bound",
            value=len(view["stuck"]),
        )
        yield GaugeMetricFamily(
            "chronomq_schedule_running",
            "1 while this node delivers",
            value=1 if stats["running"] else 0,
        )
        yield GaugeMetricFamily(
            "chronomq_schedule_async",
            "1 in async mode, 0 in sync",
            value=1 if stats["mode"] == "async" else 0,
        )
        rows = stats["levels"]
        for name, field, divisor, doc in _LEVEL_GAUGES:
            gauge = GaugeMetricFamily(f"chronomq_schedule_{name}", doc, labels=["level"])
            for row in rows:
                gauge.add_metric([str(row["level"])], float(row[field]) / divisor)
            yield gauge
        for name, field, doc in _LEVEL_COUNTERS:
            counter = CounterMetricFamily(f"chronomq_schedule_{name}", doc, labels=["level"])
            for row in rows:
                counter.add_metric([str(row["level"])], float(row[field]))
            yield counter


def install_metrics(app: web.Application) -> None:
    """The schedule's metrics on the app's registry, read on every scrape of ``/metrics``."""
    app[METRICS].registry.register(_ScheduleCollector(app))
