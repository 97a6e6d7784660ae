"""The replicated CommitLog with 3 real node processes: volume, crashes, catch-up, wipe."""

from __future__ import annotations

import asyncio
import shutil
import time
from collections import Counter
from typing import Any

import pytest

from cluster.client import Client
from cluster.launcher import LocalCluster
from tests.integration.conftest import dump_logs

pytestmark = pytest.mark.integration

TOPIC = "orders"
QUEUES = 4


async def produce_until(
    client: Client,
    acked: dict[str, int],
    stop: asyncio.Event,
    *,
    batch: int = 200,
    total: int | None = None,
    seq: list[int] | None = None,
) -> None:
    """Produce batches (each with its own idempotency key, reused on retry) until told to stop."""
    counter = seq if seq is not None else [0]
    while not stop.is_set() and (total is None or counter[0] < total):
        start = counter[0]
        counter[0] += batch
        msgs = [{"body": f"m-{start + k}"} for k in range(batch)]
        result = await client.produce(TOPIC, msgs, idempotency_key=f"b-{start}")
        for r in result["results"]:
            acked[r["msg_id"]] = acked.get(r["msg_id"], 0) + 1


async def produce_range(cluster: LocalCluster, start: int, n: int, batch: int) -> dict[str, int]:
    """Produce ``n`` messages with keys from ``start`` through any node; return what was acked."""
    acked: dict[str, int] = {}
    async with Client(cluster.urls, deadline_s=60) as client:
        await client.create_topic(TOPIC, QUEUES)
        await produce_until(
            client, acked, asyncio.Event(), batch=batch, total=start + n, seq=[start]
        )
    return acked


async def stored_ids(cluster: LocalCluster, node: int) -> Counter[str]:
    ids: Counter[str] = Counter()
    async with Client([cluster.http_url(node)]) as client:
        for q in range(QUEUES):
            offset = 0
            while True:
                page = await client.pull(TOPIC, q, offset, 1000, url=cluster.http_url(node))
                for m in page["messages"]:
                    ids[m["msg_id"]] += 1
                if not page["messages"]:
                    break
                offset = page["next_offset"]
    return ids


async def check_exactly_once(
    cluster: LocalCluster, acked: dict[str, int], nodes: list[int]
) -> None:
    for node in nodes:
        ids = await stored_ids(cluster, node)
        missing = [m for m in acked if ids[m] == 0]
        dupes = [m for m, n in ids.items() if n > 1]
        assert not missing, f"node {node} lacks {len(missing)} acknowledged messages"
        assert not dupes, f"node {node} stores {len(dupes)} messages twice"


def test_100k_messages_identical_on_all_nodes(make_cluster: Any) -> None:
    cluster = make_cluster(3)
    cluster.wait_leader(60)

    async def go() -> dict[str, int]:
        acked: dict[str, int] = {}
        async with Client(cluster.urls) as client:
            await client.create_topic(TOPIC, QUEUES)
            stop = asyncio.Event()
            seq = [0]
            await asyncio.gather(
                *(
                    produce_until(client, acked, stop, batch=500, total=100_000, seq=seq)
                    for _ in range(8)
                )
            )
        return acked

    acked = asyncio.run(go())
    assert len(acked) == 100_000
    digest = cluster.wait_converged(120)
    assert digest["length"] > 100_000 * 100
    asyncio.run(check_exactly_once(cluster, acked, [0, 1, 2]))


def test_sigkill_leader_mid_stream_loses_nothing(make_cluster: Any) -> None:
    cluster = make_cluster(3, log_compaction_min_entries=200)
    leader = cluster.wait_leader(60)

    async def go() -> dict[str, int]:
        acked: dict[str, int] = {}
        async with Client(cluster.urls, deadline_s=60) as client:
            await client.create_topic(TOPIC, QUEUES)
            stop = asyncio.Event()
            tasks = [
                asyncio.create_task(produce_until(client, acked, stop, batch=100, seq=seq))
                for seq in ([0], [10**7], [2 * 10**7], [3 * 10**7])
            ]
            deadline = time.monotonic() + 60
            while len(acked) < 20_000 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            t_kill = time.monotonic()
            await asyncio.to_thread(cluster.kill, leader)
            # Produce keeps going through the survivors.
            before = len(acked)
            while len(acked) < before + 20_000 and time.monotonic() < deadline + 60:
                await asyncio.sleep(0.05)
            recovered_s = time.monotonic() - t_kill
            await asyncio.to_thread(cluster.start, leader)
            while len(acked) < before + 30_000 and time.monotonic() < deadline + 90:
                await asyncio.sleep(0.05)
            stop.set()
            await asyncio.gather(*tasks)
            print(
                f"acked {len(acked)}; 20,000 more acknowledged {recovered_s:.2f} s after the kill"
            )
        return acked

    acked = asyncio.run(go())
    try:
        cluster.wait_converged(120)
        asyncio.run(check_exactly_once(cluster, acked, [0, 1, 2]))
    except Exception:
        print(dump_logs(cluster))
        raise


def test_follower_killed_then_wiped_catches_up(make_cluster: Any) -> None:
    cluster = make_cluster(3, log_compaction_min_entries=100)
    leader = cluster.wait_leader(60)
    follower = next(i for i in range(3) if i != leader)

    acked = asyncio.run(produce_range(cluster, 0, 10_000, 200))
    cluster.kill(follower)
    acked |= asyncio.run(
        produce_range(cluster, 10**6, 30_000, 200)
    )  # enough commands for several snapshots
    cluster.start(follower)
    try:
        cluster.wait_converged(120)
        asyncio.run(check_exactly_once(cluster, acked, [follower]))
        # Wipe the follower: it rejoins empty, installs a thin snapshot, fetches the CommitLog.
        cluster.kill(follower)
        shutil.rmtree(cluster.node_dir(follower) / "data")
        acked |= asyncio.run(produce_range(cluster, 2 * 10**6, 5_000, 200))
        cluster.start(follower)
        cluster.wait_converged(120)
        asyncio.run(check_exactly_once(cluster, acked, [follower]))
    except Exception:
        print(dump_logs(cluster))
        raise


def test_flush_sync_cluster_survives_leader_kill(make_cluster: Any) -> None:
    """flush=sync: journal entries and CommitLog writes are fsynced; behaviour is unchanged."""
    cluster = make_cluster(3, flush="sync", log_compaction_min_entries=50)
    leader = cluster.wait_leader(60)

    acked = asyncio.run(produce_range(cluster, 0, 5_000, 100))
    cluster.kill(leader)
    acked |= asyncio.run(produce_range(cluster, 10**6, 5_000, 100))
    cluster.start(leader)
    try:
        cluster.wait_converged(120)
        asyncio.run(check_exactly_once(cluster, acked, [0, 1, 2]))
    except Exception:
        print(dump_logs(cluster))
        raise
