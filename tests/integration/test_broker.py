"""The broker over HTTP with 3 real node processes: forwarding, reads anywhere, failover."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from typing import Any

import aiohttp
import pytest

import chronomq.aio
from chronomq.aio import Client
from chronomq.cluster.process.launcher import LocalCluster
from chronomq.errors import ApiError
from tests.integration.conftest import dump_logs, wait_for

pytestmark = pytest.mark.integration


def followers(cluster: LocalCluster, leader: int) -> list[int]:
    return [i for i in range(cluster.n) if i != leader and cluster.alive(i)]


def test_produce_through_follower_and_pull_anywhere(make_cluster: Any) -> None:
    cluster = make_cluster(3)
    leader = cluster.wait_leader(60)
    follower = followers(cluster, leader)[0]

    async def go() -> None:
        async with aiohttp.ClientSession() as s:
            url = f"{cluster.http_url(follower)}/v1/topics/greetings/messages"
            async with s.post(
                url, json={"messages": [{"body": "hello", "tags": "t", "keys": ["k1"]}]}
            ) as r:
                assert r.status == 200, await r.text()
                assert r.headers["X-Chronomq-Leader"] == cluster.http_url(leader)
                result = (await r.json())["results"][0]
            # A write another node forwarded here, taking this node for the leader, is not
            # forwarded again (that could loop): the answer names the leader, where the
            # client goes next.
            async with s.post(
                url,
                json={"messages": [{"body": "misrouted"}]},
                headers={"X-Chronomq-Forwarded": cluster.http_url(leader)},
            ) as r:
                body = await r.json()
                assert r.status == 503, body
                assert (body["error"], body["leader"]) == ("not_leader", cluster.http_url(leader))
        async with Client(cluster.urls) as client:
            for i in range(3):

                async def visible(i: int = i) -> bool:
                    try:
                        page = await client.pull(
                            "greetings", result["queue"], 0, 10, url=cluster.http_url(i)
                        )
                    except Exception:
                        return False
                    return any(m["msg_id"] == result["msg_id"] for m in page["messages"])

                await wait_for(visible, 10, f"message on node {i}")
            # Long-poll: a pull waiting on a follower wakes when a new message is applied.
            waiter = asyncio.create_task(
                client.pull(
                    "greetings",
                    result["queue"],
                    1,
                    10,
                    wait_ms=10_000,
                    url=cluster.http_url(follower),
                )
            )
            await asyncio.sleep(0.2)
            await client.produce("greetings", [{"body": "second", "queue": result["queue"]}])
            page = await waiter
            assert [m["body"] for m in page["messages"]] == ["second"]

    asyncio.run(go())


def test_cluster_view_is_the_same_from_every_node(make_cluster: Any) -> None:
    cluster = make_cluster(3)
    leader = cluster.wait_leader(60)

    async def go() -> None:
        async with Client(cluster.urls) as client:
            views = [await client.cluster(url=u) for u in cluster.urls]
        for v in views:
            assert v["leader"] == leader
            assert [(n["id"], n["role"], n["reachable"]) for n in v["nodes"]] == [
                (n["id"], n["role"], n["reachable"]) for n in views[0]["nodes"]
            ]
            assert {n["term"] for n in v["nodes"]} == {views[0]["term"]}

    asyncio.run(go())


def test_offsets_survive_failover_and_writes_resume_after_sigkill(make_cluster: Any) -> None:
    cluster = make_cluster(3)
    leader = cluster.wait_leader(60)

    async def go() -> None:
        async with Client(cluster.urls, deadline_s=30) as client:
            await client.create_topic("jobs", 2)
            await client.produce("jobs", [{"body": f"j{i}", "queue": i % 2} for i in range(10)])
            await client.commit_offset("workers", "jobs", 0, 3)
            await client.commit_offset("workers", "jobs", 1, 5)
            t_kill = time.monotonic()
            await asyncio.to_thread(cluster.kill, leader)
            await client.produce("jobs", [{"body": "after the kill"}])
            took = time.monotonic() - t_kill
            print(f"a new leader accepted a write {took:.2f} s after SIGKILL of the leader")
            for i in followers(cluster, leader):
                offsets = await client.offsets("workers", "jobs", url=cluster.http_url(i))
                assert [(o["queue"], o["offset"]) for o in offsets] == [(0, 3), (1, 5)]
        new_leader = cluster.wait_leader(30, among=followers(cluster, leader))
        status = subprocess.run(
            [
                sys.executable,
                "-m",
                "chronomq.cluster",
                "status",
                "--url",
                cluster.http_url(new_leader),
            ],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert status.returncode == 0, status.stderr
        assert "LAST_ELECTION_MS" in status.stdout
        async with Client([cluster.http_url(new_leader)]) as node:
            st = await node.node(cluster.http_url(new_leader))
        assert st["last_election_ms"] is not None and st["last_election_ms"] >= 0

    try:
        asyncio.run(go())
    except Exception:
        print(dump_logs(cluster))
        raise


def test_every_admin_endpoint_answers(make_cluster: Any) -> None:
    cluster = make_cluster(3)
    cluster.wait_leader(60)

    async def go() -> None:
        async with aiohttp.ClientSession() as s:
            for path in (
                "/v1/admin/node",
                "/v1/admin/cluster",
                "/v1/admin/digest",
                "/v1/admin/config",
                "/healthz",
                "/readyz",
                "/metrics",
                "/openapi.json",
                "/v1/topics",
            ):
                for url in cluster.urls:
                    async with s.get(url + path) as r:
                        assert r.status == 200, (url, path, await r.text())
            async with s.get(cluster.urls[0] + "/metrics") as r:
                assert "chronomq_raft_term" in await r.text()
            async with s.patch(
                cluster.urls[1] + "/v1/admin/config", json={"log_level": "debug"}
            ) as r:
                assert r.status == 200
            async with s.patch(cluster.urls[1] + "/v1/admin/config", json={"flush": "sync"}) as r:
                assert r.status == 409 and (await r.json())["field"] == "flush"

    asyncio.run(go())


def test_batching_producer_and_consumer_resume_from_committed_offset(make_cluster: Any) -> None:
    cluster = make_cluster(3)
    cluster.wait_leader(60)

    async def go() -> None:
        async with Client(cluster.urls) as client:
            await client.create_topic("feed", 1)
        async with chronomq.aio.Producer(cluster.urls, max_batch=100, linger_ms=5) as producer:
            results = await asyncio.gather(*(producer.send("feed", f"e{i}") for i in range(250)))
        assert sorted(r.offset for r in results) == list(range(250))
        got: list[str] = []
        first = chronomq.aio.Consumer(cluster.urls, "readers", "feed", auto_commit=False)
        async with first:
            while len(got) < 120:
                msg = await first.poll(5)
                assert msg is not None
                got.append(msg.text)
            await first.commit()
        rest: list[chronomq.aio.Message] = []
        async with chronomq.aio.Consumer(cluster.urls, "readers", "feed") as second:
            while len(got) + len(rest) < 250:
                msg = await second.poll(5)
                assert msg is not None
                rest.append(msg)
        # Two batches may be in flight at once, so order across batches is not fixed.
        assert [m.offset for m in rest] == list(range(len(got), 250))
        assert sorted(got + [m.text for m in rest]) == sorted(f"e{i}" for i in range(250))

    asyncio.run(go())


def test_every_delay_level_is_accepted_and_real_queues_are_checked(make_cluster: Any) -> None:
    cluster = make_cluster(3)
    cluster.wait_leader(60)

    async def go() -> None:
        async with Client(cluster.urls) as client:
            await client.create_topic("delayed", 2)
            for level in (1, 5, 18, 40):
                r = (await client.produce("delayed", [{"body": "x", "delay_level": level}]))[
                    "results"
                ][0]
                assert r["topic"] == "SCHEDULE_TOPIC_XXXX"
                assert r["queue"] == min(level, 18) - 1
                assert r.get("clamped", False) == (level > 18)
            schedule = await client.topic("SCHEDULE_TOPIC_XXXX")
            assert len(schedule["queues"]) == 18
            with pytest.raises(ApiError) as err:
                await client.produce("delayed", [{"body": "x", "delay_level": 2, "queue": 7}])
            assert err.value.status == 400 and err.value.body["field"] == "messages[0].queue"

    asyncio.run(go())


def test_leadership_transfer_moves_the_leader(make_cluster: Any) -> None:
    cluster = make_cluster(3)
    leader = cluster.wait_leader(60)
    target = next(i for i in range(3) if i != leader)

    async def go() -> None:
        async with Client(cluster.urls) as client:
            await client.produce("t", [{"body": "x"}])
            deadline = time.monotonic() + 30
            while True:
                try:
                    await client.request(
                        "POST",
                        "/v1/admin/leadership/transfer",
                        json_body={"to": target},
                        url=cluster.http_url(leader),
                    )
                    break
                except ApiError as exc:  # 409 while the target catches up
                    assert exc.status == 409 and time.monotonic() < deadline
                    await asyncio.sleep(0.1)
        assert await asyncio.to_thread(cluster.wait_leader, 30, [target]) == target

    asyncio.run(go())


def test_binary_bodies_round_trip(make_cluster: Any) -> None:
    import base64

    cluster = make_cluster(3)
    cluster.wait_leader(60)
    raw = bytes(range(256))

    async def go() -> None:
        async with Client(cluster.urls) as client:
            result = await client.produce(
                "bin", [{"body_base64": base64.b64encode(raw).decode(), "queue": 0}]
            )
            offset = result["results"][0]["offset"]
            leader_url = cluster.http_url(cluster.leader())
            page = await client.pull("bin", 0, offset, 1, url=leader_url)
            m = page["messages"][0]
            assert m["body"] is None and base64.b64decode(m["body_base64"]) == raw

    asyncio.run(go())
