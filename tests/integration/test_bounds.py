"""Bounded reads and connections on real nodes: pulls capped in bytes, long-polls that end with
their clients, a connection cap and header deadline that slow clients cannot exhaust."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import aiohttp
import orjson
import pytest

from chronomq.cluster.process.launcher import LocalCluster
from tests.integration.conftest import wait_for

pytestmark = pytest.mark.integration

MAX_PULL_BYTES = 1024 * 1024


async def node_status(s: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with s.get(f"{url}/v1/admin/node") as r:
        data: dict[str, Any] = await r.json()
        return data


async def metric(s: aiohttp.ClientSession, url: str, name: str) -> float:
    async with s.get(f"{url}/metrics") as r:
        text = await r.text()
    m = re.search(rf"^{name} (\S+)$", text, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


def test_pulls_are_bounded_in_bytes_and_read_beside_other_requests(make_cluster: Any) -> None:
    cluster: LocalCluster = make_cluster(1, max_pull_bytes=MAX_PULL_BYTES)
    cluster.wait_leader(60)
    url = cluster.urls[0]

    async def go() -> None:
        async with aiohttp.ClientSession() as s:
            bodies = [{"body": f"{i}" + "x" * 300_000, "queue": 0} for i in range(12)]
            async with s.post(f"{url}/v1/topics/big/messages", json={"messages": bodies}) as r:
                assert r.status == 200, await r.text()
            async with s.post(
                f"{url}/v1/topics/huge/messages", json={"messages": [{"body": "y" * 2_000_000}]}
            ) as r:
                assert r.status == 200, await r.text()
                queue = (await r.json())["results"][0]["queue"]

            async def pull(topic: str, q: int, offset: int) -> tuple[int, dict[str, Any]]:
                async with s.get(
                    f"{url}/v1/topics/{topic}/queues/{q}/messages?offset={offset}&max=1000"
                ) as r:
                    raw = await r.read()
                    assert r.status == 200, raw[:200]
                    return len(raw), orjson.loads(raw)

            # Many large bodies: as many as fit, page after page, every one once.
            offset, seen = 0, []
            while offset < 12:
                size, page = await pull("big", 0, offset)
                assert len(page["messages"]) >= 1 and size <= MAX_PULL_BYTES
                seen += [m["offset"] for m in page["messages"]]
                offset = page["next_offset"]
            assert seen == list(range(12))
            # One body larger than the bound still comes, alone.
            size, page = await pull("huge", queue, 0)
            assert len(page["messages"]) == 1 and size > MAX_PULL_BYTES

            # Big pulls in flight do not keep other requests waiting for them.
            before = await metric(s, url, "chronomq_pull_offloaded_reads_total")
            pulls = [asyncio.create_task(pull("big", 0, i % 10)) for i in range(20)]
            for _ in range(5):
                async with s.get(f"{url}/healthz", timeout=aiohttp.ClientTimeout(total=10)) as r:
                    assert r.status == 200
            for size, page in await asyncio.gather(*pulls):
                assert len(page["messages"]) >= 1 and size <= MAX_PULL_BYTES
            assert await metric(s, url, "chronomq_pull_offloaded_reads_total") >= before + 20

    asyncio.run(go())


def test_abandoned_long_polls_end_at_once(make_cluster: Any) -> None:
    cluster: LocalCluster = make_cluster(1)
    cluster.wait_leader(60)
    url = cluster.urls[0]

    async def go() -> None:
        async with aiohttp.ClientSession() as admin:
            async with admin.put(f"{url}/v1/topics/lp", json={"queues": 4}) as r:
                assert r.status in (200, 201)
            polls = aiohttp.ClientSession()
            tasks = [
                asyncio.create_task(
                    polls.get(f"{url}/v1/topics/lp/queues/{i % 4}/messages?wait_ms=30000")
                )
                for i in range(40)
            ]

            async def waiting(n: int) -> bool:
                return (await node_status(admin, url))["pull_waiters"] == n

            await wait_for(lambda: waiting(40), 20, "40 long-polls waiting")
            st = await node_status(admin, url)
            assert st["pull_waited_queues"] == 4
            # A message wakes the waiters of its queue only.
            async with admin.post(
                f"{url}/v1/topics/lp/messages", json={"messages": [{"body": "m", "queue": 1}]}
            ) as r:
                assert r.status == 200
            await wait_for(lambda: waiting(30), 20, "queue 1's waiters answered")
            # The clients go away: the node stops waiting for them long before wait_ms.
            for t in tasks:
                t.cancel()
            await polls.close()
            await wait_for(lambda: waiting(0), 10, "abandoned long-polls ended")
            assert (await node_status(admin, url))["pull_waited_queues"] == 0

    asyncio.run(go())


def test_slow_header_senders_neither_stall_the_node_nor_outlive_the_deadline(
    make_cluster: Any,
) -> None:
    cluster: LocalCluster = make_cluster(1, max_http_connections=256, http_header_timeout_ms=2000)
    cluster.wait_leader(60)
    url = cluster.urls[0]
    port = cluster.http_port

    async def go() -> None:
        slow: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        for _ in range(2000):
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
            except OSError:
                continue  # the listen backlog is full for a moment: that is the point
            writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: ")
            slow.append((reader, writer))
        assert len(slow) > 1000
        async with aiohttp.ClientSession() as s:
            for _ in range(5):
                async with s.get(f"{url}/healthz", timeout=aiohttp.ClientTimeout(total=10)) as r:
                    assert r.status == 200
            conns = (await node_status(s, url))["http_connections"]
            assert conns["open"] <= 256
            assert conns["displaced"] > 0

            # Every slow sender is disconnected: displaced, or cut at the header deadline.
            async def closed(reader: asyncio.StreamReader) -> bool:
                try:
                    return await asyncio.wait_for(reader.read(), 30) == b""
                except (ConnectionResetError, BrokenPipeError):
                    return True

            results = await asyncio.gather(*(closed(r) for r, _ in slow))
            assert all(results)
            for _, w in slow:
                w.close()
            conns = (await node_status(s, url))["http_connections"]
            assert conns["header_timeouts"] > 0
            assert cluster.alive(0)
            async with s.get(f"{url}/healthz") as r:
                assert r.status == 200

    asyncio.run(go())
