"""The Spark report over the logs of a real 3-node run: delayed messages, leader change, consumers.

The nodes write their ops logs into one shared directory (``ops_log_dir``); the consumers'
``consumed`` lines go next to them. The report must find every message stored, delivered (never
early) per delay level and for timers, and consumed; the replication of both leaders; the leader
change and its failover window; and the services' events.
"""

from __future__ import annotations

import asyncio
import csv
import json
import time
from pathlib import Path
from typing import Any

import pytest

import chronomq.aio
from chronomq.aio import Client
from chronomq.cluster.process.launcher import LocalCluster
from tests.integration.conftest import dump_logs
from tests.ops.conftest import cli_report

pytestmark = [pytest.mark.integration, pytest.mark.spark]

TOPIC = "orders"
QUEUES = 2
PER_KIND = 12  # messages per kind (plain, level 1, level 2, timer) and per phase
LEVEL_DELAYS_MS = {1: 1_000, 2: 2_000}
TIMER_DELAY_MS = 1_500
# Timers are part of the run once the timer service is part of the broker.
TIMERS = (Path(__file__).resolve().parents[2] / "timer" / "service.py").exists()
KINDS: tuple[tuple[str, dict[str, int]], ...] = (
    ("plain", {}),
    ("level 1", {"delay_level": 1}),
    ("level 2", {"delay_level": 2}),
    *((("timer", {"delay_ms": TIMER_DELAY_MS}),) if TIMERS else ()),
)


