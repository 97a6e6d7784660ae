"""HTTP routes that find things for an operator: a message by id or by key, the consumer groups.

Read on the node asked, from its own replica (a follower may lag the leader by its replication
lag); the searches are bounded and run off the event loop (see :mod:`chronomq.cluster.node.lookup`).
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from chronomq.cluster.httpapi.base import BROKER, int_param, json_response
from chronomq.cluster.node.errors import ApiError, bad_request
from chronomq.cluster.node.lookup import MAX_KEY_RESULTS, Finder, SearchExhausted, lookup_errors
from chronomq.cluster.node.offsets import GROUP_OFFSET_PREFIX
from chronomq.raftlog import record
from chronomq.schedule.retry import DLQ_TOPIC_PREFIX, RETRY_TOPIC_PREFIX

_PLACE = {
    "type": ["object", "null"],
    "properties": {
        "topic": {"type": "string"},
        "queue": {"type": "integer"},
        "offset": {"type": "integer"},
        "store_ms": {"type": "integer"},
    },
}
_FOUND = {
    "type": "object",
    "properties": {
        "msg_id": {"type": "string"},
        "kind": {"enum": ["plain", "level", "timer"]},
        "status": {"enum": ["stored", "waiting", "delivered", "cancelled", "unknown"]},
        "topic": {"type": "string", "description": "where it goes (the real topic)"},
        "queue": {"type": ["integer", "null"]},
        "keys": {"type": "array", "items": {"type": "string"}},
        "tags": {"type": ["string", "null"]},
        "delay_level": {"type": ["integer", "null"]},
        "due_ms": {"type": ["integer", "null"]},
        "stored": _PLACE,
        "delivered": _PLACE,
        "delivered_ms": {"type": ["integer", "null"]},
    },
}
_GROUP_QUEUE = {
    "type": "object",
    "properties": {
        "topic": {"type": "string"},
        "queue": {"type": "integer"},
        "offset": {"type": "integer"},
        "max_offset": {"type": "integer"},
        "lag": {"type": "integer"},
    },
}
_SIDE_TOPIC = {
    "type": "object",
    "properties": {
        "topic": {"type": "string"},
        "exists": {"type": "boolean"},
        "messages": {"type": "integer"},
    },
}

# (method, path): (summary, request schema or None, 200 response schema, query parameters)
ROUTES: dict[tuple[str, str], tuple[str, Any, Any, list[str]]] = {
    ("GET", "/v1/messages/{msg_id}"): (
        "Find a message by the msg_id its produce returned: its kind (plain, level, timer), "
        "status (stored, waiting, delivered, cancelled; unknown when a timer's slot cannot "
        "tell), where it is stored, when it is due and where and when it was delivered. "
        "topic narrows the search. 404 unknown_message when not found; the search reads at "
        "most 50,000 records (see the web console's Messages view).",
        None,
        _FOUND,
        ["topic"],
    ),
    ("GET", "/v1/topics/{topic}/messages"): (
        "Find the messages of a topic carrying key (delayed ones bound for it included), "
        "newest first, at most max (default 20, at most 50), each as GET /v1/messages/{msg_id} "
        "answers; complete is false when the bounded scan stopped first.",
        None,
        {
            "type": "object",
            "properties": {
                "topic": {"type": "string"},
                "key": {"type": "string"},
                "messages": {"type": "array", "items": _FOUND},
                "truncated": {"type": "boolean"},
                "complete": {"type": "boolean"},
                "reads": {"type": "integer"},
            },
        },
        ["key", "max"],
    ),
    ("GET", "/v1/groups"): (
        "Consumer groups in name order (those with committed offsets or a retry or DLQ "
        "topic), a page of at most limit (default and most: max_topics_listed) after the "
        "group named by after: committed offset, max offset and lag per queue, total lag, "
        "and the group's retry and DLQ topics.",
        None,
        {
            "type": "object",
            "properties": {
                "groups": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "group": {"type": "string"},
                            "queues": {"type": "array", "items": _GROUP_QUEUE},
                            "lag": {"type": "integer"},
                            "retry": _SIDE_TOPIC,
                            "dlq": _SIDE_TOPIC,
                        },
                    },
                },
                "truncated": {"type": "boolean"},
                "next_after": {"type": ["string", "null"]},
            },
        },
        ["after", "limit"],
    ),
}


def _finder(request: web.Request) -> Finder:
    broker = request.app[BROKER]
    schedule, timer = broker.schedule, broker.timer
    return Finder(
        broker.raftlog.store,
        level_offset=schedule.offset if schedule is not None else None,
        timer_locate=timer.locate if timer is not None else None,
    )


async def _search(request: web.Request, fn: Any, *args: Any) -> Any:
    try:
        return await asyncio.to_thread(fn, *args)
    except SearchExhausted:
        raise ApiError(
            422,
            "search_too_long",
            "the search read its limit of records without an answer; give the topic",
            "topic",
        ) from None
    except lookup_errors() as exc:
        raise ApiError(
            503,
            "store_changing",
            f"the store changed under the search ({exc}); retry",
            None,
            {"Retry-After": "1"},
        ) from None


async def get_message(request: web.Request) -> web.Response:
    msg_id = record.parse_msg_id(request.match_info["msg_id"], "msg_id")
    topic = request.query.get("topic") or None
    broker = request.app[BROKER]
    if topic is not None:
        record.validate_topic(topic, "topic")
        await broker.ensure_topic(topic)  # a follower's 404 holds every acknowledged write
        broker.queue_count(topic)  # 404 unknown_topic
    found = await _search(request, _finder(request).by_id, msg_id, topic)
    if found is None and not broker.raftlog.is_leader:
        # Not here yet, maybe: once this follower holds every write acknowledged before now.
        await broker.read_fence.wait()
        found = await _search(request, _finder(request).by_id, msg_id, topic)
    if found is None:
        where = f"topic {topic}" if topic else "any topic"
        raise ApiError(
            404,
            "unknown_message",
            f"no message {record.msg_id_hex(msg_id)} in {where} on this node",
            "msg_id",
        )
    return json_response(found)


async def messages_by_key(request: web.Request) -> web.Response:
    topic = request.match_info["topic"]
    broker = request.app[BROKER]
    await broker.ensure_topic(topic)  # a follower's 404 holds every acknowledged write
    broker.queue_count(topic)  # 404 unknown_topic
    key = request.query.get("key")
    if not key:
        raise bad_request("query parameter key is required", "key")
    if len(key) > 256 or " " in key:
        raise bad_request("key must be 1 to 256 characters without spaces", "key")
    limit = int_param(request, "max", 20, 1, MAX_KEY_RESULTS)
    if not broker.raftlog.is_leader:
        await broker.read_fence.wait()  # the answer holds every write acknowledged before now
    return json_response(await _search(request, _finder(request).by_key, topic, key, limit))


def _side(topics: dict[str, list[int]], name: str) -> dict[str, Any]:
    queues = topics.get(name)
    return {"topic": name, "exists": queues is not None, "messages": sum(queues or [])}


async def list_groups(request: web.Request) -> web.Response:
    broker = request.app[BROKER]
    cap = broker.config.max_topics_listed
    limit = int_param(request, "limit", cap, 1, cap)
    after = request.query.get("after", "")
    store = broker.raftlog.store
    topics = dict(store.topics.items())  # the Raft thread adds topics: copy
    offsets: dict[str, list[tuple[str, int, int]]] = {}
    for key, value in list(store.kv.items()):
        if not key.startswith(GROUP_OFFSET_PREFIX) or not isinstance(value, int):
            continue
        group, _, rest = key[len(GROUP_OFFSET_PREFIX) :].partition("/")
        topic, _, queue = rest.rpartition("/")
        if group > after and queue.isdigit():
            offsets.setdefault(group, []).append((topic, int(queue), value))
    for name in topics:
        for prefix in (RETRY_TOPIC_PREFIX, DLQ_TOPIC_PREFIX):
            if name.startswith(prefix) and name[len(prefix) :] > after:
                offsets.setdefault(name[len(prefix) :], [])
    names = sorted(offsets)
    page = names[:limit]
    groups = []
    for group in page:
        rows: list[dict[str, Any]] = []
        for topic, q, offset in sorted(offsets[group]):
            high = store.max_offset(topic, q) if q < len(topics.get(topic, [])) else 0
            rows.append(
                {
                    "topic": topic,
                    "queue": q,
                    "offset": offset,
                    "max_offset": high,
                    "lag": max(0, high - offset),
                }
            )
        groups.append(
            {
                "group": group,
                "queues": rows,
                "lag": sum(r["lag"] for r in rows),
                "retry": _side(topics, RETRY_TOPIC_PREFIX + group),
                "dlq": _side(topics, DLQ_TOPIC_PREFIX + group),
            }
        )
    truncated = len(names) > limit
    return json_response(
        {"groups": groups, "truncated": truncated, "next_after": page[-1] if truncated else None}
    )


def add_routes(app: web.Application) -> None:
    """Register the routes of :data:`ROUTES`."""
    r = app.router
    r.add_get("/v1/messages/{msg_id}", get_message)
    r.add_get("/v1/topics/{topic}/messages", messages_by_key)
    r.add_get("/v1/groups", list_groups)
