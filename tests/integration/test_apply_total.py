"""Item 7 of issue 15 on 3 real nodes: a delayed message to a topic that does not exist gets
404 at produce when topics are not created automatically, and a leader that cannot read a due
delayed message (its record corrupted on disk) reads it from a peer instead of skipping it.
After each probe every node is up, ``/v1/admin/cluster`` answers, digests agree, and a produce
and a consume work."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from chronomq.aio import Client
from chronomq.cluster.process.launcher import LocalCluster
from chronomq.errors import ApiError
from tests.integration.conftest import pull_applied, wait_for

pytestmark = pytest.mark.integration

LEVELS = "1s 2s 3s"


async def check_healthy(cluster: LocalCluster, client: Client, topic: str) -> None:
    """Every node up and answering, digests equal, and a produce and a consume work."""
    assert all(cluster.alive(i) for i in range(cluster.n))
    async with aiohttp.ClientSession() as http:
        for i in range(cluster.n):
            async with http.get(f"{cluster.http_url(i)}/v1/admin/cluster") as r:
                assert r.status == 200
    sent = await client.send(topic, "after the probe", queue=0)

    async def readable() -> bool:
        got = await pull_applied(client, topic, 0, sent["offset"], 1)
        return [m["body"] for m in got] == ["after the probe"]

    await wait_for(readable, 30, "a produce and a consume after the probe", cluster)
    await asyncio.to_thread(cluster.wait_converged, 60)


def test_a_delayed_message_to_a_missing_topic_gets_404_without_auto_create(
    make_cluster: Any,
) -> None:
    cluster = make_cluster(3, message_delay_level=LEVELS, auto_create_topic=False)
    cluster.wait_leader(60)

    async def go() -> None:
        async with Client(cluster.urls) as client:
            for fields in ({"delay_level": 1}, {"delay_ms": 500}, {"deliver_at_ms": 1}, {}):
                with pytest.raises(ApiError) as err:
                    await client.send("nosuch", "x", **fields)
                assert err.value.status == 404, fields
                assert err.value.body["field"] == "topic"
            await client.create_topic("real", 2)
            sent = await client.send("real", "late", queue=1, delay_level=1)
            assert sent["delay_level"] == 1

            async def delivered() -> bool:
                got = await pull_applied(client, "real", 1, 0, 10)
                return [m["body"] for m in got] == ["late"]

            await wait_for(delivered, 30, "the delayed message delivered", cluster)
            await check_healthy(cluster, client, "real")

    asyncio.run(go())


def _corrupt_body(data_dir: Path, body: bytes) -> int:
    """Flip one byte of ``body`` in the CommitLog segment that holds it; its offset."""
    for seg in sorted((data_dir / "commitlog").iterdir()):
        data = seg.read_bytes()
        at = data.find(body)
        if at >= 0:
            with open(seg, "r+b") as f:
                f.seek(at)
                f.write(bytes([data[at] ^ 0xFF]))
            return at
    raise AssertionError(f"{body!r} not found under {data_dir}")


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_leader_that_cannot_read_a_due_message_reads_it_from_a_peer(
    make_cluster: Any, mode: str
) -> None:
    cluster = make_cluster(3, message_delay_level=LEVELS)
    leader = cluster.wait_leader(60)
    body = f"read-me-from-a-peer-{mode}"

    async def go() -> None:
        async with Client(cluster.urls) as client:
            await client.set_schedule(mode=mode, paused=True)
            await client.create_topic("orders", 2)
            sent = await client.send("orders", body, queue=0, delay_level=2)
            await asyncio.to_thread(cluster.wait_converged, 60)
            _corrupt_body(cluster.node_dir(leader) / "data", body.encode())
            await client.set_schedule(paused=False)

            async def delivered() -> list[dict[str, Any]]:
                page = await client.pull("orders", 0, 0, 10)
                return list(page["messages"])

            messages = await wait_for(delivered, 60, "the delayed message delivered", cluster)
            assert [m["body"] for m in messages] == [body]
            assert messages[0]["msg_id"] == sent["msg_id"]

            async def drained() -> bool:
                view = await client.schedule(url=cluster.http_url(leader))
                level = view["levels"][1]
                return bool(level["backlog"] == 0 and level["read_error"] is None)

            await wait_for(drained, 30, "level 2 drained without a read error", cluster)
            log = (cluster.node_dir(leader) / "node.log").read_text(errors="replace")
            if cluster.leader() == leader:
                assert "read it from a peer" in log
            page = await client.pull("orders", 0, 0, 10)
            assert [m["body"] for m in page["messages"]] == [body]  # once
            await check_healthy(cluster, client, "orders")

    asyncio.run(go())
