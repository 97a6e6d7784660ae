"""Our errors as the RocketMQ 5 protocol's codes, and the pure parts of the gRPC endpoint:
send requests as produce requests, recall handles, credentials, routes and settings."""

from __future__ import annotations

import calendar
import gzip
import hashlib
import hmac
import pathlib
import re
from typing import Any

import pytest
from rocketmq.grpc_protocol import definition_pb2 as pb
from rocketmq.grpc_protocol import service_pb2 as spb
from rocketmq.v5.util.messaging_result_checker import MessagingResultChecker

from chronomq.cluster.config.nodeconfig import NodeConfig, Peer, load
from chronomq.cluster.node.errors import ApiError
from chronomq.cluster.rocketmq import codes, convert, credentials, routes, telemetry
from chronomq.raftlog import errors as rl
from chronomq.timer.errors import DelayTooLong, SlotCongested

ROOT = pathlib.Path(__file__).resolve().parents[2]
Code = pb.Code


def raised_error_codes() -> set[str]:
    """Every error code our packages raise (ApiError literals and error classes' codes)."""
    found: set[str] = set()
    for package in ("cluster", "raftlog", "schedule", "timer"):
        for path in (ROOT / package).rglob("*.py"):
            text = path.read_text()
            found |= set(re.findall(r'ApiError\(\s*\d{3},\s*"([a-z_]+)"', text))
            found |= set(re.findall(r'^\s+code(?:: str)? = "([a-z_]+)"', text, re.M))
            found |= set(re.findall(r'code="([a-z_]+)"', text))
    return found


def test_every_error_code_we_raise_has_a_protocol_code() -> None:
    found = raised_error_codes()
    assert len(found) > 30  # the scan sees the code base
    assert sorted(found - set(codes.BY_ERROR)) == []


@pytest.mark.parametrize(
    ("status", "error", "field", "expected"),
    [
        (400, "invalid_input", "topic", Code.ILLEGAL_TOPIC),
        (
            400,
            "invalid_input",
            "messages[0].properties.REAL_TOPIC",
            Code.ILLEGAL_MESSAGE_PROPERTY_KEY,
        ),
        (400, "invalid_input", "messages[1].keys", Code.ILLEGAL_MESSAGE_KEY),
        (400, "invalid_input", "messages[0].tags", Code.ILLEGAL_MESSAGE_TAG),
        (400, "invalid_input", "messages", Code.BAD_REQUEST),
        (413, "message_too_large", "messages[0].body", Code.MESSAGE_BODY_TOO_LARGE),
        (400, "timer_delay_too_long", None, Code.ILLEGAL_DELIVERY_TIME),
        (400, "invalid_delay_level", None, Code.ILLEGAL_DELIVERY_TIME),
        (429, "overloaded", None, Code.TOO_MANY_REQUESTS),
        (429, "timer_slot_congested", None, Code.TOO_MANY_REQUESTS),
        (507, "disk_full", None, Code.TOO_MANY_REQUESTS),
        (404, "unknown_topic", "topic", Code.TOPIC_NOT_FOUND),
        (401, "unauthorized", None, Code.UNAUTHORIZED),
        (503, "no_leader", None, Code.HA_NOT_AVAILABLE),
        (503, "commit_timeout", None, Code.MASTER_PERSISTENCE_TIMEOUT),
        (422, "idempotency_key_reused", None, Code.ILLEGAL_MESSAGE_ID),
        (400, "unsupported", None, Code.UNSUPPORTED),
        # Not in the table: by HTTP status.
        (404, "something_new", None, Code.NOT_FOUND),
        (418, "something_new", None, Code.BAD_REQUEST),
        (502, "something_new", None, Code.INTERNAL_ERROR),
    ],
)
def test_code_for(status: int, error: str, field: str | None, expected: int) -> None:
    assert codes.code_for(status, error, field) == expected


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (rl.MessageTooLarge("too big", "body"), Code.MESSAGE_BODY_TOO_LARGE),
        (rl.UnknownTopic("no such topic", "topic"), Code.TOPIC_NOT_FOUND),
        (rl.Overloaded("busy"), Code.TOO_MANY_REQUESTS),
        (rl.NotLeader("not me"), Code.HA_NOT_AVAILABLE),
        (TimeoutError(), Code.MASTER_PERSISTENCE_TIMEOUT),
        (DelayTooLong("a year and a day", field="deliver_at_ms"), Code.ILLEGAL_DELIVERY_TIME),
        (
            SlotCongested("full", slot_ms=0, count=2, limit=1, field="deliver_at_ms"),
            Code.TOO_MANY_REQUESTS,
        ),
    ],
)
def test_domain_exceptions(exc: BaseException, expected: int) -> None:
    failure = codes.from_exception_or_none(exc)
    assert failure is not None and failure.code == expected


