"""The OpenAPI description served at ``/openapi.json``.

One entry per route; ``tests/cluster/test_openapi.py`` fails when a route is added or removed
without this table following.
"""

from __future__ import annotations

from typing import Any

import msgspec

from chronomq.cluster.httpapi import api_console, api_lookup, api_pop, api_schedule, api_timer
from chronomq.cluster.node import models, runtimeconfig
from chronomq.cluster.node.auth import METRICS_ROUTE, open_routes
from chronomq.version import VERSION

_ERROR: Any = models.Error


def _object(**fields: str) -> dict[str, Any]:
    """An answer's object schema from field names and their JSON types."""
    return {"type": "object", "properties": {k: {"type": t} for k, t in fields.items()}}


_TRANSFER_FIELDS: dict[str, Any] = {
    "from": {"type": "integer", "description": "the node that led"},
    "to": {"type": "integer", "description": "the target"},
    "term": {"type": "integer", "description": "the term of the node that leads now"},
    "waited_ms": {"type": "integer", "description": "from the request to the answer"},
    "catch_up_ms": {
        "type": ["integer", "null"],
        "description": "from the request until TimeoutNow was sent (null: it was not)",
    },
    "held_ms": {"type": "integer", "description": "how long the leader held its writes"},
    "attempts": {"type": "integer"},
}
_TRANSFERRED = {
    "type": "object",
    "properties": {
        "status": {"enum": ["transferred", "already_leader"]},
        "leader": {"type": "integer", "description": "the node that leads now"},
        "leader_url": {"type": "string"},
        **_TRANSFER_FIELDS,
        "message": {"type": "string"},
    },
}
_ERROR_FIELDS: dict[str, Any] = models.schemas([models.Error])[1]["Error"]["properties"]
_TRANSFER_REFUSED = {
    "type": "object",
    "required": ["error", "message", "field", "reason"],
    "properties": {
        **_ERROR_FIELDS,
        "reason": {
            "enum": [
                "target_not_member",
                "target_unreachable",
                "no_target",
                "not_caught_up",
                "election_lost",
                "in_progress",
                "timeout",
            ]
        },
        "leader": {"type": ["string", "null"], "description": "the leader's URL"},
        "leader_id": {"type": ["integer", "null"]},
        "leader_url": {"type": ["string", "null"]},
        **_TRANSFER_FIELDS,
    },
}
# Answers besides 200 that a route documents one by one: (method, path) -> status -> (what, schema).
_MORE_ANSWERS: dict[tuple[str, str], dict[str, tuple[str, Any]]] = {
    ("POST", "/v1/admin/leadership/transfer"): {
        "409": (
            "not moved: target_not_member, target_unreachable, transfer_refused (reason says "
            "why) or transfer_in_progress",
            _TRANSFER_REFUSED,
        ),
        "504": ("transfer_timeout: the leadership did not move in time", _TRANSFER_REFUSED),
    },
}

