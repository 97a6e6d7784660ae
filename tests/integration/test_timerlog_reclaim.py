"""The TimerLog is reclaimed on 3 real nodes: timers through small TimerLog segments, the
segments nothing still reads deleted on every node (shown in ``/v1/admin/node`` and
``/metrics``), and every timer still delivered exactly once, never early, with its cancels
kept, through a restart of a node and a kill of the leader. Ops logs stay within
``ops_log_max_bytes``."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from chronomq.aio import Client
from chronomq.cluster.process.launcher import LocalCluster
from tests.integration.conftest import dump_logs, wait_for
from tests.integration.test_timer import (
    Collector,
    now_ms,
    produce_sentinels,
    produce_timers,
)

pytestmark = pytest.mark.integration

SEGMENT_BYTES = 8_000
"""100 TimerLog records a segment."""
OPS_LOG_MAX_BYTES = 600_000

SETTINGS = {
    "timer_log_segment_bytes": SEGMENT_BYTES,
    # A snapshot (and so a timer checkpoint, where segments are deleted) every second or so.
    "log_compaction_min_entries": 10,
    "log_compaction_min_time_s": 1,
    "ops_log_max_bytes": OPS_LOG_MAX_BYTES,
}


async def timerlog(s: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with s.get(f"{url}/v1/admin/node") as r:
        assert r.status == 200
        found: dict[str, Any] = (await r.json())["disk"]["timerlog"]
        return found


async def metric(s: aiohttp.ClientSession, url: str, name: str) -> float:
    async with s.get(f"{url}/metrics") as r:
        text = await r.text()
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def ops_log_bytes(cluster: LocalCluster, i: int) -> int:
    ops = cluster.node_dir(i) / "data" / "ops"
    return sum(p.stat().st_size for p in Path(ops).rglob("*.jsonl"))


def test_timerlog_segments_are_reclaimed_and_every_timer_still_arrives_once(
    make_cluster: Any,
) -> None:
    cluster: LocalCluster = make_cluster(3, **SETTINGS)
    leader = cluster.wait_leader(60)
    rng = random.Random()
    seed = rng.randrange(2**32)
    rng.seed(seed)

    async def go() -> None:
        async with Client(cluster.urls, deadline_s=60) as client, aiohttp.ClientSession() as s:
            # 3,000 timers due within 10 s: 30 segments; 200 of the latest cancelled.
            start = now_ms()
            due = await produce_timers(
                client, [start + 1_500 + rng.randint(0, 8_000) for _ in range(3_000)]
            )
            late = [k for k, t in due.items() if t >= start + 7_000]
            cancelled = set(rng.sample(late, 200))
            for msg_id in cancelled:
                assert (await client.cancel_timer(msg_id))["status"] == "cancelled"
            collector = Collector(client, cluster.http_url(leader))
            expected = {k: v for k, v in due.items() if k not in cancelled}
            await collector.until(len(expected), timeout_s=90)

            # Every node deletes what nothing reads any more, and says so.
            async def reclaimed() -> bool:
                views = [await timerlog(s, url) for url in cluster.urls]
                return all(v["segments_deleted"] > 0 and v["start_pos"] > 0 for v in views)

            await wait_for(reclaimed, 60, "TimerLog segments deleted on every node", cluster)
            for url in cluster.urls:
                view = await timerlog(s, url)
                assert view["segment_bytes"] == SEGMENT_BYTES
                assert view["start_pos"] <= view["reclaim_pos"] <= view["end_pos"], view
                assert view["segments"] < view["end_pos"] // SEGMENT_BYTES, view
                assert view["bytes"] < view["end_pos"], view
                deleted = await metric(s, url, "chronomq_timerlog_segments_deleted_total")
                assert deleted == view["segments_deleted"]
                assert await metric(s, url, "chronomq_timerlog_segments") == view["segments"]

            # A follower restarts on its reclaimed TimerLog and agrees byte for byte.
            follower = next(i for i in range(3) if i != leader)
            cluster.kill(follower)
            cluster.start(follower)
            cluster.wait_converged(90)

            # More timers, cancels among them, and the leader killed while they fall due.
            start = now_ms()
            more = await produce_timers(
                client, [start + 2_000 + rng.randint(0, 6_000) for _ in range(1_500)]
            )
            late = [k for k, t in more.items() if t >= start + 6_000]
            more_cancelled = set(rng.sample(late, 100))
            for msg_id in more_cancelled:
                assert (await client.cancel_timer(msg_id))["status"] == "cancelled"
            await asyncio.sleep(max(0.0, (start + 4_000 - now_ms()) / 1000))
            survivors = [i for i in range(3) if i != leader]
            collector.url = cluster.http_url(survivors[0])
            cluster.kill(leader)
            cluster.wait_leader(30, among=survivors)
            expected.update({k: v for k, v in more.items() if k not in more_cancelled})
            await collector.until(len(expected), timeout_s=90)
            # A duplicate would come before a timer due after all the others.
            sentinels = await produce_sentinels(client)
            await collector.until_seen(sentinels, timeout_s=60)
            collector.copies = [m for m in collector.copies if m["msg_id"] not in sentinels]
            collector.check(expected, cancelled | more_cancelled)
        cluster.start(leader)
        cluster.wait_converged(90)
        for i in range(3):
            # The files being written (3 types) may pass a twelfth each; rotated ones are pruned.
            assert ops_log_bytes(cluster, i) <= OPS_LOG_MAX_BYTES * 1.25, i

    try:
        asyncio.run(go())
    except BaseException:
        print(f"seed={seed}\n{dump_logs(cluster)}")
        raise


def test_a_cancel_a_waiting_message_needs_outlives_the_reclaim_of_its_read_slot(
    make_cluster: Any,
) -> None:
    """Enqueue stopped: timers wait in the timer topic while their slot is read, their cancels
    sit in that slot's cancel chain. The TimerLog around those cancels is reclaimed, the cancels
    are not: once enqueue resumes, the waiting timers are found due and suppressed.

    The records are laid out so that the cancels fill a segment of their own: 1,000 timers
    (segments 0-9), the 100 cancels (segment 10), then 100 cancels of timers due later
    (segment 11). Were the first cancels not needed, the reclaim position would pass them."""
    cluster: LocalCluster = make_cluster(3, **SETTINGS)
    leader = cluster.wait_leader(60)

    async def go() -> None:
        async with Client(cluster.urls, deadline_s=60) as client:
            start = now_ms()
            delivered = await produce_timers(client, [start + 1_000 + 3 * k for k in range(1_000)])
            collector = Collector(client, cluster.http_url(leader))
            await collector.until(len(delivered), timeout_s=60)
            await client.timer_switches(stop_enqueue=True)
            waiting = await produce_timers(client, [now_ms() + 1_500] * 100)
            later = await produce_timers(client, [now_ms() + 120_000] * 100)
            for msg_id in [*waiting, *later]:
                assert (await client.cancel_timer(msg_id))["status"] == "cancelled"
            due_ms = max(waiting.values())

            # The waiting timers' slot is read, and the cursor moves on by several commands.
            async def read_past() -> bool:
                st = await client.timer_status(cluster.http_url(leader))
                return bool(st["cursor"]) and st["cursor"]["slot_ms"] > due_ms + 4_000

            await wait_for(read_past, 30, "the cursor past the waiting timers' slot", cluster)
            async with aiohttp.ClientSession() as s:
                for url in cluster.urls:
                    view = await timerlog(s, url)
                    assert view["end_pos"] == 12 * SEGMENT_BYTES, view
                    assert view["reclaim_pos"] == 10 * SEGMENT_BYTES, view

                async def reclaimed() -> bool:
                    views = [await timerlog(s, url) for url in cluster.urls]
                    return all(v["start_pos"] == 10 * SEGMENT_BYTES for v in views)

                await wait_for(reclaimed, 60, "segments 0-9 deleted on every node", cluster)
            await client.timer_switches(stop_enqueue=False)
            sentinels = await produce_sentinels(client)
            await collector.until_seen(sentinels, timeout_s=60)
            collector.copies = [m for m in collector.copies if m["msg_id"] not in sentinels]
            collector.check(delivered, set(waiting) | set(later))
        cluster.wait_converged(60)

    try:
        asyncio.run(go())
    except BaseException:
        print(dump_logs(cluster))
        raise
