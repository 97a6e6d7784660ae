"""The pull-consumer RPCs of the RocketMQ 5 gRPC endpoint on 3 real node processes:
``UpdateOffset`` on a follower seen by ``GetOffset`` on another node, ``QueryOffset`` by
policy (the timestamp search against the store times the HTTP pull shows), ``PullMessage``
from a follower with a batch, a tag filter and a long poll woken by a new message, and the
protocol's codes for bad input. Every wait has a deadline."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import grpc
import pytest
from google.protobuf import duration_pb2, timestamp_pb2
from rocketmq.grpc_protocol import definition_pb2 as pb
from rocketmq.grpc_protocol import service_pb2 as spb
from rocketmq.grpc_protocol import service_pb2_grpc as spb_grpc

from chronomq.cluster.process.launcher import LocalCluster
from tests.integration.conftest import wait_for

pytestmark = pytest.mark.integration

Code = pb.Code
Policy = pb.QueryOffsetPolicy
TOPIC = "pull_orders"
GROUP = "pullers"
MESSAGES = 30


def tag_of(i: int) -> str | None:
    return ("a", "b", None)[i % 3]


def mq(topic: str = TOPIC, queue: int = 0) -> pb.MessageQueue:
    out = pb.MessageQueue(id=queue)
    out.topic.name = topic
    return out


def pull_req(
    offset: int,
    batch: int = 0,
    tags: str = "",
    poll_ms: int | None = None,
    group: str = GROUP,
    topic: str = TOPIC,
    queue: int = 0,
    sql: bool = False,
) -> spb.PullMessageRequest:
    req = spb.PullMessageRequest(
        group=pb.Resource(name=group),
        message_queue=mq(topic, queue),
        offset=offset,
        batch_size=batch,
        filter_expression=pb.FilterExpression(
            type=pb.FilterType.SQL if sql else pb.FilterType.TAG, expression=tags
        ),
    )
    if poll_ms is not None:
        req.long_polling_timeout.CopyFrom(
            duration_pb2.Duration(seconds=poll_ms // 1000, nanos=(poll_ms % 1000) * 1_000_000)
        )
    return req


async def pull(
    stub: Any, req: spb.PullMessageRequest, timeout_s: float = 10
) -> tuple[int, list[pb.Message], int | None]:
    """The status code, the messages and the next offset of one pull, checking the order of the
    answers: the status first, then the messages, the next offset last; or a failure's status
    alone (``None`` for the next offset)."""
    answers = [a async for a in stub.PullMessage(req, timeout=timeout_s)]
    kinds = [a.WhichOneof("content") for a in answers]
    assert kinds and kinds[0] == "status", kinds
    status = answers[0].status
    if kinds == ["status"]:
        assert status.code not in (Code.OK, Code.MESSAGE_NOT_FOUND), status
        assert status.message
        return status.code, [], None
    assert kinds[-1] == "next_offset" and set(kinds[1:-1]) <= {"message"}, kinds
    messages = [a.message for a in answers[1:-1]]
    return status.code, messages, answers[-1].next_offset


async def produce(s: aiohttp.ClientSession, url: str, items: list[tuple[str, str | None]]) -> None:
    messages = [{"body": body, **({"tags": tag} if tag else {})} for body, tag in items]
    async with s.post(f"{url}/v1/topics/{TOPIC}/messages", json={"messages": messages}) as r:
        assert r.status == 200, await r.text()


async def test_pull_consumer_rpcs(make_cluster: Any) -> None:
    cluster: LocalCluster = make_cluster()
    leader = cluster.wait_leader(30)
    cluster.wait_all_know_leader(30)
    f1, f2 = (i for i in range(cluster.n) if i != leader)
    url = cluster.urls[leader]

    async with aiohttp.ClientSession() as s:
        async with s.put(f"{url}/v1/topics/{TOPIC}", json={"queues": 1}) as r:
            assert r.status == 201, await r.text()
        for start in range(0, MESSAGES, 10):  # three commands, store times apart
            await produce(s, url, [(f"m{i}", tag_of(i)) for i in range(start, start + 10)])
        async with s.get(
            f"{url}/v1/topics/{TOPIC}/queues/0/messages", params={"offset": "0", "max": "100"}
        ) as r:
            stored = (await r.json())["messages"]
    assert [m["body"] for m in stored] == [f"m{i}" for i in range(MESSAGES)]
    store_ms = [int(m["store_ms"]) for m in stored]

    async with (
        grpc.aio.insecure_channel(cluster.grpc_address(leader)) as c_leader,
        grpc.aio.insecure_channel(cluster.grpc_address(f1)) as c1,
        grpc.aio.insecure_channel(cluster.grpc_address(f2)) as c2,
    ):
        on_leader = spb_grpc.MessagingServiceStub(c_leader)
        one = spb_grpc.MessagingServiceStub(c1)
        two = spb_grpc.MessagingServiceStub(c2)

        async def query(stub: Any, policy: int, ts_ms: int | None = None) -> Any:
            req = spb.QueryOffsetRequest(message_queue=mq(), query_offset_policy=policy)  # type: ignore[arg-type]
            if ts_ms is not None:
                req.timestamp.CopyFrom(
                    timestamp_pb2.Timestamp(seconds=ts_ms // 1000, nanos=ts_ms % 1000 * 1_000_000)
                )
            return await stub.QueryOffset(req, timeout=5)

        # Both followers have applied every message (QueryOffset END reads the local store).
        for stub in (one, two):

            async def caught_up(stub: Any = stub) -> bool:
                answer = await query(stub, Policy.END)
                return answer.status.code == Code.OK and answer.offset == MESSAGES

            await wait_for(caught_up, 30, "the followers applied every message", cluster)

        # ------------------------------------------------------------ group offsets
        update = spb.UpdateOffsetRequest(
            group=pb.Resource(name=GROUP), message_queue=mq(), offset=17
        )
        answer = await one.UpdateOffset(update, timeout=10)
        assert answer.status.code == Code.OK, answer.status
        get = spb.GetOffsetRequest(group=pb.Resource(name=GROUP), message_queue=mq())

        async def seen_on_f2() -> Any:
            got = await two.GetOffset(get, timeout=5)
            return got if got.status.code == Code.OK else None

        got = await wait_for(seen_on_f2, 30, "the offset on another node", cluster)
        assert got.offset == 17
        async with aiohttp.ClientSession() as s:

            async def applied_on_f2() -> bool:
                # Served on the leader; the follower's own replica applies it too.
                async with s.get(
                    f"{cluster.urls[f2]}/v1/groups/{GROUP}/offsets", params={"topic": TOPIC}
                ) as r:
                    body = await r.json()
                return body.get("offsets") == [{"topic": TOPIC, "queue": 0, "offset": 17}]

            await wait_for(applied_on_f2, 30, "the offset over HTTP", cluster)
        other = spb.GetOffsetRequest(group=pb.Resource(name="nobody"), message_queue=mq())
        assert (await one.GetOffset(other, timeout=5)).status.code == Code.OFFSET_NOT_FOUND

        # ------------------------------------------------------------ queue offsets
        assert (
            await two.QueryOffset(
                spb.QueryOffsetRequest(message_queue=mq(), query_offset_policy=Policy.BEGINNING),
                timeout=5,
            )
        ).offset == 0
        probes = [0, store_ms[0], store_ms[0] + 1, store_ms[14], store_ms[-1], store_ms[-1] + 1]
        for ts in probes:
            answer = await query(two, Policy.TIMESTAMP, ts)
            assert answer.status.code == Code.OK, answer.status
            expected = next((i for i, t in enumerate(store_ms) if t >= ts), MESSAGES)
            assert answer.offset == expected, (ts, store_ms)

        # ------------------------------------------------------------ pulls from a follower
        code, messages, next_offset = await pull(one, pull_req(0, batch=4))
        assert code == Code.OK
        assert [m.body for m in messages] == [b"m0", b"m1", b"m2", b"m3"]
        assert [m.system_properties.queue_offset for m in messages] == [0, 1, 2, 3]
        assert next_offset == 4
        first = messages[0].system_properties
        assert first.tag == "a" and first.message_id == stored[0]["msg_id"]
        assert first.delivery_attempt == 1 and not first.receipt_handle
        assert first.store_timestamp.ToMilliseconds() == store_ms[0]

        # A tag filter, page by page to the end: every "a" message once, in order.
        offset, seen = 0, []
        for _ in range(MESSAGES):
            code, messages, next_offset = await pull(one, pull_req(offset, batch=3, tags="a"))
            assert code in (Code.OK, Code.MESSAGE_NOT_FOUND)
            assert next_offset is not None and next_offset > offset or offset == MESSAGES
            assert all(m.system_properties.tag == "a" for m in messages)
            seen += [m.body.decode() for m in messages]
            offset = next_offset or offset
            if code == Code.MESSAGE_NOT_FOUND:
                break
        assert seen == [f"m{i}" for i in range(MESSAGES) if tag_of(i) == "a"]
        assert offset == MESSAGES
        code, messages, _ = await pull(one, pull_req(0, batch=100, tags="b || a"))
        assert len(messages) == 20

        # At the end: nothing without a wait, nothing after a short one, past it an error.
        assert await pull(one, pull_req(MESSAGES)) == (Code.MESSAGE_NOT_FOUND, [], MESSAGES)
        t0 = time.monotonic()
        assert await pull(one, pull_req(MESSAGES, poll_ms=300)) == (
            Code.MESSAGE_NOT_FOUND,
            [],
            MESSAGES,
        )
        assert time.monotonic() - t0 >= 0.3
        assert await pull(on_leader, pull_req(MESSAGES + 5)) == (
            Code.ILLEGAL_OFFSET,
            [],
            MESSAGES,
        )
        # The call's deadline bounds the long poll: an answer, not DEADLINE_EXCEEDED.
        t0 = time.monotonic()
        code, _, _ = await pull(one, pull_req(MESSAGES, poll_ms=60_000), timeout_s=2)
        assert code == Code.MESSAGE_NOT_FOUND and time.monotonic() - t0 < 2

        # A long poll for tag "a" on a follower, woken by new messages: a "b" passes it by.
        # It waits on the follower before anything is produced (its waiter is seen there), so
        # the message wakes it rather than being there when it starts.
        waiting = asyncio.create_task(
            pull(one, pull_req(MESSAGES, tags="a", poll_ms=20_000), timeout_s=30)
        )
        async with aiohttp.ClientSession() as s:

            async def registered() -> bool:
                async with s.get(f"{cluster.urls[f1]}/v1/admin/node") as r:
                    return bool((await r.json())["pull_waiters"])

            await wait_for(registered, 20, "the long poll waiting on the follower", cluster)
            assert not waiting.done()
            t0 = time.monotonic()
            await produce(s, url, [("late-b", "b")])
            await produce(s, url, [("late-a", "a")])
        code, messages, next_offset = await asyncio.wait_for(waiting, 30)
        assert code == Code.OK
        assert [m.body for m in messages] == [b"late-a"]
        assert messages[0].system_properties.queue_offset == MESSAGES + 1
        assert next_offset == MESSAGES + 2
        assert time.monotonic() - t0 < 15, "the long poll was not woken"

        # ------------------------------------------------------------ bad input
        pulls = [
            (pull_req(0, group=""), Code.ILLEGAL_CONSUMER_GROUP),
            (pull_req(0, topic="bad topic"), Code.ILLEGAL_TOPIC),
            (pull_req(0, topic="no_such_topic"), Code.TOPIC_NOT_FOUND),
            (pull_req(0, queue=5), Code.NOT_FOUND),
            (pull_req(-1), Code.ILLEGAL_OFFSET),
            (pull_req(0, batch=-1), Code.BAD_REQUEST),
            (pull_req(0, poll_ms=-1000), Code.ILLEGAL_POLLING_TIME),
            (pull_req(0, tags="a || *"), Code.ILLEGAL_FILTER_EXPRESSION),
            (pull_req(0, tags="a > 1", sql=True), Code.UNSUPPORTED),
        ]
        for req, expected in pulls:
            code, _, _ = await pull(one, req)
            assert code == expected, (req, code)
        updates = [
            (
                spb.UpdateOffsetRequest(
                    group=pb.Resource(name=GROUP), message_queue=mq(), offset=-1
                ),
                Code.ILLEGAL_OFFSET,
            ),
            (
                spb.UpdateOffsetRequest(group=pb.Resource(name=""), message_queue=mq(), offset=1),
                Code.ILLEGAL_CONSUMER_GROUP,
            ),
            (
                spb.UpdateOffsetRequest(
                    group=pb.Resource(name=GROUP), message_queue=mq(queue=5), offset=1
                ),
                Code.NOT_FOUND,
            ),  # checked on the leader, after the forward
            (
                spb.UpdateOffsetRequest(
                    group=pb.Resource(name=GROUP), message_queue=mq("no_such_topic"), offset=1
                ),
                Code.TOPIC_NOT_FOUND,
            ),
        ]
        for update_req, expected in updates:
            answer = await two.UpdateOffset(update_req, timeout=10)
            assert answer.status.code == expected, (update_req, answer.status)
        no_ts = spb.QueryOffsetRequest(message_queue=mq(), query_offset_policy=Policy.TIMESTAMP)
        assert (await two.QueryOffset(no_ts, timeout=5)).status.code == Code.BAD_REQUEST
        unknown = spb.QueryOffsetRequest(
            message_queue=mq("no_such_topic"), query_offset_policy=Policy.END
        )
        assert (await two.QueryOffset(unknown, timeout=5)).status.code == Code.TOPIC_NOT_FOUND
        bad_group = spb.GetOffsetRequest(group=pb.Resource(name="a b"), message_queue=mq())
        assert (await two.GetOffset(bad_group, timeout=5)).status.code == (
            Code.ILLEGAL_CONSUMER_GROUP
        )

    # Metrics per RPC and code, on the follower that served the pulls.
    async with aiohttp.ClientSession() as s, s.get(f"{cluster.urls[f1]}/metrics") as r:
        text = await r.text()
    assert 'chronomq_grpc_requests_total{code="OK",rpc="PullMessage"}' in text
    assert 'chronomq_grpc_requests_total{code="ILLEGAL_OFFSET",rpc="PullMessage"}' in text
    assert "chronomq_grpc_messages_pulled_total" in text
