"""Client Idempotency-Keys against real node processes over HTTP.

A key is bound to its request's fingerprint for ``idempotency_window_s``: the same request
again answers the first placement (``duplicate: true``), another request with the key answers
422 ``idempotency_key_reused`` naming the header, a key older than the window stores anew, and
the keys live in replicated state, so they survive a leader kill, snapshots and a restart.
"""

from __future__ import annotations

import asyncio
import signal
import time
from typing import Any

import aiohttp

from chronomq.aio import Client
from chronomq.cluster.process.launcher import LocalCluster

from .conftest import dump_logs

TOPIC = "orders"


async def _produce(
    s: aiohttp.ClientSession, url: str, key: str, body: str, topic: str = TOPIC
) -> tuple[int, dict[str, Any]]:
    async with s.post(
        f"{url}/v1/topics/{topic}/messages",
        json={"messages": [{"body": body, "queue": 0, "tags": "t"}]},
        headers={"Idempotency-Key": key},
    ) as r:
        answer: dict[str, Any] = await r.json()
        return r.status, answer


async def _bodies(cluster: LocalCluster, node: int, topic: str = TOPIC) -> list[str]:
    async with Client(cluster.urls) as client:
        page = await client.pull(topic, 0, 0, 1000, url=cluster.http_url(node))
        return [m["body"] for m in page["messages"]]


def _node(cluster: LocalCluster, i: int) -> dict[str, Any]:
    st = cluster.node_status(i, timeout_s=5)
    assert st is not None, f"node {i} does not answer"
    return st


def test_replay_reuse_and_failover(make_cluster: Any) -> None:
    cluster = make_cluster(3, log_compaction_min_entries=50, log_compaction_min_time_s=1)
    leader = cluster.wait_leader(60)

    async def before_kill() -> dict[str, Any]:
        async with aiohttp.ClientSession() as s:
            url = cluster.http_url(leader)
            status, first = await _produce(s, url, "k-1", "first")
            assert status == 200 and not first["duplicate"], first
            status, again = await _produce(s, url, "k-1", "first")
            assert status == 200 and again["duplicate"], again
            assert again["results"] == first["results"]
            status, reused = await _produce(s, url, "k-1", "another body")
            assert status == 422, reused
            assert reused["error"] == "idempotency_key_reused"
            assert reused["field"] == "Idempotency-Key"
            # The same key on another topic is another request.
            status, other = await _produce(s, url, "k-1", "another body", topic="elsewhere")
            assert status == 200 and not other["duplicate"], other
            # Enough keyed writes that every node takes a snapshot holding the keys.
            for start in range(0, 120, 20):
                answers = await asyncio.gather(
                    *(_produce(s, url, f"bulk-{i}", f"b{i}") for i in range(start, start + 20))
                )
                assert all(st == 200 for st, _ in answers), answers
            return first

    try:
        first = asyncio.run(before_kill())
        cluster.wait_converged(60)
        counts = {i: _node(cluster, i)["client_idempotency_keys"] for i in range(3)}
        assert len(set(counts.values())) == 1 and counts[0] >= 122, counts

        cluster.kill(leader, signal.SIGKILL)
        others = [i for i in range(3) if i != leader]
        new_leader = cluster.wait_leader(60, among=others)

        async def after_kill() -> None:
            async with aiohttp.ClientSession() as s:
                url = cluster.http_url(new_leader)
                status, again = await _produce(s, url, "k-1", "first")
                assert status == 200 and again["duplicate"], again
                assert again["results"] == first["results"]
                status, reused = await _produce(s, url, "k-1", "changed")
                assert status == 422 and reused["field"] == "Idempotency-Key", reused
                status, bulk = await _produce(s, url, "bulk-7", "b7")
                assert status == 200 and bulk["duplicate"], bulk
            assert (await _bodies(cluster, new_leader)).count("first") == 1

        asyncio.run(after_kill())
        # The killed node comes back from its snapshot and journal with the same keys.
        cluster.restart(leader)
        cluster.wait_converged(60)
        counts = {i: _node(cluster, i)["client_idempotency_keys"] for i in range(3)}
        assert len(set(counts.values())) == 1, counts
        assert asyncio.run(_bodies(cluster, leader)).count("first") == 1
    except Exception:
        print(dump_logs(cluster))
        raise


def test_a_key_older_than_the_window_stores_anew(make_cluster: Any) -> None:
    cluster = make_cluster(3, idempotency_window_s=1)
    leader = cluster.wait_leader(60)

    async def go() -> None:
        async with aiohttp.ClientSession() as s:
            url = cluster.http_url(leader)
            status, first = await _produce(s, url, "k", "old")
            assert status == 200 and not first["duplicate"], first
            # Within the window the key answers the first request (or refuses another one);
            # once the window has passed in propose time, the same key stores the new request.
            deadline = time.monotonic() + 60
            while True:
                status, answer = await _produce(s, url, "k", "new")
                if status == 200:
                    break
                assert status == 422 and answer["error"] == "idempotency_key_reused", answer
                assert time.monotonic() < deadline, "the key never left its window"
                await asyncio.sleep(0.05)
            assert not answer["duplicate"]
            assert answer["results"][0]["offset"] == first["results"][0]["offset"] + 1
        assert await _bodies(cluster, leader) == ["old", "new"]

    try:
        asyncio.run(go())
        cluster.wait_converged(60)
    except Exception:
        print(dump_logs(cluster))
        raise
