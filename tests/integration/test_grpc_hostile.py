"""Hostile RocketMQ 5 clients against real nodes, with raw gRPC stubs: values past every bound,
spoofed message ids, forged recall handles, RocketMQ's own system topics."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import time
import urllib.parse
import urllib.request
from typing import Any

import aiohttp
import grpc
import pytest
from rocketmq import ClientConfiguration, Credentials, Producer
from rocketmq.grpc_protocol import definition_pb2 as pb
from rocketmq.grpc_protocol import service_pb2 as spb
from rocketmq.grpc_protocol import service_pb2_grpc as spb_grpc

from chronomq.cluster.process.launcher import LocalCluster
from tests.integration.conftest import wait_for
from tests.integration.test_grpc import message, raw_send

pytestmark = pytest.mark.integration

Code = pb.Code


def tracebacks(cluster: LocalCluster) -> list[str]:
    found = []
    for i in range(cluster.n):
        text = (cluster.node_dir(i) / "node.log").read_text(errors="replace")
        found += [line[:300] for line in text.splitlines() if "Traceback" in line]
    return found


async def test_huge_delivery_times_are_refused_alike_on_a_follower_and_the_leader(
    make_cluster: Any,
) -> None:
    cluster: LocalCluster = make_cluster()
    leader = cluster.wait_leader(60)
    cluster.wait_all_know_leader(30)
    follower = (leader + 1) % 3
    huge = [2**62, 2**63 - 1, 253_402_300_800]
    for node in (follower, leader):
        async with grpc.aio.insecure_channel(cluster.grpc_address(node)) as channel:
            stub = spb_grpc.MessagingServiceStub(channel)
            for seconds in huge:
                req = raw_send("huge_times", b"x")
                req.messages[0].system_properties.delivery_timestamp.seconds = seconds
                answer = await stub.SendMessage(req, timeout=15)
                assert answer.status.code == Code.ILLEGAL_DELIVERY_TIME, (node, seconds, answer)
                assert "delivery_timestamp" in answer.status.message, answer.status
            query = spb.QueryOffsetRequest(
                message_queue=pb.MessageQueue(topic=pb.Resource(name="huge_times"), id=0),
                query_offset_policy=pb.QueryOffsetPolicy.TIMESTAMP,
            )
            query.timestamp.seconds = 2**62
            answer = await stub.QueryOffset(query, timeout=15)
            assert answer.status.code != Code.INTERNAL_ERROR, answer.status
    # The HTTP API on both, for every time field (a delay level past the table is clamped to
    # its last level, as RocketMQ does).
    async with aiohttp.ClientSession() as s:
        for node in (follower, leader):
            for field, value in (
                ("deliver_at_ms", 2**63 - 1),
                ("deliver_at_ms", 2**64),
                ("delay_ms", 2**63 - 1),
            ):
                async with s.post(
                    f"{cluster.http_url(node)}/v1/topics/huge_times/messages",
                    json={"messages": [{"body": "x", field: value}]},
                ) as r:
                    answer = await r.json()
                    assert r.status == 400, (node, field, value, answer)
                    assert field in (answer["field"] or ""), answer
    assert tracebacks(cluster) == []


async def test_message_ids_cannot_be_spoofed(make_cluster: Any) -> None:
    """A consumer sees the producer's id (UNIQ_KEY): only a send's message_id sets it, it is
    bounded, and no second message of the topic takes an id another producer used."""
    cluster: LocalCluster = make_cluster(1)
    cluster.wait_leader(60)
    url = cluster.http_url(0)
    topic = "spoofed"
    victim = "0A0B0C0D0E0F00112233445566778899AA"
    async with grpc.aio.insecure_channel(cluster.grpc_address(0)) as channel:
        stub = spb_grpc.MessagingServiceStub(channel)
        real = await stub.SendMessage(raw_send(topic, b"real", message_id=victim), timeout=15)
        assert real.status.code == Code.OK and real.entries[0].message_id == victim
        cases = [
            (raw_send(topic, b"fake", message_id=victim), Code.ILLEGAL_MESSAGE_ID),
            (raw_send(topic, b"fake", user_properties={"UNIQ_KEY": victim}), None),
            (raw_send(topic, b"fake", message_id="A" * 20_003), Code.ILLEGAL_MESSAGE_ID),
        ]
        batch = raw_send(topic, b"fake", message_id=victim)
        other = batch.messages.add()
        other.CopyFrom(batch.messages[0])
        other.system_properties.message_id = "another-id"
        cases.append((batch, Code.BAD_REQUEST))
        for req, code in cases:
            answer = await stub.SendMessage(req, timeout=15)
            if code is None:
                assert answer.status.code == Code.ILLEGAL_MESSAGE_PROPERTY_KEY, answer.status
            else:
                assert answer.status.code == code, (req, answer.status)
    async with aiohttp.ClientSession() as s:
        for message, headers, status, field in (
            ({"body": "fake", "properties": {"UNIQ_KEY": victim}}, {}, 400, "properties.UNIQ_KEY"),
            ({"body": "fake", "message_id": "A" * 20_003}, {}, 400, "message_id"),
            ({"body": "fake", "message_id": "a b"}, {}, 400, "message_id"),
            ({"body": "fake", "message_id": victim}, {}, 422, None),
            ({"body": "fake", "message_id": victim}, {"Idempotency-Key": "mine"}, 400, None),
        ):
            async with s.post(
                f"{url}/v1/topics/{topic}/messages", json={"messages": [message]}, headers=headers
            ) as r:
                answer = await r.json()
                assert r.status == status, (message, answer)
                if field is not None:
                    assert answer["field"] == f"messages[0].{field}", answer
        # The same message again is the first one's placement, not a second copy.
        async with s.post(
            f"{url}/v1/topics/{topic}/messages",
            json={"messages": [{"body_base64": "cmVhbA==", "message_id": victim}]},
        ) as r:
            again = await r.json()
            assert r.status == 200 and again.get("duplicate") is True, again
        stored = []
        for q in range(4):
            async with s.get(f"{url}/v1/topics/{topic}/queues/{q}/messages?offset=0") as r:
                stored += (await r.json())["messages"] if r.status == 200 else []
    assert [(m["properties"].get("UNIQ_KEY"), m["body"]) for m in stored] == [(victim, "real")]


async def test_recall_handles_are_signed_and_bound_to_their_topic(make_cluster: Any) -> None:
    cluster: LocalCluster = make_cluster(1)
    cluster.wait_leader(60)
    url = cluster.http_url(0)
    later_s = int(time.time()) + 3600

    def timer(message_id: str) -> spb.SendMessageRequest:
        req = raw_send("recalled", b"due later", message_id=message_id)
        req.messages[0].system_properties.delivery_timestamp.seconds = later_s
        return req

    def recall(topic: str, handle: str) -> spb.RecallMessageRequest:
        return spb.RecallMessageRequest(topic=pb.Resource(name=topic), recall_handle=handle)

    async with grpc.aio.insecure_channel(cluster.grpc_address(0)) as channel:
        stub = spb_grpc.MessagingServiceStub(channel)
        sent = await stub.SendMessage(timer("victim-1"), timeout=15)
        assert sent.status.code == Code.OK, sent.status
        handle = sent.entries[0].recall_handle
        timer_id = handle.split(".")[1]
        # Made up from the message id alone (the old, unsigned form), or with a changed part,
        # or for another topic: refused, and the timer still waits.
        for topic, forged in (
            ("recalled", f"c1.{timer_id}.victim-1"),
            ("recalled", f"c1.{timer_id}."),
            ("recalled", handle.replace("victim-1", "victim-2")),
            ("other", handle),
        ):
            answer = await stub.RecallMessage(recall(topic, forged), timeout=15)
            assert answer.status.code == Code.BAD_REQUEST, (forged, answer.status)
        async with aiohttp.ClientSession() as s:

            async def waiting() -> bool:
                async with s.get(f"{url}/v1/messages/{timer_id}") as r:
                    return (await r.json()).get("status") == "waiting"

            # The timer takes the message into its wheel a moment after the send's commit.
            await wait_for(waiting, 15, "the timer message waiting in the wheel", cluster)
        answer = await stub.RecallMessage(recall("recalled", handle), timeout=15)
        assert answer.status.code == Code.OK and answer.message_id == "victim-1", answer.status


TOKEN = "grpc-hostile-token-0123456789"
ACCESS_KEY = "chronomq-ak"


def signature(date: str, access_key: str = ACCESS_KEY) -> tuple[tuple[str, str], ...]:
    sig = hmac.new(TOKEN.encode(), date.encode(), hashlib.sha1).hexdigest()
    return (
        ("x-mq-date-time", date),
        (
            "authorization",
            f"MQv2-HMAC-SHA1 Credential={access_key}, SignedHeaders=x-mq-date-time, "
            f"Signature={sig}",
        ),
    )


def rocketmq_date(at_s: float) -> str:
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(at_s))


async def test_a_signature_expires_names_the_access_key_and_comes_once(
    make_cluster: Any,
) -> None:
    cluster: LocalCluster = make_cluster(1, auth_token=TOKEN, access_key=ACCESS_KEY)
    cluster.wait_leader(60)
    topic = "signed"
    # The official client, with the configured credential, works unchanged.
    config = ClientConfiguration(
        cluster.grpc_endpoints, Credentials(ACCESS_KEY, TOKEN), request_timeout=10
    )
    producer = Producer(config, (topic,))
    await asyncio.to_thread(producer.startup)
    try:
        receipt = await asyncio.to_thread(producer.send, message(topic, b"signed"))
        assert receipt.message_id
    finally:
        await asyncio.to_thread(producer.shutdown)
    route = spb.QueryRouteRequest(topic=pb.Resource(name=topic))
    async with grpc.aio.insecure_channel(cluster.grpc_address(0)) as channel:
        stub = spb_grpc.MessagingServiceStub(channel)
        fresh = signature(rocketmq_date(time.time()))
        answer = await stub.QueryRoute(route, metadata=fresh, timeout=10)
        assert answer.status.code == Code.OK
        refused = [
            signature(rocketmq_date(time.time() - 20 * 60)),  # captured 20 minutes ago
            signature(rocketmq_date(time.time() + 20 * 60)),
            signature("20200101T000000Z"),
            signature(rocketmq_date(time.time()), access_key="someone-else"),
            fresh + (("authorization", f"Bearer {TOKEN}"),),
            fresh + (("x-mq-date-time", rocketmq_date(time.time() - 3600)),),
            (
                fresh[0],
                ("authorization", fresh[1][1] + ", Signature=" + "0" * 40),
            ),
        ]
        for md in refused:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.QueryRoute(route, metadata=md, timeout=10)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, md


ROCKETMQ_RESERVED = [
    "%DLQ%phantom",
    "%RETRY%phantom",
    "RMQ_SYS_TRANS_HALF_TOPIC",
    "TBW102",
    "OFFSET_MOVED_EVENT",
    "SELF_TEST_TOPIC",
    "BenchmarkTest",
    "RMQ_SYS_TRACE_TOPIC",
]


async def test_rocketmq_system_topics_are_refused_and_group_topics_are_their_groups(
    make_cluster: Any,
) -> None:
    cluster: LocalCluster = make_cluster(1)
    cluster.wait_leader(60)
    url = cluster.http_url(0)
    async with aiohttp.ClientSession() as s:

        async def post(path: str, body: Any) -> tuple[int, Any]:
            async with s.post(f"{url}{path}", json=body) as r:
                return r.status, await r.json()

        for topic in ROCKETMQ_RESERVED:
            quoted = urllib.parse.quote(topic, safe="")
            status, answer = await post(
                f"/v1/topics/{quoted}/messages", {"messages": [{"body": "x"}]}
            )
            assert (status, answer["field"]) == (400, "topic"), (topic, answer)
            async with s.put(f"{url}/v1/topics/{quoted}", json={"queues": 1}) as r:
                assert r.status == 400, (topic, await r.json())
        # A real dead-letter topic: billing sends a consumed message straight to it.
        assert (await post("/v1/topics/orders/messages", {"messages": [{"body": "o"}]}))[0] == 200
        status, answer = await post(
            "/v1/groups/billing/retry",
            {"topic": "orders", "queue": 0, "offset": 0, "delay_level": -1},
        )
        assert status == 200 and answer["topic"] == "%DLQ%billing", answer
        pop = {"topic": "%DLQ%billing", "invisible_ms": 10_000}
        status, answer = await post("/v1/groups/thief/pop", pop)
        assert (status, answer["error"]) == (403, "not_group_topic"), answer
        status, answer = await post("/v1/groups/billing/pop", pop)
        assert status == 200 and len(answer["messages"]) == 1, answer
        async with s.get(f"{url}/v1/groups") as r:
            groups = {g["group"] for g in (await r.json())["groups"]}
        assert "phantom" not in groups and "billing" in groups, groups

    async with grpc.aio.insecure_channel(cluster.grpc_address(0)) as channel:
        stub = spb_grpc.MessagingServiceStub(channel)
        for topic in ROCKETMQ_RESERVED:
            answer = await stub.SendMessage(raw_send(topic, b"x"), timeout=15)
            assert answer.status.code in (Code.BAD_REQUEST, Code.ILLEGAL_TOPIC), (topic, answer)
            route = spb.QueryRouteRequest(topic=pb.Resource(name=topic))
            assert (await stub.QueryRoute(route, timeout=15)).status.code != Code.OK, topic
        dlq = pb.MessageQueue(topic=pb.Resource(name="%DLQ%billing"), id=0)
        receive = spb.ReceiveMessageRequest(
            group=pb.Resource(name="thief"), message_queue=dlq, batch_size=1
        )
        receive.invisible_duration.seconds = 30
        receive.long_polling_timeout.seconds = 0
        answers = [a async for a in stub.ReceiveMessage(receive, timeout=15)]
        assert [a.status.code for a in answers if a.HasField("status")] == [Code.FORBIDDEN]
        pull = spb.PullMessageRequest(
            group=pb.Resource(name="thief"), message_queue=dlq, offset=0, batch_size=1
        )
        answers = [a async for a in stub.PullMessage(pull, timeout=15)]
        assert [a.status.code for a in answers if a.HasField("status")] == [Code.FORBIDDEN]
    async with aiohttp.ClientSession() as s, s.get(f"{url}/v1/groups") as r:
        assert "phantom" not in {g["group"] for g in (await r.json())["groups"]}


async def telemetry_open(cluster: LocalCluster) -> float:
    def read() -> float:
        with urllib.request.urlopen(f"{cluster.http_url(0)}/metrics", timeout=5) as r:  # noqa: S310
            text = r.read().decode()
        for line in text.splitlines():
            if line.startswith("chronomq_grpc_telemetry_streams "):
                return float(line.split()[1])
        raise AssertionError("no chronomq_grpc_telemetry_streams in /metrics")

    return await asyncio.to_thread(read)


async def test_idle_telemetry_streams_cannot_fill_the_call_limit(make_cluster: Any) -> None:
    cluster: LocalCluster = make_cluster(
        1, grpc_max_telemetry_streams=40, grpc_telemetry_settings_timeout_ms=3000
    )
    cluster.wait_leader(60)
    target = cluster.grpc_address(0)
    # A subchannel pool of its own each: one connection per channel.
    separate = [("grpc.use_local_subchannel_pool", 1)]
    channels = [grpc.aio.insecure_channel(target, options=separate) for _ in range(4)]
    try:
        stubs = [spb_grpc.MessagingServiceStub(c) for c in channels]

        def idle(stub: Any, client_id: str) -> Any:
            return stub.Telemetry(metadata=(("x-mq-client-id", client_id),))

        # One client id: its ninth stream closes its first (RESOURCE_EXHAUSTED); the rest,
        # which never send settings, are closed after the timeout.
        calls = [idle(stubs[0], "abuser") for _ in range(12)]
        codes = await asyncio.wait_for(asyncio.gather(*(c.code() for c in calls)), 30)
        assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) == 4, codes
        assert codes.count(grpc.StatusCode.DEADLINE_EXCEEDED) == 8, codes
        assert await telemetry_open(cluster) == 0

        # One connection, many client ids: 16 held, the rest refused.
        calls = [idle(stubs[0], f"one-conn-{i}") for i in range(20)]
        codes = await asyncio.wait_for(asyncio.gather(*(c.code() for c in calls)), 30)
        assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) == 4, codes
        assert codes.count(grpc.StatusCode.DEADLINE_EXCEEDED) == 16, codes

        # Many connections and ids: 40 in all; the other calls keep their room meanwhile.
        calls = [idle(stubs[1 + i % 3], f"many-{i}") for i in range(48)]
        route = spb.QueryRouteRequest(topic=pb.Resource(name="served"))
        answer = await stubs[0].QueryRoute(route, timeout=10)
        assert answer.status.code == Code.OK
        sent = await stubs[0].SendMessage(raw_send("served", b"still served"), timeout=10)
        assert sent.status.code == Code.OK
        assert await telemetry_open(cluster) <= 40
        codes = await asyncio.wait_for(asyncio.gather(*(c.code() for c in calls)), 30)
        assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) == 8, codes
        assert await telemetry_open(cluster) == 0
    finally:
        for c in channels:
            await c.close()

    # An official client (it sends its settings at once) keeps its stream past the timeout.
    config = ClientConfiguration(cluster.grpc_endpoints, Credentials(), request_timeout=10)
    producer = Producer(config, ("served",))
    await asyncio.to_thread(producer.startup)
    try:
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            assert await telemetry_open(cluster) >= 1
            await asyncio.sleep(0.2)
        receipt = await asyncio.to_thread(producer.send, message("served", b"official"))
        assert receipt.message_id
    finally:
        await asyncio.to_thread(producer.shutdown)
