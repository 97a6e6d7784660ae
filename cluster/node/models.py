"""The HTTP API's requests and answers, declared once as msgspec Structs.

A request model is what the handler decodes the body with: types, required fields, unknown
fields and plain bounds are checked by msgspec while it parses (:func:`decode`), and a
failure becomes a 400 ``{"error", "message", "field"}`` naming the field as the hand-written
checks did (``messages[0].delay_ms``). Checks that depend on the node (limits from the config,
reserved names, the delay table) stay in the handlers and keep their own error codes; where
such a check also bounds a value, the model documents the bound with ``_doc_only`` so the
schema says it without msgspec answering before the check that owns the error code.

An answer model is what ``/openapi.json`` says the route answers; the integration tests and
the schema-driven fuzz validate every answer they get against it. Fields that can be null are
declared ``X | None``.

Why msgspec and not pydantic: decoding a 512-message produce body into the model costs what
``orjson.loads`` alone cost before, so the checks come free (``chronomq bench models``; figures
on the docs' benchmarks page); msgspec is one small wheel without dependencies, and
:func:`msgspec.json.schema_components` gives ``/openapi.json`` straight from the Structs.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Final, Literal, TypeVar

import msgspec
from msgspec import UNSET, Meta, Struct, UnsetType

from chronomq.cluster.node.errors import bad_request
from chronomq.pop import (
    MAX_FILTER_TAGS,
    MAX_INVISIBLE_MS,
    MAX_POP_MESSAGES,
    MAX_RECONSUME_TIMES_CEILING,
    MIN_INVISIBLE_MS,
)

T = TypeVar("T")

MAX_ACK_HANDLES: Final = 1024
"""Handles one ack request may name (sent to Raft in commands of
:data:`~chronomq.pop.state.MAX_ITEMS_PER_COMMAND`)."""

_INT_MAX = 2**63 - 1
"""The largest integer a bounded field takes (msgspec bounds are 64-bit); a larger one is
refused naming its field rather than carried further."""
NonNegative = Annotated[int, Meta(ge=0, le=_INT_MAX)]
MESSAGE_ID_PATTERN: Final = "^[0-9A-Za-z_-]{1,128}$"
"""A client-made message id: 1 to 128 letters, digits, ``_`` or ``-``."""
Id = Annotated[int, Meta(ge=0, le=1023)]


def _doc_only(**schema: Any) -> Meta:
    """A bound the schema states and a handler check enforces (with its own error code); the
    model itself refuses only integers beyond 64 bits (the handler refuses those below its
    minimum)."""
    if "maximum" in schema:  # the handler's check refuses the large ones too
        return Meta(extra_json_schema=schema)
    return Meta(le=_INT_MAX, extra_json_schema=schema)


class Request(Struct, forbid_unknown_fields=True, omit_defaults=True):
    """A request body: unknown fields are refused."""


class Answer(Struct, omit_defaults=True):
    """An answer body: more fields than declared may come (additions are not breaking)."""


# ---------------------------------------------------------------------- decoding

_AT = re.compile(r" - at `\$(?P<path>[^`]*)`$")
_UNKNOWN = re.compile(r"^Object contains unknown field `(?P<name>[^`]*)`")
_MISSING = re.compile(r"^Object missing required field `(?P<name>[^`]*)`")


def field_of(error: msgspec.ValidationError) -> tuple[str, str]:
    """(field, message) of a msgspec error: ``$.messages[0].tags`` -> ``messages[0].tags``;
    an unknown or missing field is named itself; the body as a whole is ``body``."""
    text = str(error)
    m = _AT.search(text)
    # A dict's value is at `[...]`: the field is the dict, as the hand-written checks named it.
    path = m["path"].lstrip(".").replace("[...]", "") if m else ""
    message = text[: m.start()] if m else text
    named = _UNKNOWN.match(message) or _MISSING.match(message)
    if named:
        path = f"{path}.{named['name']}" if path else named["name"]
        if _UNKNOWN.match(message):
            message = f"unknown field {named['name']!r}"
        else:
            message = f"{named['name']} is required"
    elif path:
        message = f"{path}: {message}"
    return path or "body", message


def convert(value: Any, model: type[T]) -> T:
    """An already parsed JSON value as ``model``, or a 400 naming the field."""
    try:
        return msgspec.convert(value, model)
    except msgspec.ValidationError as exc:
        field, message = field_of(exc)
        raise bad_request(message, field) from None


def decode(raw: bytes, model: type[T]) -> T:
    """A request body as ``model``: 400 ``invalid_json`` when it is not JSON, 400
    ``invalid_input`` naming the field when it does not fit."""
    if not raw.strip():
        raise bad_request("the request body is empty; a JSON object is required", "body")
    try:
        return msgspec.json.decode(raw, type=model)
    except msgspec.ValidationError as exc:
        field, message = field_of(exc)
        raise bad_request(message, field) from None
    except msgspec.DecodeError as exc:
        raise bad_request(f"the body is not valid JSON: {exc}", "body", "invalid_json") from None


def unset_to_none(value: T | UnsetType) -> T | None:
    return None if value is UNSET else value


# ---------------------------------------------------------------------- errors


class Error(Answer):
    """Every 4xx and 5xx answer."""

    error: Annotated[str, Meta(description="machine-readable code")]
    message: str
    field: Annotated[str | None, Meta(description="the offending input, if any")]


# ---------------------------------------------------------------------- produce and pull


class MessageIn(Request):
    """One message to produce; only ``body`` (or ``body_base64``) is required, null is the
    same as absent, and at most one of the three delay fields is given."""

    body: str | None = None
    body_base64: Annotated[str | None, Meta(description="binary body; instead of body")] = None
    keys: list[str] | None = None
    tags: str | None = None
    properties: dict[str, str] | None = None
    queue: NonNegative | None = None
    delay_level: (
        Annotated[int, _doc_only(minimum=0, description="4.x level; above the maximum: clamped")]
        | None
    ) = None
    delay_ms: Annotated[int, _doc_only(minimum=0)] | None = None
    deliver_at_ms: Annotated[int, _doc_only(minimum=0)] | None = None
    message_id: (
        Annotated[
            str,
            Meta(
                pattern=MESSAGE_ID_PATTERN,
                description="the id consumers see (RocketMQ's UNIQ_KEY property), made by the "
                "client; a message that has one is sent alone and its id is the request's "
                "idempotency key, so no other message of the topic takes it within "
                "idempotency_window_s",
            ),
        ]
        | None
    ) = None


class ProduceRequest(Request):
    messages: Annotated[list[MessageIn], Meta(min_length=1)]


class Placed(Answer):
    msg_id: str
    topic: str
    queue: int
    offset: int
    delay_level: int | UnsetType = UNSET
    deliver_ms: int | UnsetType = UNSET
    clamped: bool | UnsetType = UNSET


class Produced(Answer):
    results: list[Placed]
    duplicate: bool | UnsetType = UNSET


class MessageOut(Answer):
    msg_id: str
    topic: str
    queue: int
    offset: int
    keys: list[str]
    tags: Annotated[str | None, Meta(description="null when the message has none")]
    properties: dict[str, str]
    born_ms: int
    store_ms: int
    reconsume_times: int
    body: Annotated[str | None, Meta(description="null when not UTF-8: see body_base64")]
    body_base64: str | UnsetType = UNSET


class Pulled(Answer):
    messages: list[MessageOut]
    next_offset: int
    max_offset: int | UnsetType = UNSET


# ---------------------------------------------------------------------- topics and groups


class TopicQueue(Answer):
    queue: int
    min_offset: int
    max_offset: int


class Topic(Answer):
    topic: str
    queues: list[TopicQueue]


class TopicListed(Answer):
    topic: str
    queues: int
    messages: int


class Topics(Answer):
    topics: list[TopicListed]
    truncated: bool
    next_after: str | None


class CreateTopic(Request):
    queues: (
        Annotated[int, _doc_only(minimum=1, maximum=1024, description="default_topic_queues")]
        | UnsetType
    ) = UNSET


class OffsetCommit(Request):
    topic: str
    queue: Annotated[int, Meta(ge=0, description="a queue of the topic; another is 404")]
    offset: NonNegative


class OffsetCommitted(Answer):
    group: str
    topic: str
    queue: int
    offset: int


class GroupOffset(Answer):
    topic: str
    queue: int
    offset: int


class GroupOffsets(Answer):
    group: str
    offsets: list[GroupOffset]


# ---------------------------------------------------------------------- admin


class LeaderChange(Answer, rename={"from_": "from"}):
    at_ms: int
    term: int
    election_ms: float | None
    from_: int | None
    to: int | None
    detected_by: Annotated[
        str | None,
        Meta(
            description="what made the new leader campaign: connection_closed (the old "
            "leader's connection closed), timeout (it went silent) or transfer; null in a "
            "node's view of another's election"
        ),
    ] = None


class NodeStatus(Answer):
    id: int
    role: str
    http_url: str
    raft: str
    leader: Annotated[int | None, Meta(description="null while no leader is known")]
    leader_url: str | None
    term: int
    commit_index: int
    applied_index: int
    log_len: int
    slow_ticks: int
    max_tick_ms: float
    has_quorum: bool
    digest: dict[str, Any]
    match_index: dict[str, Any]
    version: str
    uptime_s: float
    queued_messages: int
    inflight_commands: int
    last_election_ms: Annotated[
        float | None, Meta(description="null until this node has seen an election")
    ]
    leader_changes: list[LeaderChange]
    removed: dict[str, Any] | None
    reachable: bool
    client_idempotency_keys: int | UnsetType = UNSET
    client_idempotency_keys_evicted: int | UnsetType = UNSET
    pull_waiters: int | UnsetType = UNSET
    pull_waited_queues: int | UnsetType = UNSET
    pull_wakes: Annotated[
        int | UnsetType,
        Meta(description="times a long-polled queue was woken by a message written to it"),
    ] = UNSET
    http_connections: dict[str, Any] | None | UnsetType = UNSET
    disk: dict[str, Any] | None | UnsetType = UNSET
    wire_version: Annotated[
        int | UnsetType,
        Meta(description="the Raft wire version this node speaks (peers must speak the same)"),
    ] = UNSET
    peer_versions: Annotated[
        dict[str, Any] | UnsetType,
        Meta(
            description="Raft address of each peer whose hello this node received: its "
            "version, wire_version and whether this node can talk to it (compatible)"
        ),
    ] = UNSET
    ready: Annotated[
        bool | UnsetType,
        Meta(description="what /readyz says: a write sent to this node can commit now"),
    ] = UNSET
    ready_reason: Annotated[str | UnsetType, Meta(description="why it is (not) ready")] = UNSET
    peers_connected: Annotated[
        dict[str, bool] | UnsetType,
        Meta(description="Raft address of each other member: whether a connection to it is up"),
    ] = UNSET


class TransferRequest(Request):
    to: Id | None = None
    timeout_ms: Annotated[int, Meta(ge=1, le=60_000)] | UnsetType = UNSET


class AddMember(Request):
    id: Id
    raft: Annotated[str, Meta(description="host:port")]
    http: Annotated[str, Meta(description="URL")]
    fetch: Annotated[str | None, Meta(description="host:port; default the raft port + 1000")] = None


class ScheduleControls(Request):
    """At least one of the two; null is refused (omit a field to keep its value)."""

    mode: Literal["sync", "async"] | UnsetType = UNSET
    paused: bool | UnsetType = UNSET


class RetryRequest(Request):
    topic: Annotated[str, Meta(min_length=1)]
    queue: Annotated[int, Meta(ge=0, lt=2**62)]
    offset: Annotated[int, Meta(ge=0, lt=2**62)]
    delay_level: Annotated[
        int,
        Meta(
            ge=-1,
            le=1_000_000,
            description="0 (default): 3 + reconsume times; > 0 as given; -1: DLQ",
        ),
    ] = 0


class TimerSwitches(Request):
    stop_enqueue: bool | UnsetType = UNSET
    stop_dequeue: bool | UnsetType = UNSET


def schemas(models: list[Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """JSON Schemas of ``models`` (Structs or types holding them) for OpenAPI 3.1: the refs
    for each, and the components they name."""
    refs, components = msgspec.json.schema_components(
        models, ref_template="#/components/schemas/{name}"
    )
    return list(refs), components


class MembershipChange(Answer):
    """A replicated membership change; at_ms and term are the leader's."""

    seq: int
    action: Literal["add", "remove"]
    id: int
    raft: str
    http: str
    at_ms: int
    term: int


