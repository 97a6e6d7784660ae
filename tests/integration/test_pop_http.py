"""Pop consumption over HTTP on 3 real nodes: receive, ack, change the invisible time and
forward to the DLQ through followers (which forward to the leader), a long poll woken by a
produce, and bad requests answered 4xx naming the field."""

from __future__ import annotations

import asyncio
import time
import urllib.parse
from typing import Any

import aiohttp
import pytest

from chronomq.cluster.node.popcalls import RECHECK_S
from chronomq.cluster.process.launcher import LocalCluster
from tests.integration.conftest import wait_for

pytestmark = pytest.mark.integration


async def post(s: aiohttp.ClientSession, url: str, body: Any) -> tuple[int, dict[str, Any]]:
    async with s.post(url, json=body) as r:
        return r.status, await r.json()


def follower(cluster: LocalCluster, leader: int, k: int = 0) -> str:
    return cluster.urls[[i for i in range(cluster.n) if i != leader][k]]


async def test_pop_ack_change_and_dlq_through_followers(make_cluster: Any) -> None:
    cluster = make_cluster(3)
    leader = cluster.wait_leader(60)
    cluster.wait_all_know_leader(60)
    a, b = follower(cluster, leader, 0), follower(cluster, leader, 1)
    async with aiohttp.ClientSession() as s:
        msgs = [{"body": f"job-{i}", "tags": "T", "keys": [f"k{i}"]} for i in range(5)]
        status, _ = await post(s, f"{a}/v1/topics/jobs/messages", {"messages": msgs})
        assert status == 200
        status, got = await post(
            s, f"{a}/v1/groups/workers/pop", {"topic": "jobs", "max": 3, "invisible_ms": 60_000}
        )
        assert status == 200, got
        first = got["messages"]
        assert len(first) == 3
        assert all(m["delivery_attempt"] == 1 and m["receipt_handle"] for m in first)
        assert {m["body"] for m in first} <= {m["body"] for m in msgs}
        # The rest, from another node: nothing handed out twice.
        status, got = await post(s, f"{b}/v1/groups/workers/pop", {"topic": "jobs", "max": 32})
        rest = got["messages"]
        assert sorted(m["body"] for m in first + rest) == sorted(m["body"] for m in msgs)

        h = [m["receipt_handle"] for m in first]
        status, got = await post(s, f"{b}/v1/groups/workers/ack", {"receipt_handles": h[:1]})
        assert status == 200 and got["results"][0]["status"] == "acked", got
        status, got = await post(s, f"{a}/v1/groups/workers/ack", {"receipt_handles": h[:1]})
        assert got["results"][0]["status"] == "already_acked"

        status, got = await post(
            s, f"{a}/v1/groups/workers/invisible", {"receipt_handle": h[1], "invisible_ms": 1000}
        )
        assert status == 200 and got["status"] == "changed" and got["receipt_handle"] != h[1]
        status, stale = await post(s, f"{b}/v1/groups/workers/ack", {"receipt_handles": [h[1]]})
        assert stale["results"][0]["status"] == "expired"
        # Back after its new invisible time, with the next attempt.
        again: list[dict[str, Any]] = []

        async def back() -> bool:
            _, got = await post(s, f"{b}/v1/groups/workers/pop", {"topic": "jobs", "wait_ms": 1000})
            again.extend(got["messages"])
            return bool(again)

        await wait_for(back, 30, "the changed message to come back", cluster)
        assert again[0]["body"] == first[1]["body"] and again[0]["delivery_attempt"] == 2

        status, got = await post(s, f"{a}/v1/groups/workers/dlq", {"receipt_handle": h[2]})
        assert status == 200 and got["status"] == "forwarded"
        dlq = urllib.parse.quote("%DLQ%workers", safe="")

        async def dead() -> bool:
            async with s.get(f"{b}/v1/topics/{dlq}/queues/0/messages") as r:
                return r.status == 200 and [m["body"] for m in (await r.json())["messages"]] == [
                    first[2]["body"]
                ]

        await wait_for(dead, 30, "the forwarded message in the DLQ", cluster)


