"""The pop RPCs' requests as our receives, and received messages as the protocol's (no I/O)."""

from __future__ import annotations

import zlib

import pytest
from rocketmq.grpc_protocol import definition_pb2 as pb
from rocketmq.grpc_protocol import service_pb2 as spb
from rocketmq.v5.model import Message as ClientMessage

from chronomq.cluster.node.errors import ApiError
from chronomq.cluster.rocketmq import consume


def request(**kw: object) -> spb.ReceiveMessageRequest:
    req = spb.ReceiveMessageRequest()
    req.group.name = "g"
    req.message_queue.topic.name = str(kw.pop("topic", "orders"))
    req.message_queue.id = int(kw.pop("queue", -1))  # type: ignore[call-overload]
    if "invisible_s" in kw:
        req.invisible_duration.seconds = int(kw.pop("invisible_s"))  # type: ignore[call-overload]
    if "poll_s" in kw:
        req.long_polling_timeout.seconds = int(kw.pop("poll_s"))  # type: ignore[call-overload]
    if "expr" in kw:
        req.filter_expression.type = pb.FilterType.TAG
        req.filter_expression.expression = str(kw.pop("expr"))
    for k, v in kw.items():
        setattr(req, k, v)
    return req


def test_receive_args_take_the_request_and_bound_the_long_poll() -> None:
    args = consume.receive_args(request(invisible_s=30, poll_s=20, batch_size=8), 30_000, 25.0)
    assert (args.topic, args.queue, args.max_messages) == ("orders", None, 8)
    assert args.invisible_ms == 30_000
    assert args.wait_ms == 20_000
    # The poll ends a margin before the call's deadline, and within max_wait_ms.
    assert consume.receive_args(request(invisible_s=30, poll_s=20), 30_000, 5.0).wait_ms == 4000
    assert consume.receive_args(request(invisible_s=30, poll_s=20), 3000, None).wait_ms == 3000
    # A batch above the protocol's 32 is clamped; none asked means the most.
    assert consume.receive_args(request(invisible_s=30, batch_size=500), 1, None).max_messages == 32
    # Every queue, whichever the client names (the proxy's pop does the same).
    assert consume.receive_args(request(invisible_s=30, queue=2), 1, None).queue is None


def test_invisible_time_rules() -> None:
    auto = consume.receive_args(request(auto_renew=True), 1, None)
    assert auto.invisible_ms == consume.AUTO_RENEW_INVISIBLE_MS
    for bad in (request(), request(invisible_s=0), request(invisible_s=13 * 3600)):
        with pytest.raises(ApiError) as e:
            consume.receive_args(bad, 1, None)
        assert e.value.code == "illegal_invisible_time" and e.value.field == "invisible_duration"


@pytest.mark.parametrize(
    ("expr", "tags"),
    [("", None), ("*", None), (" A ", ("A",)), ("A || B||C", ("A", "B", "C"))],
)
def test_tag_filters(expr: str, tags: tuple[str, ...] | None) -> None:
    assert consume.receive_args(request(invisible_s=9, expr=expr), 1, None).tags == tags


@pytest.mark.parametrize("expr", ["A ||", "||", "A*", "A || *"])
def test_bad_tag_filters(expr: str) -> None:
    with pytest.raises(ApiError) as e:
        consume.receive_args(request(invisible_s=9, expr=expr), 1, None)
    assert e.value.code == "illegal_filter_expression"


def test_sql_filters_and_system_topics_are_refused() -> None:
    req = request(invisible_s=9)
    req.filter_expression.type = pb.FilterType.SQL
    req.filter_expression.expression = "a > 1"
    with pytest.raises(ApiError) as e:
        consume.receive_args(req, 1, None)
    assert e.value.code == "unsupported"
    with pytest.raises(ApiError) as e:
        consume.receive_args(request(topic="rmq_sys_wheel_timer", invisible_s=9), 1, None)
    assert e.value.code == "illegal_topic"
    with pytest.raises(ApiError) as e:
        consume.check_group("%DLQ%x")
    assert e.value.code == "illegal_consumer_group"


def test_a_received_message_as_the_official_client_reads_it() -> None:
    stored = {
        "msg_id": "0102FC00000000000000000000000001",
        "topic": "orders",
        "queue": 3,
        "offset": 17,
        "body": "héllo",
        "keys": ["k1", "k2"],
        "tags": "A",
        "properties": {
            "UNIQ_KEY": "CLIENTID01",
            "REAL_TOPIC": "orders",
            "TIMER_OUT_MS": "1790000000123",
            "color": "red",
        },
        "born_ms": 1790000000000,
        "store_ms": 1790000000050,
        "reconsume_times": 0,
        "receipt_handle": "v1.abc",
        "delivery_attempt": 2,
        "invisible_until_ms": 0,
    }
    m = consume.message_pb(stored)
    assert m.system_properties.body_digest.checksum == format(
        zlib.crc32("héllo".encode()) & 0xFFFFFFFF, "08X"
    )
    got = ClientMessage().fromProtobuf(m)
    assert not got.corrupted
    assert got.body == "héllo".encode()
    assert got.message_id == "CLIENTID01"  # the producer's id, as its send receipt said
    assert got.tag == "A" and set(got.keys) == {"k1", "k2"}
    assert got.properties == {"color": "red"}  # the broker's own properties stay inside
    assert got.delivery_attempt == 2 and got.receipt_handle == "v1.abc"
    assert got.delivery_timestamp == 1790000000123
    assert m.system_properties.queue_id == 3 and m.system_properties.queue_offset == 17
    binary = dict(stored, body=None, body_base64="AAEC", properties={})
    m = consume.message_pb(binary)
    assert m.body == b"\x00\x01\x02"
    assert m.system_properties.message_id == stored["msg_id"]
    assert m.system_properties.message_type == pb.MessageType.NORMAL


def test_a_push_consumer_is_assigned_the_whole_topic() -> None:
    from chronomq.cluster.rocketmq import routes

    members = [routes.GrpcAddress("127.0.0.1", 8180), routes.GrpcAddress("127.0.0.1", 8181)]
    (one,) = routes.assignments(pb.Resource(name="orders"), members)
    assert one.message_queue.id == -1
    assert [a.port for a in one.message_queue.broker.endpoints.addresses] == [8180, 8181]
    named = [routes.GrpcAddress("a.example", 8180), routes.GrpcAddress("b.example", 8180)]
    assert len(routes.assignments(pb.Resource(name="orders"), named)) == 2
