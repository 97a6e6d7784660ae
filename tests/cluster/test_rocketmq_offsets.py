"""The pure parts of the offset RPCs: a pull request's checks and limits, the search for the
first offset stored at or after a time, and pulled messages as the protocol's ``Message``."""

from __future__ import annotations

import asyncio

import pytest
from google.protobuf import duration_pb2
from rocketmq.grpc_protocol import definition_pb2 as pb
from rocketmq.grpc_protocol import service_pb2 as spb

from chronomq.cluster.node.errors import ApiError, from_exception
from chronomq.cluster.rocketmq import codes
from chronomq.cluster.rocketmq.consume import message_pb
from chronomq.cluster.rocketmq.offsets import (
    DEFAULT_PULL_BATCH,
    PULL_DEADLINE_MARGIN_S,
    first_at_or_after,
    pull_args,
    queue_of,
)

Code = pb.Code


def pull(
    topic: str = "orders",
    queue: int = 1,
    offset: int = 5,
    group: str = "g",
    batch: int = 0,
    poll_ms: int | None = None,
    filter_type: int = pb.FilterType.TAG,
    expression: str = "",
) -> spb.PullMessageRequest:
    req = spb.PullMessageRequest(offset=offset, batch_size=batch)
    req.group.name = group
    req.message_queue.topic.name = topic
    req.message_queue.id = queue
    req.filter_expression.type = filter_type  # type: ignore[assignment]
    req.filter_expression.expression = expression
    if poll_ms is not None:
        req.long_polling_timeout.CopyFrom(
            duration_pb2.Duration(seconds=poll_ms // 1000, nanos=(poll_ms % 1000) * 1_000_000)
        )
    return req


def code_of(req: spb.PullMessageRequest) -> int:
    with pytest.raises(Exception) as info:
        pull_args(req, 1000, 30_000, None)
    api = from_exception(info.value)
    assert api is not None, info.value
    return codes.from_api_error(api).code


def test_a_plain_pull_takes_the_defaults_and_does_not_wait() -> None:
    args = pull_args(pull(), 1000, 30_000, None)
    assert (args.group, args.topic, args.queue, args.offset) == ("g", "orders", 1, 5)
    assert args.batch == DEFAULT_PULL_BATCH
    assert args.wait_ms == 0  # no long_polling_timeout: no wait, as the proxy
    assert args.tags is None


def test_batch_and_long_poll_are_capped_by_the_config_and_the_deadline() -> None:
    args = pull_args(pull(batch=5000, poll_ms=60_000), 1000, 30_000, None)
    assert (args.batch, args.wait_ms) == (1000, 30_000)
    args = pull_args(pull(batch=7, poll_ms=20_000), 1000, 30_000, 3.0)
    assert args.batch == 7
    assert args.wait_ms == int((3.0 - PULL_DEADLINE_MARGIN_S) * 1000)
    assert pull_args(pull(poll_ms=20_000), 1000, 30_000, 0.1).wait_ms == 0


def test_tag_filters() -> None:
    assert pull_args(pull(expression=" a || b "), 1000, 0, None).tags == ("a", "b")
    assert pull_args(pull(expression="*"), 1000, 0, None).tags is None


@pytest.mark.parametrize(
    ("req", "code"),
    [
        (pull(group=""), Code.ILLEGAL_CONSUMER_GROUP),
        (pull(topic=""), Code.ILLEGAL_TOPIC),
        (pull(topic="bad topic"), Code.ILLEGAL_TOPIC),
        (pull(topic="rmq_sys_wheel_timer"), Code.ILLEGAL_TOPIC),
        (pull(queue=-1), Code.BAD_REQUEST),
        (pull(offset=-1), Code.ILLEGAL_OFFSET),
        (pull(batch=-1), Code.BAD_REQUEST),
        (pull(poll_ms=-1000), Code.ILLEGAL_POLLING_TIME),
        (pull(expression="a || *"), Code.ILLEGAL_FILTER_EXPRESSION),
        (pull(expression="a ||"), Code.ILLEGAL_FILTER_EXPRESSION),
        (pull(filter_type=pb.FilterType.SQL, expression="a > 1"), Code.UNSUPPORTED),
    ],
)
def test_bad_pulls_get_the_protocols_codes(req: spb.PullMessageRequest, code: int) -> None:
    assert code_of(req) == code


def test_queue_of_names_the_field() -> None:
    mq = pb.MessageQueue(id=-2)
    mq.topic.name = "orders"
    with pytest.raises(ApiError) as info:
        queue_of(mq)
    assert info.value.field == "message_queue.id"


def search(times: list[int], timestamp_ms: int) -> tuple[int, int]:
    """The search over ``times`` (offset i stored at times[i]) and how many probes it made."""
    probes = 0

    async def at(offset: int) -> int:
        nonlocal probes
        probes += 1
        return times[offset]

    found = asyncio.run(first_at_or_after(0, len(times), timestamp_ms, at))
    return found, probes


@pytest.mark.parametrize(
    ("timestamp_ms", "expected"),
    [(0, 0), (100, 0), (101, 1), (200, 1), (250, 4), (300, 4), (301, 5), (10**15, 5)],
)
def test_first_offset_at_or_after_a_time(timestamp_ms: int, expected: int) -> None:
    assert search([100, 200, 200, 200, 300], timestamp_ms)[0] == expected


def test_the_time_search_is_logarithmic() -> None:
    times = list(range(0, 3_000_000, 3))  # a million messages, 3 ms apart
    for ts, expected in (
        (0, 0),
        (1, 1),
        (1_500_000, 500_000),
        (1_500_001, 500_001),
        (2_999_997, 999_999),
        (3_000_000, 1_000_000),
    ):
        found, probes = search(times, ts)
        assert found == expected
        assert probes <= 21  # log2(10**6) + 1
    assert search([], 5) == (0, 0)


def test_a_pulled_message_has_no_receipt_handle_and_counts_its_attempts() -> None:
    m = {
        "msg_id": "00" * 16,
        "topic": "orders",
        "queue": 2,
        "offset": 7,
        "keys": ["k"],
        "tags": "paid",
        "properties": {"UNIQ_KEY": "client-id", "i": "1"},
        "born_ms": 1_700_000_000_123,
        "store_ms": 1_700_000_000_456,
        "reconsume_times": 2,
        "body": "hello",
    }
    out = message_pb(m)
    sp = out.system_properties
    assert (out.topic.name, out.body, sp.tag, list(sp.keys)) == ("orders", b"hello", "paid", ["k"])
    assert (sp.message_id, sp.queue_id, sp.queue_offset) == ("client-id", 2, 7)
    assert sp.delivery_attempt == 3
    assert not sp.HasField("receipt_handle")
    assert not sp.HasField("invisible_duration")
    assert sp.store_timestamp.seconds == 1_700_000_000 and sp.store_timestamp.nanos == 456_000_000
    assert dict(out.user_properties) == {"i": "1"}
    popped = message_pb(
        {**m, "receipt_handle": "h", "delivery_attempt": 1, "invisible_until_ms": 0}
    )
    assert popped.system_properties.receipt_handle == "h"
    assert popped.system_properties.delivery_attempt == 1
