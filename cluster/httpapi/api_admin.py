"""HTTP routes of the node's administration: its status, the cluster view and digest, runtime
config (read and change), leadership transfer, and membership (add, remove, the removal notice
a leader sends to the node it removed).

Changes are writes: a follower forwards them to the leader, which answers once the command is
applied (runtime config: once it is applied on this node too).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import msgspec
import orjson
from aiohttp import web

from chronomq.cluster.config.nodeconfig import Peer, host_port_problem, http_url_problem
from chronomq.cluster.httpapi.base import (
    BROKER,
    METRICS,
    RUNTIME_CONFIG,
    forward_to_leader,
    json_response,
    path_int,
    read_json,
)
from chronomq.cluster.node import models, runtimeconfig
from chronomq.cluster.node.broker import Broker
from chronomq.cluster.node.errors import ApiError, bad_request
from chronomq.cluster.node.runtimeconfig import RUNTIME_KEYS
from chronomq.raftlog.removal import SIGNATURE_HEADER
from chronomq.raftlog.transfer import TransferResult
from chronomq.raftlog.transfer_driver import DEFAULT_TIMEOUT_MS, MAX_TIMEOUT_MS, transfer_leadership

log = logging.getLogger(__name__)


async def admin_node(request: web.Request) -> web.Response:
    return json_response(request.app[BROKER].node_status())


async def admin_cluster(request: web.Request) -> web.Response:
    return json_response(await request.app[BROKER].cluster_view())


async def admin_read_index(request: web.Request) -> web.Response:
    """The leader's commit index, for a follower's read (cluster/node/readfence.py). Asked
    of a follower, it is the leader's answer, relayed like a write."""
    forwarded = await forward_to_leader(request, 5)
    if forwarded is not None:
        return forwarded
    return json_response(request.app[BROKER].read_index())


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


def add_routes(app: web.Application) -> None:
    r = app.router
    r.add_get("/v1/admin/node", admin_node)
    r.add_get("/v1/admin/cluster", admin_cluster)
    r.add_get("/v1/admin/digest", admin_digest)
    r.add_get("/v1/admin/read-index", admin_read_index)
    r.add_get("/v1/admin/config", admin_config)
    r.add_patch("/v1/admin/config", admin_config_patch)
    r.add_post("/v1/admin/leadership/transfer", leadership_transfer)
    r.add_post("/v1/admin/members", add_member)
    r.add_delete("/v1/admin/members/{id}", remove_member)
    r.add_post("/v1/admin/node/removal", receive_removal)