def test_unexpected_exception_is_none_and_message_names_code_and_field() -> None:
    assert codes.from_exception_or_none(KeyError("x")) is None
    f = codes.from_api_error(ApiError(400, "invalid_input", "bad tag", "messages[0].tags"))
    assert f.code == Code.ILLEGAL_MESSAGE_TAG
    assert f.message == "invalid_input: bad tag [messages[0].tags]"
    assert f.name == "ILLEGAL_MESSAGE_TAG"


def test_official_client_raises_on_every_failure_code() -> None:
    """Every code we answer with makes the official client fail the call, never pass it."""
    for code in set(codes.BY_ERROR.values()) | set(codes.BY_HTTP_STATUS.values()):
        with pytest.raises(Exception):  # noqa: B017 - the client's own exception types
            MessagingResultChecker.check(pb.Status(code=code, message="x"))


# ---------------------------------------------------------------------- convert


def send_request(**sp: Any) -> spb.SendMessageRequest:
    props = sp.pop("user_properties", {})
    body = sp.pop("body", b"hello")
    req = spb.SendMessageRequest()
    m = req.messages.add()
    m.topic.name = sp.pop("topic", "orders")
    m.body = body
    m.user_properties.update(props)
    for k, v in sp.items():
        if k == "keys":
            m.system_properties.keys.extend(v)
        elif k == "delivery_timestamp":
            m.system_properties.delivery_timestamp.seconds = v // 1000
            m.system_properties.delivery_timestamp.nanos = (v % 1000) * 1_000_000
        else:
            setattr(m.system_properties, k, v)
    return req


def test_normal_message() -> None:
    req = send_request(message_id="01AB", tag="t", keys=["k1", "k2"], user_properties={"a": "b"})
    p = convert.produce_request(req, 1024)
    assert p.topic == "orders"
    assert p.messages == (
        {
            "body_base64": "aGVsbG8=",
            "message_id": "01AB",
            "properties": {"a": "b"},
            "tags": "t",
            "keys": ["k1", "k2"],
        },
    )
    assert p.idempotency_key == "rmq5:01AB"
    assert p.client_ids == ("01AB",)


def test_retry_of_the_same_message_is_the_same_request() -> None:
    """Born time and host change per attempt; nothing of them reaches the produce request."""
    a = send_request(message_id="X1", born_host="10.0.0.1")
    b = send_request(message_id="X1", born_host="10.0.0.2")
    a.messages[0].system_properties.born_timestamp.seconds = 1
    b.messages[0].system_properties.born_timestamp.seconds = 2
    assert convert.produce_request(a, 1024) == convert.produce_request(b, 1024)


def test_delivery_timestamp_and_delay_property() -> None:
    p = convert.produce_request(send_request(delivery_timestamp=1_700_000_000_123), 1024)
    assert p.messages[0]["deliver_at_ms"] == 1_700_000_000_123
    p = convert.produce_request(send_request(user_properties={"DELAY": "3"}), 1024)
    assert p.messages[0]["delay_level"] == 3 and "properties" not in p.messages[0]
    assert p.idempotency_key is None  # no message id: no key


@pytest.mark.parametrize(
    ("kwargs", "error", "code"),
    [
        ({"message_group": "g"}, "unsupported", Code.UNSUPPORTED),
        ({"message_type": pb.MessageType.TRANSACTION}, "unsupported", Code.UNSUPPORTED),
        ({"user_properties": {"DELAY": "x"}}, "invalid_delay_level", Code.ILLEGAL_DELIVERY_TIME),
        ({"body": b""}, "message_body_empty", Code.MESSAGE_BODY_EMPTY),
        ({"topic": "bad topic"}, "invalid_input", Code.ILLEGAL_TOPIC),
        ({"message_id": "has space"}, "illegal_message_id", Code.ILLEGAL_MESSAGE_ID),
        (
            {"delivery_timestamp": 5, "user_properties": {"DELAY": "1"}},
            "invalid_input",
            Code.BAD_REQUEST,
        ),
    ],
)
def test_refused_sends(kwargs: dict[str, Any], error: str, code: int) -> None:
    with pytest.raises((ApiError, rl.InvalidInput)) as info:
        convert.produce_request(send_request(**kwargs), 1024)
    failure = codes.from_exception_or_none(info.value)
    assert failure is not None
    assert failure.message.startswith(error) and failure.code == code


