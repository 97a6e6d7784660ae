"""HTTP routes of the data plane: produce, pull, topics (list, describe, create) and
consumer-group offsets.

Produce, topic creation and offset commits are writes: a follower forwards them to the leader
(:func:`chronomq.cluster.httpapi.base.forward_to_leader`). A pull is answered by the node asked,
from its own replica, and may long-poll (``wait_ms``).
"""

from __future__ import annotations

import msgspec
from aiohttp import web

from chronomq.cluster.httpapi.base import (
    BROKER,
    METRICS,
    client_gone,
    forward_to_leader,
    int_param,
    json_response,
    path_group,
    path_int,
)
from chronomq.cluster.node import models, reserved
from chronomq.cluster.node.errors import ApiError, bad_request
from chronomq.raftlog import record


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
    broker = request.app[BROKER]
    topic = request.match_info["topic"]
    await broker.ensure_topic(topic)  # a follower's 404 is true after every acknowledged write
    return json_response(broker.describe_topic(topic))


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
    group = path_group(request)
    body = models.decode(await request.read(), models.OffsetCommit)
    topic, queue, offset = body.topic, body.queue, body.offset
    broker.queue_count(topic)  # 404 for an unknown topic
    broker.check_queue(topic, queue)
    await broker.commit_offset(group, topic, queue, offset)
    return json_response({"group": group, "topic": topic, "queue": queue, "offset": offset})


async def get_offsets(request: web.Request) -> web.Response:
    # Offsets are read where they are written: a follower may not have applied the latest
    # commit, and a consumer resuming from a stale offset would see messages twice.
    forwarded = await forward_to_leader(request)
    if forwarded is not None:
        return forwarded
    broker = request.app[BROKER]
    group = path_group(request)
    return json_response(
        {"group": group, "offsets": broker.group_offsets(group, request.query.get("topic"))}
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
