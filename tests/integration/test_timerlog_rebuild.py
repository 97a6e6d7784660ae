"""TimerLogs lost on every node are rebuilt from each node's own CommitLog, on 3 real node
processes: no peer can serve a TimerLog fetch (every one lost its own), yet after a
whole-cluster restart every node becomes ready and every timer is delivered once, never early.

Every wait is a condition with a deadline.
"""

from __future__ import annotations

import asyncio
import random
import shutil
import time
from pathlib import Path
from typing import Any

import pytest

from chronomq.aio import Client
from chronomq.cluster.process.launcher import LocalCluster
from chronomq.errors import ChronomqError
from chronomq.timer.checkpoint import TIMERLOG_DIR
from tests.integration.conftest import wait_for
from tests.integration.test_restart_all import (
    TOPIC,
    Collector,
    Ledger,
    kill_all_at_once,
    node_log,
    quiescent,
    wait_until,
)

pytestmark = pytest.mark.integration


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def timerlog_dir(cluster: LocalCluster, i: int) -> Path:
    return cluster.node_dir(i) / "data" / "timer" / TIMERLOG_DIR


async def produce_timers(client: Client, ledger: Ledger, rng: random.Random, count: int) -> None:
    """Timers in batches of 10: a third due within 2 s, the rest 8-20 s later (still waiting
    in the wheel, some rolled, when the TimerLogs are lost)."""
    for n in range(0, count, 10):
        batch = []
        for k in range(n, n + 10):
            delay = rng.randint(300, 2_000) if k % 3 == 0 else rng.randint(8_000, 20_000)
            batch.append({"body": f"t-{k}", "delay_ms": delay})
        try:
            ledger.record(batch, await client.produce(TOPIC, batch))
        except ChronomqError:
            continue  # not acknowledged: not expected either


def test_timerlogs_lost_on_every_node_are_rebuilt_from_their_own_commitlogs(
    make_cluster: Any,
) -> None:
    cluster: LocalCluster = make_cluster(
        3,
        log_compaction_min_entries=50,
        timer_roll_window_slots=50,  # a 5 s window at 100 ms: the later timers roll
    )
    leader = cluster.wait_leader(60)
    seed = random.randrange(2**32)
    ledger = Ledger()

    async def load() -> None:
        async with Client(cluster.urls, deadline_s=10) as client:
            await produce_timers(client, ledger, random.Random(seed), 600)
            # Plain traffic: enough commands for every node to take a snapshot, so the timer
            # commands that wrote the TimerLog are compacted out of the Raft journals.
            for k in range(120):
                await client.produce("filler", [{"body": f"f-{k}"}])

    asyncio.run(load())
    assert len(ledger.acked) >= 500, f"seed {seed}: only {len(ledger.acked)} acknowledged"
    for i in range(3):
        snapshot = cluster.node_dir(i) / "data" / "raft" / "snapshot"
        wait_until(snapshot.exists, 30, f"a snapshot on node {i}", cluster)

    # A follower first: stopped, its TimerLog gone.
    follower = next(i for i in range(3) if i != leader)
    cluster.kill(follower)
    shutil.rmtree(timerlog_dir(cluster, follower))
    # Then the other two at once, and theirs too: no node can serve a TimerLog fetch.
    kill_all_at_once(cluster)
    killed_ms = now_ms()
    for i in range(3):
        shutil.rmtree(timerlog_dir(cluster, i), ignore_errors=True)
    assert any(d > killed_ms for _, d in ledger.acked.values()), f"seed {seed}: none waiting"

    cluster.start()
    leader = cluster.wait_leader(60)

    async def check() -> dict[str, int]:
        async with Client(cluster.urls, deadline_s=30) as client:
            for i in range(3):

                async def ready(i: int = i) -> bool:
                    try:
                        status = await client.request("GET", "/readyz", url=cluster.urls[i])
                    except ChronomqError:
                        return False
                    return bool(status.get("status") == "ready")

                await wait_for(ready, 60, f"seed {seed}: node {i} ready", cluster)
            collector = Collector(client, cluster.urls[leader])

            async def all_delivered() -> bool:
                return await collector.poll() >= len(ledger.acked)

            await wait_for(all_delivered, 90, f"seed {seed}: every acknowledged timer", cluster)

            async def settled() -> bool:
                return await quiescent(client, cluster, cluster.urls[leader])

            await wait_for(settled, 30, f"seed {seed}: nothing left to deliver", cluster)
            await collector.poll()
            return collector.check(ledger)

    counts = asyncio.run(check())
    assert counts == {"lost": 0, "duplicated": 0, "early": 0, "wrong_body": 0, "unexpected": 0}, (
        f"seed {seed}: {counts}"
    )
    for i in range(3):
        text = node_log(cluster, i)
        assert "TimerLog rebuilt from this node's CommitLog" in text, f"node {i}: {text[-3000:]}"
        assert "fetching TimerLog" not in text, f"node {i} asked a peer"
