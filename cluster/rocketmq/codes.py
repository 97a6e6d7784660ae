"""Our errors as the protocol's ``Code`` values.

Every failure a gRPC call meets is one of our errors (an :class:`chronomq.cluster.node.errors.ApiError`, a
domain exception :func:`chronomq.cluster.node.errors.from_exception` turns into one, or the JSON error body a
leader answered a forwarded request with, raised again as an ``ApiError``). The client never sees a bare gRPC failure: the
answer's ``Status`` carries the ``Code`` chosen here and our message (naming the field).

The choice is by our error code first (:data:`BY_ERROR`), refined by the field for
``invalid_input`` (a property, a key, a tag, the topic), and falls back on the HTTP status
(:data:`BY_HTTP_STATUS`). What the official clients do with a code matters: they retry a send
on every error but ``TOO_MANY_REQUESTS``, so "no leader yet" and "commit outcome unknown" get
retryable server-side codes, and a full disk or an overload do not spin.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from rocketmq.grpc_protocol import definition_pb2 as pb

from chronomq.cluster.node.errors import ApiError, from_exception

Code = pb.Code

BY_ERROR: Final[dict[str, int]] = {
    # The request itself.
    "invalid_input": Code.BAD_REQUEST,
    "invalid_json": Code.BAD_REQUEST,
    "bad_request": Code.BAD_REQUEST,
    "timer_bad_request": Code.BAD_REQUEST,
    "invalid_retry": Code.BAD_REQUEST,
    "http_error": Code.BAD_REQUEST,
    "rejected_at_apply": Code.BAD_REQUEST,
    "invalid_config": Code.BAD_REQUEST,
    "unknown_key": Code.BAD_REQUEST,
    "method_not_allowed": Code.BAD_REQUEST,
    "unsupported_media_type": Code.BAD_REQUEST,
    "illegal_topic": Code.ILLEGAL_TOPIC,
    "illegal_consumer_group": Code.ILLEGAL_CONSUMER_GROUP,
    "illegal_invisible_time": Code.ILLEGAL_INVISIBLE_TIME,
    "illegal_filter_expression": Code.ILLEGAL_FILTER_EXPRESSION,
    "illegal_polling_time": Code.ILLEGAL_POLLING_TIME,
    "illegal_offset": Code.ILLEGAL_OFFSET,
    # A pull past a log that lost its newest entries (prev no longer there): read again
    # from an earlier offset, as for an offset the queue no longer has.
    "offset_diverged": Code.ILLEGAL_OFFSET,
    "invalid_receipt_handle": Code.INVALID_RECEIPT_HANDLE,
    "illegal_message_id": Code.ILLEGAL_MESSAGE_ID,
    "idempotency_key_reused": Code.ILLEGAL_MESSAGE_ID,
    "invalid_delay_level": Code.ILLEGAL_DELIVERY_TIME,
    "invalid_deliver_time": Code.ILLEGAL_DELIVERY_TIME,
    "timer_delay_too_long": Code.ILLEGAL_DELIVERY_TIME,
    "message_too_large": Code.MESSAGE_BODY_TOO_LARGE,
    "message_body_empty": Code.MESSAGE_BODY_EMPTY,
    "too_many_messages": Code.PAYLOAD_TOO_LARGE,
    "request_too_large": Code.PAYLOAD_TOO_LARGE,
    "unsupported": Code.UNSUPPORTED,
    "not_implemented": Code.NOT_IMPLEMENTED,
    # Who asks.
    "unauthorized": Code.UNAUTHORIZED,
    "cross_origin": Code.FORBIDDEN,
    "not_group_topic": Code.FORBIDDEN,
    # What it names.
    "not_found": Code.NOT_FOUND,
    "unknown_topic": Code.TOPIC_NOT_FOUND,
    "unknown_queue": Code.NOT_FOUND,
    "unknown_member": Code.NOT_FOUND,
    "unknown_recall_handle": Code.NOT_FOUND,
    "unknown_message": Code.NOT_FOUND,
    "offset_not_found": Code.OFFSET_NOT_FOUND,
    "already_delivered": Code.PRECONDITION_FAILED,
    "topic_exists": Code.PRECONDITION_FAILED,
    "member_exists": Code.PRECONDITION_FAILED,
    "last_member": Code.PRECONDITION_FAILED,
    "leader_not_handed_over": Code.PRECONDITION_FAILED,
    "not_runtime": Code.BAD_REQUEST,
    "condition_failed": Code.PRECONDITION_FAILED,
    "timerlog_unavailable": Code.PRECONDITION_FAILED,
    "notice_refused": Code.PRECONDITION_FAILED,
    # Load: the client must not retry at once.
    "overloaded": Code.TOO_MANY_REQUESTS,
    "too_many_topics": Code.TOO_MANY_REQUESTS,
    "timer_slot_congested": Code.TOO_MANY_REQUESTS,
    "timer_too_many_cancels": Code.TOO_MANY_REQUESTS,
    "too_many_connections": Code.TOO_MANY_REQUESTS,
    "disk_full": Code.TOO_MANY_REQUESTS,
    # The cluster: retry, on this node or another.
    "no_leader": Code.HA_NOT_AVAILABLE,
    "not_leader": Code.HA_NOT_AVAILABLE,
    "leader_unreachable": Code.HA_NOT_AVAILABLE,
    "read_index_unavailable": Code.HA_NOT_AVAILABLE,
    "replica_behind": Code.HA_NOT_AVAILABLE,
    "replication_failed": Code.HA_NOT_AVAILABLE,
    "removed_from_cluster": Code.HA_NOT_AVAILABLE,
    "schedule_unavailable": Code.HA_NOT_AVAILABLE,
    "timer_unavailable": Code.HA_NOT_AVAILABLE,
    "pop_unavailable": Code.HA_NOT_AVAILABLE,
    "timer_config_mismatch": Code.INTERNAL_ERROR,
    "request_timeout": Code.REQUEST_TIMEOUT,
    "search_too_long": Code.BAD_REQUEST,
    "store_changing": Code.HA_NOT_AVAILABLE,
    "membership_timeout": Code.PROXY_TIMEOUT,
    "commit_timeout": Code.MASTER_PERSISTENCE_TIMEOUT,
    "commit_outcome_unknown": Code.MASTER_PERSISTENCE_TIMEOUT,
    "internal": Code.INTERNAL_ERROR,
}
"""Our error codes (``ApiError.code``, the ``error`` of a JSON answer) to the protocol's."""