# (method, path): (summary, request schema or None, 200 response schema, query parameters)
_CORE: dict[tuple[str, str], tuple[str, Any, Any, list[str]]] = {
    ("POST", "/v1/topics/{topic}/messages"): (
        "Produce messages (any node; followers forward to the leader). Optional "
        "Idempotency-Key header, scoped to the topic: a replay within idempotency_window_s "
        "answers the first placement, the same key with another request 422 "
        "idempotency_key_reused. A message with a message_id (the id RocketMQ consumers see) is "
        "sent alone and its id is the key. System topics and reserved property names (UNIQ_KEY "
        "among them) answer 400.",
        models.ProduceRequest,
        models.Produced,
        [],
    ),
    ("GET", "/v1/topics/{topic}/queues/{queue}/messages"): (
        "Pull messages from a queue, long-polling up to wait_ms. With prev, the msg_id read "
        "at offset - 1, the log is checked to still hold it there: 409 offset_diverged "
        "(naming prev, with max_offset and min_offset) when it does not, which happens only "
        "after every node lost power under flush = async and the lost offsets were written "
        "again; read again from the first offset whose message differs from what was read.",
        None,
        models.Pulled,
        ["offset", "max", "wait_ms", "prev"],
    ),
    ("GET", "/v1/topics"): (
        "List topics in name order with their number of queues and messages, a page of at "
        "most max_topics_listed (or limit) after the topic named by after; truncated: true "
        "when more follow, from next_after.",
        None,
        models.Topics,
        ["after", "limit"],
    ),
    ("GET", "/v1/topics/{topic}"): (
        "Describe a topic: queues with min and max offsets.",
        None,
        models.Topic,
        [],
    ),
    ("PUT", "/v1/topics/{topic}"): (
        "Create a topic with a number of queues (201; 200 if it exists with as many, 409 if "
        "with another number).",
        models.CreateTopic,
        models.Topic,
        [],
    ),
    ("PUT", "/v1/groups/{group}/offsets"): (
        "Commit a consumer group's offset (replicated).",
        models.OffsetCommit,
        models.OffsetCommitted,
        [],
    ),
    ("GET", "/v1/groups/{group}/offsets"): (
        "A consumer group's committed offsets, read on the leader.",
        None,
        models.GroupOffsets,
        ["topic"],
    ),
    ("GET", "/v1/admin/node"): (
        "This node's role, term, indexes, digest and version.",
        None,
        models.NodeStatus,
        [],
    ),
    ("GET", "/v1/admin/cluster"): (
        "The cluster view aggregated from every node (each as /v1/admin/node, with "
        "replication_lag), the leader changes the node asked has seen (the last 100), and the "
        "replicated membership history (the last 100 changes, identical on every node).",
        None,
        models.ClusterView,
        [],
    ),
    ("GET", "/v1/admin/digest"): (
        "CommitLog length and hash chain, to compare replicas.",
        None,
        models.Digest,
        [],
    ),
    ("GET", "/v1/admin/read-index"): (
        "On the leader, while its lease holds: its commit index, which a follower applies up "
        "to before it answers a read with no such topic or an empty page. A follower relays "
        "the leader's answer.",
        None,
        models.ReadIndex,
        [],
    ),
    ("GET", "/v1/admin/config"): (
        "This node's effective config (secrets masked): its file's, overlaid with the runtime "
        "values the cluster has replicated (listed in runtime; the same on every node).",
        None,
        runtimeconfig.answer_schema(patch=False),
        [],
    ),
    ("PATCH", "/v1/admin/config"): (
        "Change runtime keys cluster-wide: {key: value, ...}, committed through the leader; "
        "answers once applied on the node asked. enable_schedule_async_deliver is the "
        "schedule's mode, timer_stop_* the timer's switches.",
        runtimeconfig.patch_schema(),
        runtimeconfig.answer_schema(patch=True),
        [],
    ),
    ("POST", "/v1/admin/leadership/transfer"): (
        "Hand the leadership to node `to` (any member, runtime-added ones too; without it the "
        "most caught-up follower) and answer once it has moved: the leader waits, at most "
        "timeout_ms (default 5000, at most 60000), for the target to come within a few entries, "
        "holds its own writes (at most the election timeout; they wait, and go to the new "
        "leader) until the target has every entry, and sends it TimeoutNow. 200 transferred "
        "(or already_leader when `to` is the leader); 400 unknown_member (no member has "
        "that id); 409 target_not_member, target_unreachable, transfer_refused (reason "
        "not_caught_up, election_lost or no_target) or transfer_in_progress; 504 "
        "transfer_timeout. A follower forwards to the leader.",
        models.TransferRequest,
        _TRANSFERRED,
        [],
    ),
    ("POST", "/v1/admin/members"): (
        "Add a member: id, raft (host:port), http (URL), optional fetch (host:port); answers 201.",
        models.AddMember,
        models.MemberAdded,
        [],
    ),
    ("DELETE", "/v1/admin/members/{id}"): (
        "Remove a member, this node or the leader included: the leader hands its leadership "
        "over first (409 leader_not_handed_over when no member could take it), and the new "
        "leader removes it. The removed node is told, answers 410 removed_from_cluster and "
        "stops campaigning until it is added back.",
        None,
        _object(status="string", id="integer", leader="integer"),
        [],
    ),
    ("POST", "/v1/admin/node/removal"): (
        "Sent by the leader to a node it removed: the removal notice, signed with the cluster "
        "secret (X-Chronomq-Signature); 409 notice_refused when it does not hold.",
        {"type": "object"},
        _object(status="string", removal="object"),
        [],
    ),
    ("GET", "/healthz"): (
        "200 while the process serves (removed_from_cluster says whether it was removed, "
        "auth_required whether the other routes need the bearer token).",
        None,
        _object(status="string", removed_from_cluster="boolean", auth_required="boolean"),
        [],
    ),
    ("GET", "/readyz"): (
        "200 while a write sent to this node can commit: it leads with a quorum of "
        "acknowledgements within the lease, or it hears from a leader that does; else 503 "
        "no_leader saying why; 410 on a node removed from the cluster.",
        None,
        models.Ready,
        [],
    ),
    ("GET", "/metrics"): ("Prometheus metrics.", None, {"type": "string"}, []),
    ("GET", "/openapi.json"): ("This description.", None, {"type": "object"}, []),
}
ROUTES = {
    **_CORE,
    **api_lookup.ROUTES,
    **api_schedule.ROUTES,
    **api_timer.ROUTES,
    **api_pop.ROUTES,
    **api_console.ROUTES,
}