class ClusterView(Answer):
    leader: Annotated[int | None, Meta(description="null while no node leads")]
    term: int
    nodes: Annotated[
        list[dict[str, Any]],
        Meta(
            description="each node as /v1/admin/node answers (with replication_lag), or "
            "{id, role: unknown, http_url, reachable: false} for one that did not answer, with "
            "version and wire_version when the node asked knows them from that node's Raft "
            "handshake"
        ),
    ]
    leader_changes: list[LeaderChange]
    membership_history: list[MembershipChange]


class Digest(Answer):
    index: int
    length: int
    chain: str


class MemberAdded(Answer):
    status: str
    id: int


# ---------------------------------------------------------------------- pop consumption

Handle = Annotated[str, Meta(min_length=1, max_length=512)]
InvisibleMs = Annotated[int, Meta(ge=MIN_INVISIBLE_MS, le=MAX_INVISIBLE_MS)]
ReconsumeTimes = Annotated[int, Meta(ge=0, le=MAX_RECONSUME_TIMES_CEILING)]


class PopRequest(Request):
    """Null is the same as absent (the default) in every optional field."""

    topic: Annotated[str, Meta(min_length=1)]
    queue: Annotated[int, Meta(ge=-1, le=65_535, description="-1 or null: every queue")] | None = (
        None
    )
    max: Annotated[int, Meta(ge=1, le=MAX_POP_MESSAGES)] | None = None
    invisible_ms: InvisibleMs | None = None
    wait_ms: Annotated[int, _doc_only(minimum=0, description="at most max_wait_ms")] | None = None
    tags: (
        Annotated[
            list[Annotated[str, Meta(min_length=1, max_length=255)]],
            Meta(min_length=1, max_length=MAX_FILTER_TAGS, description="null: every tag"),
        ]
        | None
    ) = None
    max_reconsume_times: ReconsumeTimes | None = None


