"""The replicated CommitLog with 3 real node processes: volume, crashes, catch-up, wipe."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import signal
import time
from collections import Counter
from typing import Any

import aiohttp
import pytest

from chronomq.aio import Client
from chronomq.cluster.process.launcher import LocalCluster
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
    key_prefix: str = "b",
) -> None:
    """Produce batches (each with its own idempotency key, reused on retry) until told to stop."""
    counter = seq if seq is not None else [0]
    while not stop.is_set() and (total is None or counter[0] < total):
        start = counter[0]
        counter[0] += batch
        msgs = [{"body": f"m-{start + k}"} for k in range(batch)]
        result = await client.produce(TOPIC, msgs, idempotency_key=f"{key_prefix}-{start}")
        for r in result["results"]:
            acked[r["msg_id"]] = acked.get(r["msg_id"], 0) + 1


async def produce_range(
    cluster: LocalCluster, start: int, n: int, batch: int, key_prefix: str = "b"
) -> dict[str, int]:
    """Produce ``n`` messages with keys from ``start`` through any node; return what was acked."""
    acked: dict[str, int] = {}
    async with Client(cluster.urls, deadline_s=60) as client:
        await client.create_topic(TOPIC, QUEUES)
        await produce_until(
            client,
            acked,
            asyncio.Event(),
            batch=batch,
            total=start + n,
            seq=[start],
            key_prefix=key_prefix,
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
    """Every acknowledged message is readable exactly once on every node in ``nodes``.

    All nodes are read before anything is asserted, so a failure says which nodes lack what
    (one node lacking messages the others have is a different fault from all lacking them).
    """
    faults: dict[int, str] = {}
    for node in nodes:
        ids = await stored_ids(cluster, node)
        missing = [m for m in acked if ids[m] == 0]
        dupes = [m for m, n in ids.items() if n > 1]
        if missing or dupes:
            faults[node] = (
                f"lacks {len(missing)} acknowledged messages (first {missing[:3]}), "
                f"stores {len(dupes)} twice, holds {sum(ids.values())} in all"
            )
    assert not faults, "; ".join(f"node {n} {text}" for n, text in faults.items())


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


async def _propose_uncommittable(cluster: LocalCluster, node: int, n: int) -> bool:
    """Produce to a leader that cannot reach a majority until it holds proposals it cannot
    commit; True once it did.

    The node reports them as in-flight commands until its lease runs out, when it fails
    them (its journal keeps them). Its journal length is no witness: a compaction can
    shorten it at the same moment.
    """
    url = cluster.http_url(node)
    timeout = aiohttp.ClientTimeout(total=1.0)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def one(k: int) -> None:
            body = {"messages": [{"body": f"stale-{k}-{j}"} for j in range(10)]}
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                await session.post(f"{url}/v1/topics/{TOPIC}/messages", json=body)

        async def holds_proposals() -> bool:
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                st = await asyncio.to_thread(cluster.node_status, node)
                if st and st.get("inflight_commands", 0) > 0:
                    return True
                await asyncio.sleep(0.02)
            return False

        posts = asyncio.gather(*(one(k) for k in range(n)))
        seen = await holds_proposals()
        await posts
        return seen


def test_cut_off_leader_never_applies_its_uncommitted_entries(make_cluster: Any) -> None:
    """A leader that appended entries while cut off, then installs a snapshot, stays a replica.

    Its proposals wait in the paused followers' sockets and are usually committed by the new
    leader after all; what matters is that the old leader applies only what the cluster
    committed. It is resumed far behind a new leader that compacted its log: it installs a
    thin snapshot (sometimes several times over, as its answers to the append messages queued
    while it was stopped rewind the new leader's view of it) and applies the entries after
    it in between. Every node must then serve every acknowledged message exactly once, not
    only report the same CommitLog digest.
    """
    # A connection silent for 3 s is dropped: the appends the new leader queues for the paused
    # old one are then lost with it, as when a pause outlasts the default 60 s.
    cluster = make_cluster(
        3, log_compaction_min_entries=100, log_compaction_min_time_s=1, connection_timeout_ms=3000
    )
    cluster.wait_leader(60)
    # Long idempotency keys make the snapshot several transmission chunks.
    acked = asyncio.run(produce_range(cluster, 0, 12_000, 10, "k" * 180))
    cluster.wait_converged(60)
    try:
        # Under load leadership can move between finding the leader and cutting it off:
        # then the node cut off holds no proposal, and the cut is undone and tried again.
        for _attempt in range(3):
            old = cluster.wait_leader(60)
            others = [i for i in range(3) if i != old]
            for i in others:
                cluster.kill(i, signal.SIGSTOP)
            if asyncio.run(_propose_uncommittable(cluster, old, 40)):
                break
            for i in others:
                cluster.kill(i, signal.SIGCONT)
            cluster.wait_converged(60)
        else:
            pytest.fail("no cut-off leader held a proposal in 3 attempts")
        held = (cluster.node_status(old) or {}).get("commit_index", 0)
        cluster.kill(old, signal.SIGSTOP)
        for i in others:
            cluster.kill(i, signal.SIGCONT)
        new = cluster.wait_leader(120, among=others)
        # Enough commands for the new leader to compact its log past the old leader's: its
        # log must start after all the old one holds (what it committed, plus fewer than
        # 200 proposals it could not commit), and its connection to the old one must be gone.
        acked |= asyncio.run(produce_range(cluster, 10**6, 5_000, 10))
        old_raft = f"{cluster.hosts[old]}:{cluster.raft_port + old}"
        deadline = time.monotonic() + 60
        while True:
            st = cluster.node_status(new) or {}
            first = st.get("commit_index", 0) - st.get("log_len", 0)
            if first > held + 200 and not st.get("peers_connected", {}).get(old_raft, True):
                break
            assert time.monotonic() < deadline, f"no compaction past {held + 200}: {st}"
            time.sleep(0.1)
        cluster.kill(old, signal.SIGCONT)
        cluster.wait_converged(120)
        assert cluster.alive(old)
        asyncio.run(check_exactly_once(cluster, acked, [0, 1, 2]))
        log_text = (cluster.node_dir(old) / "node.log").read_text()
        assert "restored snapshot" in log_text, "the old leader was meant to install a snapshot"
        assert "differ from a peer's" not in log_text
    except Exception:
        print(dump_logs(cluster))
        raise
