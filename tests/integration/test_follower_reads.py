"""Reads on a follower see every write acknowledged before the read began, on 3 real nodes:
produce to the leader, read the answered offset from a follower at once (HTTP pull, lookup by
msg_id, topic description, gRPC PullMessage and QueryOffset), and a long poll on a follower for a topic
that does not exist yet gets the message that creates it."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import grpc
import pytest
from rocketmq.grpc_protocol import definition_pb2 as pb
from rocketmq.grpc_protocol import service_pb2 as spb
from rocketmq.grpc_protocol import service_pb2_grpc as spb_grpc

from chronomq.cluster.process.launcher import LocalCluster
from tests.integration.conftest import wait_for

pytestmark = pytest.mark.integration

ROUNDS = 200


async def _produce(s: aiohttp.ClientSession, url: str, topic: str, body: str) -> dict[str, Any]:
    async with s.post(
        f"{url}/v1/topics/{topic}/messages", json={"messages": [{"body": body}]}
    ) as r:
        assert r.status == 200, await r.text()
        result: dict[str, Any] = (await r.json())["results"][0]
        return result


async def _pull(
    s: aiohttp.ClientSession, url: str, topic: str, queue: int, offset: int, wait_ms: int = 0
) -> tuple[int, dict[str, Any]]:
    async with s.get(
        f"{url}/v1/topics/{topic}/queues/{queue}/messages",
        params={"offset": str(offset), "max": "1", "wait_ms": str(wait_ms)},
    ) as r:
        return r.status, await r.json()


async def test_a_follower_reads_what_the_leader_acknowledged(make_cluster: Any) -> None:
    cluster: LocalCluster = make_cluster(3)
    leader = cluster.wait_leader(60)
    cluster.wait_all_know_leader(30)
    followers = [i for i in range(3) if i != leader]
    leader_url = cluster.http_url(leader)
    misses: list[str] = []
    async with aiohttp.ClientSession() as s:
        for n in range(ROUNDS):
            # Even rounds a topic never seen, odd rounds one topic that grows.
            topic = f"fresh-{n}" if n % 2 == 0 else "growing"
            result = await _produce(s, leader_url, topic, f"m{n}")
            # A lookup by msg_id on one follower, a pull on the other, each at once.
            other = cluster.http_url(followers[(n + 1) % 2])
            async with s.get(f"{other}/v1/messages/{result['msg_id']}") as r:
                if r.status != 200:
                    misses.append(f"round {n}: GET /v1/messages/{result['msg_id']}: {r.status}")
            url = cluster.http_url(followers[n % 2])
            status, page = await _pull(s, url, topic, result["queue"], result["offset"])
            if status != 200:
                misses.append(f"round {n} ({topic}): {status} {page}")
            elif [m["msg_id"] for m in page["messages"]] != [result["msg_id"]]:
                misses.append(f"round {n} ({topic}): page {page}")
            if n % 2 == 0:
                fresh = f"described-{n}"
                await _produce(s, leader_url, fresh, "d")
                async with s.get(f"{url}/v1/topics/{fresh}") as r:
                    if r.status != 200:
                        misses.append(f"round {n}: GET /v1/topics/{fresh}: {r.status}")
    assert not misses, f"{len(misses)} of {ROUNDS} reads missed: " + "; ".join(misses[:10])


async def test_a_long_poll_on_a_follower_waits_for_a_new_topic(make_cluster: Any) -> None:
    cluster: LocalCluster = make_cluster(3)
    leader = cluster.wait_leader(60)
    cluster.wait_all_know_leader(30)
    follower = next(i for i in range(3) if i != leader)
    url = cluster.http_url(follower)
    async with aiohttp.ClientSession() as s:
        waiter = asyncio.create_task(_pull(s, url, "not-yet", 0, 0, wait_ms=20_000))

        async def waiting() -> bool:
            if waiter.done():
                return True  # the assertion below says what it answered
            async with s.get(f"{url}/v1/admin/node") as r:
                return bool((await r.json())["pull_waiters"])

        await wait_for(waiting, 10, "the long poll waiting on the follower", cluster)
        assert not waiter.done(), waiter.result()
        async with s.post(
            f"{cluster.http_url(leader)}/v1/topics/not-yet/messages",
            json={"messages": [{"body": "first", "queue": 0}]},
        ) as r:
            assert r.status == 200, await r.text()
        status, page = await asyncio.wait_for(waiter, 30)
    assert status == 200, page
    assert [m["body"] for m in page["messages"]] == ["first"]


def _mq(topic: str, queue: int) -> pb.MessageQueue:
    out = pb.MessageQueue(id=queue)
    out.topic.name = topic
    return out


async def test_grpc_reads_on_a_follower_see_acknowledged_writes(make_cluster: Any) -> None:
    cluster: LocalCluster = make_cluster(3)
    leader = cluster.wait_leader(60)
    cluster.wait_all_know_leader(30)
    followers = [i for i in range(3) if i != leader]
    misses: list[str] = []
    async with aiohttp.ClientSession() as s:
        channels = [grpc.aio.insecure_channel(cluster.grpc_address(i)) for i in followers]
        try:
            stubs = [spb_grpc.MessagingServiceStub(c) for c in channels]
            for n in range(ROUNDS // 4):
                topic = f"g-fresh-{n}" if n % 2 == 0 else "g-growing"
                result = await _produce(s, cluster.http_url(leader), topic, f"m{n}")
                stub = stubs[n % 2]
                req = spb.PullMessageRequest(
                    group=pb.Resource(name="g"),
                    message_queue=_mq(topic, result["queue"]),
                    offset=result["offset"],
                    batch_size=1,
                )
                answers = [a async for a in stub.PullMessage(req, timeout=10)]
                status = answers[0].status
                got = [a.message.system_properties.message_id for a in answers[1:-1]]
                if status.code != pb.Code.OK or got != [result["msg_id"]]:
                    misses.append(f"pull round {n} ({topic}): {status.code} {status.message}")
                query = spb.QueryOffsetRequest(
                    message_queue=_mq(topic, result["queue"]),
                    query_offset_policy=pb.QueryOffsetPolicy.END,
                )
                end = await stub.QueryOffset(query, timeout=10)
                if end.status.code != pb.Code.OK or end.offset != result["offset"] + 1:
                    misses.append(f"query round {n} ({topic}): {end.status} {end.offset}")
        finally:
            for c in channels:
                await c.close()
    assert not misses, f"{len(misses)} gRPC reads missed: " + "; ".join(misses[:10])