async def produce_phase(client: Client, phase: int) -> dict[str, str]:
    """PER_KIND messages of each of KINDS, in a few requests; msg_id -> kind."""
    kinds: dict[str, str] = {}
    for kind, extra in KINDS:
        for half in range(2):
            batch = [{"body": f"{phase}-{kind}-{half}-{i}", **extra} for i in range(PER_KIND // 2)]
            for r in (await client.produce(TOPIC, batch))["results"]:
                kinds[r["msg_id"]] = kind
    return kinds


async def visible_ids(client: Client) -> set[str]:
    ids: set[str] = set()
    for queue in range(QUEUES):
        offset = 0
        for _ in range(100):  # pages of 256, far more than this test stores
            page = await client.pull(TOPIC, queue, offset, 256)
            ids |= {m["msg_id"] for m in page["messages"]}
            if page["next_offset"] == offset:
                break
            offset = page["next_offset"]
    return ids


async def wait_delivered(client: Client, want: set[str], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    seen: set[str] = set()
    while time.monotonic() < deadline:
        seen = await visible_ids(client)
        if want <= seen:
            return
        await asyncio.sleep(0.1)
    raise TimeoutError(f"{len(want - seen)} of {len(want)} messages not delivered in {timeout_s} s")


async def transfer_leadership(cluster: LocalCluster, client: Client, to: int) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            await client.transfer_leadership(to)
        except Exception:  # 409 while the target catches up: retry
            await asyncio.sleep(0.2)
            continue
        inner = time.monotonic() + 10
        while time.monotonic() < inner:
            if await asyncio.to_thread(cluster.leader) == to:
                return
            await asyncio.sleep(0.05)
    raise TimeoutError(f"leadership did not move to node {to}")


def test_report_over_a_real_three_node_run(make_cluster: Any, tmp_path: Path) -> None:
    pytest.importorskip("pyspark")
    ops_dir = tmp_path / "ops"
    cluster = make_cluster(
        3,
        message_delay_level="1s 2s",
        default_topic_queues=QUEUES,
        ops_log_dir=str(ops_dir),
    )
    first = cluster.wait_leader(60)
    second = (first + 1) % cluster.n
    kinds: dict[str, str] = {}

    async def run() -> None:
        async with Client(cluster.urls) as client:
            await client.create_topic(TOPIC, QUEUES)
            kinds.update(await produce_phase(client, 1))
            await wait_delivered(client, set(kinds), 30)
            await transfer_leadership(cluster, client, second)
            kinds.update(await produce_phase(client, 2))
            await wait_delivered(client, set(kinds), 30)
            await client.patch_config({"ops_log_sample_rate": 1.0})
            async with chronomq.aio.Consumer(
                cluster.urls, "reporters", TOPIC, max_messages=64, latency_log_dir=ops_dir
            ) as consumer:
                handed = 0
                while handed < len(kinds) and await consumer.poll(10) is not None:
                    handed += 1

    try:
        asyncio.run(run())
    except Exception:
        print(dump_logs(cluster))
        raise
    cluster.stop()  # SIGTERM: every node drains its ops logs before exiting

    out = tmp_path / "report"
    process = cli_report(ops_dir, out, "local[2]")
    assert process.returncode == 0, process.stderr
    assert "stages done" in process.stderr  # progress on the terminal
    summary = json.loads((out / "summary.json").read_text())
    assert (out / "report.html").stat().st_size > 0

    assert {t: c["corrupt"] for t, c in summary["inputs"].items()} == {
        "replication": 0,
        "latency": 0,
        "events": 0,
    }
    n_plain = sum(k == "plain" for k in kinds.values())
    n_timer = sum(k == "timer" for k in kinds.values())
    n_level = len(kinds) - n_plain - n_timer
    messages = summary["messages"]
    expected_kinds = {"plain": n_plain, "level": n_level, "timer": n_timer}
    assert {k: v for k, v in messages["by_kind"].items() if v} == {
        k: v for k, v in expected_kinds.items() if v
    }
    assert messages["without_stored_line"] == 0
    assert messages["delivered"] == n_level + n_timer and messages["undelivered"] == 0
    assert messages["duplicate_deliveries"] == 0
    assert messages["consumed"] == len(kinds)

    # Lateness per delay level and for timers, from the services' delivered records.
    lateness = {r["group"]: r for r in summary["lateness_ms"]}
    groups = [(f"level {n}", d) for n, d in LEVEL_DELAYS_MS.items()]
    groups += [("timer", TIMER_DELAY_MS)] if TIMERS else []
    for group, delay_ms in groups:
        row = lateness[group]
        assert row["delay_ms"] == delay_ms, group
        assert row["count"] == row["messages"] == 2 * PER_KIND, group
        assert row["early_count"] == 0 and row["min_ms"] >= 0, group
        assert row["p99_ms"] is not None and row["max_ms"] < 30_000, group
    e2e = {r["group"]: r for r in summary["end_to_end_ms"]}
    assert e2e["all"]["count"] == len(kinds)
    assert e2e["plain"]["count"] == n_plain and e2e["levels (all)"]["count"] == n_level
    if TIMERS:
        assert e2e["timer"]["count"] == n_timer

    # Replication: both leaders' commit latency, every node's apply lag while following.
    names = {f"n{i}" for i in range(cluster.n)}
    repl = summary["replication"]
    assert repl["commands"] > 0
    leaders = {r["leader"] for r in repl["commit_latency_ms"]} - {"all"}
    assert leaders == {f"n{first}", f"n{second}"}
    assert {r["node"] for r in repl["apply_lag_ms"]} == names
    assert all(r["count"] > 0 for r in repl["apply_lag_ms"])

    # The leader change, as the nodes saw it and as the commits show it. The stop may add one
    # more: SIGTERM on the leader hands its leadership to a follower before it exits.
    changes = [(c["leader"], c["term"]) for c in summary["leader_changes"]]
    assert changes[0][0] == f"n{first}"
    moved = [term for leader, term in changes if leader == f"n{second}"]
    assert moved and moved[0] > changes[0][1], changes
    assert len(changes) <= 3, changes
    failover = next(
        f
        for f in summary["failovers"]
        if (f["old_leader"], f["new_leader"]) == (f"n{first}", f"n{second}")
    )
    assert failover["window_ms"] >= 0 and failover["delivery_gap_ms"] is not None

    with (out / "csv" / "events.csv").open() as f:
        events = [(r["node"], r["type"], json.loads(r["detail"])) for r in csv.DictReader(f)]
    for name in names:
        assert (name, "service_start", {"service": "node"}) in events
        assert (name, "service_stop", {"service": "node"}) in events
    schedule = [(node, kind) for node, kind, d in events if d.get("service") == "schedule"]
    assert (f"n{first}", "service_start") in schedule and (
        f"n{second}",
        "service_start",
    ) in schedule
    assert (f"n{first}", "service_stop") in schedule
    assert any(kind == "config_change" for _, kind, _ in events)
    assert summary["writer_dropped_records"] == 0