BEARER = "bearerAuth"
_SECURITY_SCHEMES = {
    BEARER: {
        "type": "http",
        "scheme": "bearer",
        "description": "The node's auth_token, when set: every route needs it but the probes "
        "(/healthz, /readyz) and, with metrics_public, /metrics.",
    }
}


_QUERY: dict[str, dict[str, Any]] = {
    # Bounds that depend on the node's config (max_pull_messages, max_wait_ms,
    # max_topics_listed) are checked by the handler and answered 400 naming the parameter.
    "topic": {"type": "string"},
    "after": {"type": "string"},
    "key": {"type": "string"},
    "prev": {"type": "string", "pattern": "^[0-9A-Fa-f]{32}$"},
    "max": {"type": "integer", "minimum": 1},
    "limit": {"type": "integer", "minimum": 1},
    "minutes": {"type": "integer", "minimum": 1, "maximum": 60},
    "buckets": {"type": "integer", "minimum": 1, "maximum": 120},
}
"""Query parameters' schemas; any other is a non-negative integer."""


def _is_model(schema: Any) -> bool:
    return isinstance(schema, type) and issubclass(schema, msgspec.Struct)


def spec(metrics_public: bool = False, auth_required: bool = True) -> dict[str, Any]:
    """The description; ``metrics_public`` and ``auth_required`` (an ``auth_token`` is set)
    as the node serving it is configured. Request and answer schemas come from the models of
    :mod:`chronomq.cluster.node.models`, under ``components.schemas``."""
    exempt = set(open_routes(metrics_public))
    found = [_ERROR]
    for _, request, response, _ in ROUTES.values():
        found += [s for s in (request, response) if _is_model(s)]
    found += [s for more in _MORE_ANSWERS.values() for _, s in more.values() if _is_model(s)]
    unique = list(dict.fromkeys(found))
    refs, components = models.schemas(unique)
    ref_of = dict(zip(unique, refs, strict=True))

    def schema(s: Any) -> Any:
        return ref_of[s] if _is_model(s) else s

    paths: dict[str, Any] = {}
    for (method, path), (summary, request, response, query) in ROUTES.items():
        op: dict[str, Any] = {
            "summary": summary,
            "parameters": [
                {"name": name[1:-1], "in": "path", "required": True, "schema": {"type": "string"}}
                for name in path.split("/")
                if name.startswith("{")
            ]
            + [
                {
                    "name": q,
                    "in": "query",
                    "required": False,
                    "schema": _QUERY.get(q, {"type": "integer", "minimum": 0}),
                }
                for q in query
            ],
            "responses": {
                "200": {
                    "description": "OK",
                    "content": {"application/json": {"schema": schema(response)}},
                },
                "4XX": {
                    "description": "caller error",
                    "content": {"application/json": {"schema": ref_of[_ERROR]}},
                },
                "5XX": {
                    "description": "no leader, timeout or internal error",
                    "content": {"application/json": {"schema": ref_of[_ERROR]}},
                },
            },
        }
        for status, (what, more) in _MORE_ANSWERS.get((method, path), {}).items():
            op["responses"][status] = {
                "description": what,
                "content": {"application/json": {"schema": schema(more)}},
            }
        if (method, path) in exempt or not auth_required:
            op["security"] = []
        else:
            op["responses"]["401"] = {
                "description": "no valid bearer token (with auth_token set); "
                "WWW-Authenticate: Bearer",
                "content": {"application/json": {"schema": ref_of[_ERROR]}},
            }
            if (method, path) == METRICS_ROUTE:
                op["description"] = "Open when metrics_public is true."
        if request is not None:
            op["requestBody"] = {
                "required": True,
                "content": {"application/json": {"schema": schema(request)}},
            }
        paths.setdefault(path, {})[method.lower()] = op
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "chronomq",
            "version": VERSION,
            "description": "Delayed and scheduled messages on a Raft-replicated log.",
        },
        "components": {"securitySchemes": _SECURITY_SCHEMES, "schemas": components},
        "security": [{BEARER: []}] if auth_required else [],
        "paths": paths,
    }
