"""Hostile input at the edge: system topics and reserved property names are refused with a
400 naming the field, and the cluster keeps serving afterwards."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from chronomq.cluster.cli.client import Client
from tests.integration.conftest import pull_applied, wait_for

pytestmark = pytest.mark.integration

# Each: topic, message, the field the 400 names. The first is the probe that once made two
# nodes exit and replay the crash on every restart.
PROBES: list[tuple[str, dict[str, Any], str]] = [
    (
        "rmq_sys_wheel_timer",
        {
            "body": "x",
            "queue": 0,
            "properties": {"TIMER_OUT_MS": "1", "REAL_TOPIC": "nosuch", "REAL_QID": "5000"},
        },
        "topic",
    ),
    ("SCHEDULE_TOPIC_XXXX", {"body": "x", "tags": "9" * 19}, "topic"),
    ("rmq_sys_anything", {"body": "x"}, "topic"),
    (
        "orders",
        {"body": "x", "properties": {"REAL_QID": "\u00b2"}},
        "messages[0].properties.REAL_QID",
    ),
    (
        "orders",
        {"body": "x", "properties": {"a": "b", "REAL_TOPIC": "/tmp/x"}},
        "messages[0].properties.REAL_TOPIC",
    ),
    ("orders", {"body": "x", "properties": {"DELAY": "3"}}, "messages[0].properties.DELAY"),
    (
        "orders",
        {"body": "x", "delay_ms": 1000, "properties": {"TIMER_OUT_MS": "1"}},
        "messages[0].properties.TIMER_OUT_MS",
    ),
    (
        "orders",
        {"body": "x", "properties": {"TIMER_FUTURE_NAME": "1"}},
        "messages[0].properties.TIMER_FUTURE_NAME",
    ),
    (
        "orders",
        {"body": "x", "properties": {"ORIGIN_MESSAGE_ID": "A" * 32}},
        "messages[0].properties.ORIGIN_MESSAGE_ID",
    ),
    (
        "orders",
        {"body": "x", "properties": {"RETRY_TOPIC": "x", "RECONSUME_TIME": "99"}},
        "messages[0].properties.RETRY_TOPIC",
    ),
    ("orders", {"body": "x", "properties": {"KEYS": "k"}}, "messages[0].properties.KEYS"),
]


def test_reserved_topics_and_properties_are_refused_and_the_cluster_keeps_serving(
    make_cluster: Any,
) -> None:
    cluster = make_cluster(3)
    leader = cluster.wait_leader(60)
    follower = next(i for i in range(3) if i != leader)

    async def go() -> None:
        async with aiohttp.ClientSession() as s:
            for node in (leader, follower):
                for topic, message, field in PROBES:
                    async with s.post(
                        f"{cluster.http_url(node)}/v1/topics/{topic}/messages",
                        json={"messages": [message]},
                    ) as r:
                        body = await r.json()
                        assert r.status == 400, (topic, message, body)
                        assert body["field"] == field and body["error"], body
                async with s.put(
                    f"{cluster.http_url(node)}/v1/topics/rmq_sys_wheel_timer", json={"queues": 9}
                ) as r:
                    assert r.status == 400 and (await r.json())["field"] == "topic"
        # Every node still answers, and a produce and a consume work.
        async with Client(cluster.urls) as client:
            for i in range(3):
                view = await client.cluster(url=cluster.http_url(i))
                assert view["leader"] is not None
            placed = await client.send("orders", "still here", queue=0)

            async def consumed() -> bool:
                got = await pull_applied(client, "orders", 0, placed["offset"], 1)
                return [m["body"] for m in got] == ["still here"]

            await wait_for(consumed, 10, "the message after the probes")
        assert all(cluster.alive(i) for i in range(3))
        cluster.wait_converged(30)

    asyncio.run(go())


MEMBER_PROBES: list[tuple[dict[str, Any], str]] = [
    ({"id": 5, "raft": "127.0.0.1:19185", "http": "http://a b"}, "http"),
    ({"id": 5, "raft": "127.0.0.1:19185", "http": "ftp://x"}, "http"),
    ({"id": 5, "raft": "127.0.0.1:19185", "http": "http://u:p@x:1"}, "http"),
    ({"id": 5, "raft": "127.0.0.1:19185", "http": "http://x:99999"}, "http"),
    ({"id": 5, "raft": "a b:1", "http": "http://x:1"}, "raft"),
    ({"id": 5, "raft": "127.0.0.1:0", "http": "http://x:1"}, "raft"),
    ({"id": 5, "raft": "x:1", "http": "http://x:1", "fetch": "nope"}, "fetch"),
    ({"id": 5, "raft": "x:1", "http": "http://x:1", "extra": 1}, "extra"),
    ({"id": True, "raft": "x:1", "http": "http://x:1"}, "id"),
]


def test_members_are_validated_and_never_alias_another(make_cluster: Any) -> None:
    cluster = make_cluster(3)
    leader = cluster.wait_leader(60)

    async def go() -> None:
        async with aiohttp.ClientSession() as s:
            url = f"{cluster.http_url(leader)}/v1/admin/members"
            for body, field in MEMBER_PROBES:
                async with s.post(url, json=body) as r:
                    answer = await r.json()
                    assert r.status == 400 and answer["field"] == field, (body, answer)
            # Node 1's own addresses under another id: refused, naming what clashes.
            one_raft = f"127.0.0.1:{cluster.raft_port + 1}"
            one_http = cluster.http_url(1)
            for body, field in [
                ({"id": 1, "raft": "127.0.0.1:1", "http": "http://127.0.0.1:1"}, "id"),
                ({"id": 5, "raft": one_raft, "http": "http://127.0.0.1:1"}, "raft"),
                ({"id": 5, "raft": "127.0.0.1:1", "http": one_http}, "http"),
            ]:
                async with s.post(url, json=body) as r:
                    answer = await r.json()
                    assert r.status == 409 and answer["field"] == field, (body, answer)
            for i in range(3):
                async with s.get(f"{cluster.http_url(i)}/v1/admin/cluster") as r:
                    assert r.status == 200
                    view = await r.json()
                    assert sorted(n["id"] for n in view["nodes"]) == [0, 1, 2]

    asyncio.run(go())


def test_an_idempotency_key_is_scoped_to_its_topic(make_cluster: Any) -> None:
    cluster = make_cluster(3)
    leader = cluster.wait_leader(60)

    async def go() -> None:
        async with aiohttp.ClientSession() as s:

            async def produce(topic: str, body: str) -> dict[str, Any]:
                async with s.post(
                    f"{cluster.http_url(leader)}/v1/topics/{topic}/messages",
                    json={"messages": [{"body": body, "queue": 0}]},
                    headers={"Idempotency-Key": "1"},
                ) as r:
                    assert r.status == 200, await r.text()
                    answer: dict[str, Any] = await r.json()
                    return answer

            first = await produce("a", "first")
            other = await produce("b", "second")
            again = await produce("a", "first")
        assert not first["duplicate"] and not other["duplicate"] and again["duplicate"]
        assert again["results"] == first["results"]
        assert other["results"][0]["topic"] == "b"
        async with Client(cluster.urls) as client:
            for topic, body in (("b", "second"), ("a", "first")):

                async def stored(topic: str = topic) -> list[dict[str, Any]]:
                    return await pull_applied(client, topic, 0, 0, 10)

                got = await wait_for(stored, 10, f"the message in {topic}", cluster)
                assert [m["body"] for m in got] == [body]

    asyncio.run(go())
