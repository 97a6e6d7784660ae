"""Pop consumption over HTTP (RocketMQ 5's receive / ack / change invisible / DLQ): routes
that call :mod:`chronomq.cluster.node.popcalls`, as the gRPC endpoint does.

Every route is a write (a hand-out or an ack is a Raft command): a follower forwards it to the
leader, as produce does, and the gRPC endpoint of a follower forwards to these routes. On the
leader each call is one command of :class:`chronomq.pop.PopService`; a receive long-polls
(``wait_ms``): it waits for one of the topic's queues to grow or for a revived message, and
answers ``{"messages": []}`` when the time is up.

The answers carry everything a consumer needs: each message as a pull answers it, plus its
``receipt_handle``, ``delivery_attempt`` and ``invisible_until_ms``. A handle is tied to its
group: acking it under another group is refused naming ``receipt_handle``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson
from aiohttp import web

from chronomq.cluster.httpapi.base import (
    BROKER,
    client_gone,
    forward_to_leader,
    json_response,
    path_group,
)
from chronomq.cluster.node import models, reserved
from chronomq.cluster.node.popcalls import (
    ack,
    change_invisible,
    change_json,
    forward_to_dlq,
    popped_json,
    receive,
    receive_args,
)

# (method, path): (summary, request schema or None, 200 response schema, query parameters)
ROUTES: dict[tuple[str, str], tuple[str, Any, Any, list[str]]] = {
    ("POST", "/v1/groups/{group}/pop"): (
        "Receive up to max messages of a topic for the group (pop consumption): each is "
        "invisible to the group until acked or until invisible_ms passes, then handed out "
        "again with the next delivery_attempt; after max_reconsume_times re-deliveries it goes "
        "to %DLQ%{group}. wait_ms long-polls.",
        models.PopRequest,
        models.PopAnswer,
        [],
    ),
    ("POST", "/v1/groups/{group}/ack"): (
        "Ack received messages by their receipt handles: each answered acked, already_acked "
        "(a repeat) or expired (its hand-out is over: revived, re-handed or sent to the DLQ).",
        models.AckRequest,
        models.AckAnswer,
        [],
    ),
    ("POST", "/v1/groups/{group}/invisible"): (
        "Change a received message's invisible time (from now): changed, with a new receipt "
        "handle (the old one is stale from then on), or expired.",
        models.InvisibleRequest,
        models.InvisibleAnswer,
        [],
    ),
    ("POST", "/v1/groups/{group}/dlq"): (
        "Send a received message to %DLQ%{group} now: forwarded, or expired.",
        models.DlqRequest,
        models.DlqAnswer,
        [],
    ),
}


# ---------------------------------------------------------------------- HTTP handlers


def _on_leader(handler: Callable[[web.Request], Any]) -> Callable[[web.Request], Any]:
    async def run(request: web.Request) -> web.StreamResponse:
        if handler is pop_route:
            forwarded = await _forward_receive(request)
        else:
            forwarded = await forward_to_leader(request)
        if forwarded is not None:
            return forwarded
        result: web.StreamResponse = await handler(request)
        return result

    return run


async def _forward_receive(request: web.Request) -> web.Response | None:
    """A receive on a follower: checked here, then forwarded. One that waits goes on the
    poll lane (:meth:`PeerHttp.long_poll_slot`), with the wait still left once it has a
    slot; with none free within its wait it answers with no messages."""
    broker = request.app[BROKER]
    if broker.raftlog.is_leader:
        return None
    group = path_group(request)
    raw = await request.read()
    args = receive_args(models.decode(raw, models.PopRequest), int(broker.config.max_wait_ms))
    reserved.check_group_read(args.topic, group)
    commit_s = broker.config.commit_timeout_ms / 1000
    if args.wait_ms == 0:
        return await forward_to_leader(request, commit_s + 5)
    async with broker.peer_client.long_poll_slot(args.wait_ms / 1000) as left_s:
        if left_s is None:
            return json_response({"messages": []})
        body = orjson.loads(raw)
        body["wait_ms"] = int(left_s * 1000)
        return await forward_to_leader(
            request, left_s + commit_s + 5, body=orjson.dumps(body), lane="poll"
        )


async def pop_route(request: web.Request) -> web.Response:
    broker = request.app[BROKER]
    group = path_group(request)
    body = models.decode(await request.read(), models.PopRequest)
    args = receive_args(body, int(broker.config.max_wait_ms))
    reserved.check_group_read(args.topic, group)
    async with client_gone(request, args.wait_ms) as gone:
        popped = await receive(broker, group, args, gone)
    return json_response({"messages": [popped_json(p) for p in popped]})


async def ack_route(request: web.Request) -> web.Response:
    group = path_group(request)
    handles = models.decode(await request.read(), models.AckRequest).receipt_handles
    results = await ack(request.app[BROKER], group, handles)
    return json_response(
        {
            "results": [
                {"receipt_handle": r.receipt_handle, "status": r.status.value} for r in results
            ]
        }
    )


async def invisible_route(request: web.Request) -> web.Response:
    group = path_group(request)
    b = models.decode(await request.read(), models.InvisibleRequest)
    result = await change_invisible(
        request.app[BROKER], group, b.receipt_handle, b.invisible_ms, b.max_reconsume_times
    )
    return json_response(change_json(result))


async def dlq_route(request: web.Request) -> web.Response:
    group = path_group(request)
    b = models.decode(await request.read(), models.DlqRequest)
    result = await forward_to_dlq(request.app[BROKER], group, b.receipt_handle)
    return json_response({"status": result.status.value})


def add_routes(app: web.Application) -> None:
    """Register the routes of :data:`ROUTES`."""
    r = app.router
    r.add_post("/v1/groups/{group}/pop", _on_leader(pop_route))
    r.add_post("/v1/groups/{group}/ack", _on_leader(ack_route))
    r.add_post("/v1/groups/{group}/invisible", _on_leader(invisible_route))
    r.add_post("/v1/groups/{group}/dlq", _on_leader(dlq_route))