def test_gzip_body_is_inflated_within_the_limit() -> None:
    body = b"x" * 2000
    req = send_request(body=gzip.compress(body), body_encoding=pb.Encoding.GZIP)
    assert convert.produce_request(req, 4096).messages[0]["body_base64"].startswith("eHh4")
    with pytest.raises(ApiError) as info:
        convert.produce_request(req, 1000)
    assert info.value.code == "message_too_large"


def test_batch_key_and_mixed_topics() -> None:
    req = send_request(message_id="A")
    m = req.messages.add()
    m.topic.name = "orders"
    m.body = b"2"
    m.system_properties.message_id = "B"
    p = convert.produce_request(req, 1024)
    # No key for a batch: the broker refuses one whose messages carry ids (each id is its own
    # message's key).
    assert p.idempotency_key is None and p.client_ids == ("A", "B")
    m.topic.name = "other"
    with pytest.raises(ApiError):
        convert.produce_request(req, 1024)


def test_recall_handle_round_trip() -> None:
    handles = convert.RecallHandles(b"cluster-secret-0123456789")
    timer_id = "01A210D02858778E67DBBD0A351432AB"
    h = handles.make(timer_id, "orders", "0102FC")
    assert handles.parse(h, "orders") == (timer_id, "0102FC")
    assert handles.parse(handles.make(timer_id, "orders", ""), "orders") == (timer_id, "")
    other_cluster = convert.RecallHandles(b"another-secret-0123456789")
    forged = [
        "",
        "c1.xyz.1",
        timer_id,
        f"c1.{timer_id}.0102FC",  # the old, unsigned form
        "c2." + "A" * 300,
        h.replace(timer_id, "01A210D02858778E67DBBD0A351432AC"),  # another timer
        h.replace(".0102FC.", ".0102FD."),
        h[:-1] + ("0" if h[-1] != "0" else "1"),
        other_cluster.make(timer_id, "orders", "0102FC"),
    ]
    for bad in forged:
        with pytest.raises(ApiError) as info:
            handles.parse(bad, "orders")
        assert info.value.field == "recall_handle"
    with pytest.raises(ApiError):
        handles.parse(h, "payments")  # good, but for another topic


# ---------------------------------------------------------------------- credentials


TOKEN = b"s3cret-token"
SIGNED_AT = "20261125T034500Z"
SIGNED_AT_S = calendar.timegm((2026, 11, 25, 3, 45, 0, 0, 0, 0))
UTC_NODE = credentials.Clock(SIGNED_AT_S + 5, 0)


def signed(
    date: str = SIGNED_AT, access_key: str = "ak", token: bytes = TOKEN, extra: str = ""
) -> list[tuple[str, str]]:
    sig = hmac.new(token, date.encode(), hashlib.sha1).hexdigest()
    auth = f"MQv2-HMAC-SHA1 Credential={access_key}, SignedHeaders=x-mq-date-time{extra}, "
    return [("x-mq-date-time", date), ("authorization", auth + f"Signature={sig}")]


def authorized(md: Any, clock: credentials.Clock = UTC_NODE, **creds: Any) -> bool:
    return credentials.call_is_authorized(md, credentials.GrpcCredentials(TOKEN, **creds), clock)


def test_bearer_and_client_signature() -> None:
    assert credentials.call_is_authorized(None, credentials.GrpcCredentials(b""), UTC_NODE)
    assert authorized((("authorization", "Bearer s3cret-token"),))
    assert not authorized((("authorization", "Bearer nope"),))
    assert not authorized(())
    md = signed()
    assert authorized(md)
    assert not credentials.call_is_authorized(
        md, credentials.GrpcCredentials(b"another-token"), UTC_NODE
    )
    assert not authorized(md[1:])  # no date: nothing was signed


def test_a_signature_expires_with_its_window() -> None:
    md = signed()
    for skew_s in (0, 899, -899):
        assert authorized(md, credentials.Clock(SIGNED_AT_S + skew_s, 0)), skew_s
    for skew_s in (901, -901, 86_400 * 365):
        assert not authorized(md, credentials.Clock(SIGNED_AT_S + skew_s, 0)), skew_s
    assert authorized(md, credentials.Clock(SIGNED_AT_S + 3000, 0), window_s=3600)
    # A client in the node's time zone (UTC+2) writes its local time with a Z.
    assert authorized(md, credentials.Clock(SIGNED_AT_S - 7200, 7200))
    assert not authorized(md, credentials.Clock(SIGNED_AT_S - 7200, 3600))
    assert not authorized(signed(date="2026-11-25 03:45:00"))
    assert not authorized(signed(date="99991325T034500Z"))