async def node_view(s: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with s.get(f"{url}/v1/admin/node") as r:
        assert r.status == 200
        data: dict[str, Any] = await r.json()
        return data


async def test_a_long_poll_is_woken_by_a_produce(make_cluster: Any) -> None:
    """The poll (sent to a follower, served by the leader) waits before the message is produced
    (its waiter is seen on the leader), and the message wakes it: not found at once, not found
    by the poll's periodic recheck."""
    cluster = make_cluster(3)
    leader = cluster.wait_leader(60)
    cluster.wait_all_know_leader(60)
    a = follower(cluster, leader)
    served = cluster.urls[leader]
    async with aiohttp.ClientSession() as s:
        # The topic exists (and its first message is taken) before the poll starts.
        status, _ = await post(s, f"{a}/v1/topics/later/messages", {"messages": [{"body": "0"}]})
        assert status == 200

        async def first() -> bool:
            _, got = await post(s, f"{a}/v1/groups/g/pop", {"topic": "later", "wait_ms": 500})
            return [m["body"] for m in got["messages"]] == ["0"]

        await wait_for(first, 30, "the first message popped", cluster)
        before = await node_view(s, served)
        assert before["pull_waiters"] == 0, before
        poll = asyncio.create_task(
            post(s, f"{a}/v1/groups/g/pop", {"topic": "later", "wait_ms": 20_000})
        )

        async def waiting() -> bool:
            return bool((await node_view(s, served))["pull_waiters"])

        await wait_for(waiting, 20, "the long poll waiting on the leader", cluster)
        assert not poll.done()
        t0 = time.monotonic()
        status, _ = await post(s, f"{a}/v1/topics/later/messages", {"messages": [{"body": "x"}]})
        assert status == 200
        status, got = await asyncio.wait_for(poll, 30)
        assert status == 200 and [m["body"] for m in got["messages"]] == ["x"]
        # Woken by the message, not by the recheck every RECHECK_S (nor wait_ms).
        assert (await node_view(s, served))["pull_wakes"] > before["pull_wakes"]
        assert time.monotonic() - t0 < RECHECK_S, "the long poll was not woken"
        # Nothing left: an empty answer once wait_ms passes.
        status, got = await post(s, f"{a}/v1/groups/g/pop", {"topic": "later", "wait_ms": 200})
        assert status == 200 and got == {"messages": []}


BAD: list[tuple[str, Any, str]] = [
    ("pop", {}, "topic"),
    ("pop", {"topic": "jobs", "max": 0}, "max"),
    ("pop", {"topic": "jobs", "max": 33}, "max"),
    ("pop", {"topic": "jobs", "invisible_ms": 10}, "invisible_ms"),
    ("pop", {"topic": "jobs", "wait_ms": -1}, "wait_ms"),
    ("pop", {"topic": "jobs", "queue": 99}, "queue"),
    ("pop", {"topic": "jobs", "tags": "T"}, "tags"),
    ("pop", {"topic": "jobs", "max": True}, "max"),
    ("pop", {"topic": "jobs", "extra": 1}, "extra"),
    ("pop", {"topic": "rmq_sys_wheel_timer"}, "topic"),
    ("pop", {"topic": "bad topic"}, "topic"),
    ("pop", [], "body"),
    ("ack", {"receipt_handles": []}, "receipt_handles"),
    ("ack", {"receipt_handles": ["v1.AAAA"]}, "receipt_handle"),
    ("ack", {"receipt_handles": [7]}, "receipt_handles[0]"),
    ("invisible", {"receipt_handle": "v1.AAAA"}, "invisible_ms"),
    ("invisible", {"receipt_handle": "v1.AAAA", "invisible_ms": 5000}, "receipt_handle"),
    ("dlq", {"receipt_handle": ""}, "receipt_handle"),
]


async def test_bad_pop_requests_are_4xx_naming_the_field(make_cluster: Any) -> None:
    cluster = make_cluster(3)
    leader = cluster.wait_leader(60)
    cluster.wait_all_know_leader(60)
    a = follower(cluster, leader)
    async with aiohttp.ClientSession() as s:
        status, _ = await post(s, f"{a}/v1/topics/jobs/messages", {"messages": [{"body": "x"}]})
        assert status == 200
        for node in (cluster.urls[leader], a):
            for route, body, field in BAD:
                status, got = await post(s, f"{node}/v1/groups/g/{route}", body)
                assert 400 <= status < 500, (route, body, status, got)
                assert got["field"] == field, (route, body, got)
                assert got["error"] and got["message"]
            status, got = await post(s, f"{node}/v1/groups/%25bad%25/pop", {"topic": "jobs"})
            assert status == 400 and got["field"] == "group", got
        # A handle is its group's: another group cannot ack it.
        _, got = await post(s, f"{a}/v1/groups/g/pop", {"topic": "jobs"})
        handle = got["messages"][0]["receipt_handle"]
        status, got = await post(s, f"{a}/v1/groups/other/ack", {"receipt_handles": [handle]})
        assert status == 400 and got["field"] == "receipt_handles[0]", got
        tampered = handle[:-2] + ("A" if handle[-2] != "A" else "B") + handle[-1]
        status, got = await post(s, f"{a}/v1/groups/g/ack", {"receipt_handles": [tampered]})
        assert status == 400 and got["error"] == "invalid_receipt_handle", got