class PopMessage(MessageOut, kw_only=True):
    receipt_handle: str
    delivery_attempt: Annotated[int, Meta(ge=1)]
    invisible_until_ms: int


class PopAnswer(Answer):
    messages: list[PopMessage]


class AckRequest(Request):
    receipt_handles: Annotated[list[Handle], Meta(min_length=1, max_length=MAX_ACK_HANDLES)]


class AckResult(Answer):
    receipt_handle: str
    status: Literal["acked", "already_acked", "expired"]


class AckAnswer(Answer):
    results: list[AckResult]


class InvisibleRequest(Request):
    receipt_handle: Handle
    invisible_ms: InvisibleMs
    max_reconsume_times: ReconsumeTimes | None = None


class InvisibleAnswer(Answer):
    status: Literal["changed", "expired"]
    receipt_handle: str | None
    invisible_until_ms: int | None


class DlqRequest(Request):
    receipt_handle: Handle


class DlqAnswer(Answer):
    status: Literal["forwarded", "expired"]


class ReadIndex(Answer):
    """The leader's commit index, for a follower's read (``GET /v1/admin/read-index``)."""

    commit_index: int
    term: int


class Ready(Answer):
    """``/readyz``'s 200; not ready is an error (503 no_leader, 410 removed_from_cluster)
    with ``status`` as well."""

    status: Literal["ready"]
    leader: Annotated[int | None, Meta(description="the leader's id (null: not a member)")]