BY_HTTP_STATUS: Final[dict[int, int]] = {
    400: Code.BAD_REQUEST,
    401: Code.UNAUTHORIZED,
    403: Code.FORBIDDEN,
    404: Code.NOT_FOUND,
    409: Code.PRECONDITION_FAILED,
    410: Code.HA_NOT_AVAILABLE,
    413: Code.PAYLOAD_TOO_LARGE,
    422: Code.BAD_REQUEST,
    429: Code.TOO_MANY_REQUESTS,
    503: Code.HA_NOT_AVAILABLE,
    504: Code.PROXY_TIMEOUT,
    507: Code.TOO_MANY_REQUESTS,
}
"""For an error code not in :data:`BY_ERROR`; any other 4xx is BAD_REQUEST, 5xx INTERNAL_ERROR."""

_FIELD_PARTS: Final = (
    (".properties", Code.ILLEGAL_MESSAGE_PROPERTY_KEY),
    (".keys", Code.ILLEGAL_MESSAGE_KEY),
    (".tags", Code.ILLEGAL_MESSAGE_TAG),
    (".body", Code.BAD_REQUEST),
)


@dataclass(frozen=True, slots=True)
class Failure:
    """A call's answer when it failed: the protocol's code and our message."""

    code: int
    message: str

    @property
    def name(self) -> str:
        return str(Code.Name(self.code))


def code_for(http_status: int, error: str, field: str | None = None) -> int:
    """The protocol's code for our error ``error`` (answered with ``http_status``) on ``field``."""
    if error == "invalid_input" and field:
        if field == "topic":
            return int(Code.ILLEGAL_TOPIC)
        for part, code in _FIELD_PARTS:
            if part in field:
                return int(code)
    code = BY_ERROR.get(error)
    if code is not None:
        return int(code)
    code = BY_HTTP_STATUS.get(http_status)
    if code is not None:
        return int(code)
    return int(Code.BAD_REQUEST if 400 <= http_status < 500 else Code.INTERNAL_ERROR)


def describe(error: str, message: str, field: str | None) -> str:
    """The status message: ours, with our code and the field it names."""
    where = f" [{field}]" if field else ""
    return f"{error}: {message}{where}"


def from_api_error(exc: ApiError) -> Failure:
    return Failure(
        code_for(exc.status, exc.code, exc.field), describe(exc.code, exc.message, exc.field)
    )


def from_exception_or_none(exc: BaseException) -> Failure | None:
    """A failure for any of our errors; None for an unexpected exception (a bug: log it)."""
    api = from_exception(exc)
    return None if api is None else from_api_error(api)


def unsupported(what: str) -> Failure:
    return Failure(int(Code.UNSUPPORTED), describe("unsupported", what, None))


def not_implemented(what: str) -> Failure:
    return Failure(int(Code.NOT_IMPLEMENTED), describe("not_implemented", what, None))


def internal() -> Failure:
    return Failure(int(Code.INTERNAL_ERROR), "internal: internal error; see the node's log")