def test_a_signature_names_the_configured_access_key() -> None:
    assert authorized(signed(access_key="anyone"))  # none configured
    assert authorized(signed(access_key="chronomq"), access_key="chronomq")
    assert not authorized(signed(access_key="anyone"), access_key="chronomq")


def test_repeated_or_odd_entries_are_refused() -> None:
    md = signed()
    assert not authorized(md + [("authorization", "Bearer s3cret-token")])
    assert not authorized([("authorization", "Bearer s3cret-token")] * 2)
    assert not authorized(md + [("x-mq-date-time", "20261125T034501Z")])
    sig = md[1][1].rsplit("Signature=", 1)[1]
    assert not authorized(signed(extra=f", Signature={sig}"))
    assert not authorized(signed(extra=", Credential=ak"))
    twice = md[1][1].replace("SignedHeaders=x-mq-date-time", "SignedHeaders=x-mq-date-time;host")
    assert not authorized([md[0], ("authorization", twice)])
    assert not authorized([md[0], ("authorization", md[1][1] + ", Extra=1")])


# ---------------------------------------------------------------------- routes and settings


def node_config(**values: Any) -> NodeConfig:
    return load(overrides=values, environ={})


def test_members_and_route() -> None:
    config = node_config(http_port=8080)
    peers = [
        Peer(1, "127.0.0.1:9081", "http://127.0.0.1:8081", ""),
        Peer(2, "127.0.0.1:9082", "http://127.0.0.1:8082", ""),
    ]
    members = routes.live_members(config, peers, {"127.0.0.1:9081": True, "127.0.0.1:9082": False})
    assert [(m.host, m.port) for m in members] == [("127.0.0.1", 8180), ("127.0.0.1", 8181)]
    # The leader's address first: the client's channel starts on the node serving writes.
    first = routes.leader_first(members, "http://127.0.0.1:8081", config)
    assert [m.port for m in first] == [8181, 8180]
    assert routes.leader_first(members, None, config) == members
    assert routes.leader_first(members, "http://127.0.0.1:8082", config) == members  # not live
    queues = routes.message_queues(pb.Resource(name="orders"), 4, members)
    assert [q.id for q in queues] == [0, 1, 2, 3]
    assert all(len(q.broker.endpoints.addresses) == 2 for q in queues)
    assert queues[0].permission == pb.Permission.READ_WRITE
    assert queues[0].broker.endpoints.scheme == pb.AddressScheme.IPv4


def test_host_names_get_one_member_per_queue() -> None:
    members = [routes.GrpcAddress("a.example", 8180), routes.GrpcAddress("b.example", 8180)]
    queues = routes.message_queues(pb.Resource(name="t"), 3, members)
    assert [q.broker.endpoints.addresses[0].host for q in queues] == [
        "a.example",
        "b.example",
        "a.example",
    ]
    assert all(len(q.broker.endpoints.addresses) == 1 for q in queues)


def test_a_node_bound_to_every_interface_names_itself_by_its_raft_host() -> None:
    config = node_config(http_host="0.0.0.0", raft_host="node0", allow_insecure=True)
    assert routes.own_address(config) == routes.GrpcAddress("node0", 8180)


def test_grpc_port_offset_follows_this_node() -> None:
    config = node_config(http_port=8080, grpc_port=7000)
    assert config.grpc_listen_port == 7000
    peers = [Peer(1, "h:1", "http://127.0.0.1:8081", "")]
    members = routes.live_members(config, peers, {"h:1": True})
    assert [m.port for m in members] == [7000, 7001]


def test_server_settings() -> None:
    config = node_config(max_message_bytes=1000, max_wait_ms=5000)
    producer = pb.Settings(
        client_type=pb.ClientType.PRODUCER, publishing=pb.Publishing(max_body_size=1 << 27)
    )
    out = telemetry.server_settings(config, producer)
    assert out.publishing.max_body_size == 1000
    assert out.backoff_policy.max_attempts == telemetry.SEND_MAX_ATTEMPTS
    consumer = pb.Settings(client_type=pb.ClientType.SIMPLE_CONSUMER)
    consumer.subscription.long_polling_timeout.seconds = 30
    out = telemetry.server_settings(config, consumer)
    assert out.subscription.long_polling_timeout.seconds == 5
    assert out.backoff_policy.max_attempts == 17  # max_reconsume_times 16, plus the first
    # Redelivery n waits as long as delay level 3 + n - 1, as a retry through the levels.
    waits = [d.seconds for d in out.backoff_policy.customized_backoff.next]
    assert waits[:4] == [10, 30, 60, 120] and waits[-1] == 7200
