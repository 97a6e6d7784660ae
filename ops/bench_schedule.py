"""``chronomq bench schedule``: delay-level delivery throughput, sync against async.

The seeds' central experiment (seed 000) on our replicated log. On one cluster of real node
processes: pause delivery, pre-load ``--messages-per-level`` messages on each of ``--levels``
levels, wait until every one is due, release, and time the drain until every level's replicated
offset has passed them; once in sync mode, once in async mode. Both phases run on the same Raft
settings, the ones best for sync: entries are sent as soon as they are proposed
(``append_entries_use_batch = false``), so a sync delivery waits one replication round trip and
no batching period.

With ``--rate R --duration S`` a third phase sends a steady R msgs/s spread over the levels, in
async mode, and measures lateness (delivered store time minus due time) from the delivered copies.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from pathlib import Path
from typing import Any

from chronomq.aio import Client
from chronomq.cluster.process.launcher import LocalCluster, parse_sets
from chronomq.ops.benchdir import add_data_dir_argument, bench_dir
from chronomq.ops.benchutil import (
    cluster_command,
    non_negative,
    port_base,
    positive,
    print_figures,
    progress,
)
from chronomq.ops.stats import percentile

TOPIC = "bench-delayed"
QUEUES = 4
LOAD_BATCH = 500
LOAD_PRODUCERS = 4


def level_table(levels: int) -> str:
    """``1s 2s ... Ns``: short delays so a pre-load falls due quickly."""
    return " ".join(f"{i}s" for i in range(1, levels + 1))


async def _preload(
    client: Client, levels: int, per_level: int, body: str, topic: str
) -> dict[str, int]:
    """Produce ``per_level`` messages on each level; msg_id -> deliver_ms."""
    due: dict[str, int] = {}
    work = [
        (level, min(LOAD_BATCH, per_level - start))
        for level in range(1, levels + 1)
        for start in range(0, per_level, LOAD_BATCH)
    ]

    async def producer() -> None:
        while work:
            level, n = work.pop()
            answer = await client.produce(
                topic, [{"body": body, "delay_level": level} for _ in range(n)]
            )
            for r in answer["results"]:
                due[r["msg_id"]] = r["deliver_ms"]

    await asyncio.gather(*(producer() for _ in range(LOAD_PRODUCERS)))
    return due


async def _offsets(client: Client, url: str) -> list[int]:
    view = await client.schedule(url=url)
    return [lv["offset"] for lv in view["levels"]]


async def _drain_phase(
    cluster: LocalCluster, client: Client, mode: str, levels: int, per_level: int, body: str
) -> dict[str, Any]:
    await client.set_schedule(mode=mode, paused=True)
    url = cluster.http_url(await asyncio.to_thread(cluster.wait_leader, 60))
    start = await _offsets(client, url)
    progress(f"{mode}: loading {levels} x {per_level} messages")
    due = await _preload(client, levels, per_level, body, TOPIC)
    wait_s = max(0.0, max(due.values()) / 1000 - time.time()) + 0.05
    await asyncio.sleep(wait_s)  # every message due before the clock starts
    target = [s + per_level for s in start]
    progress(f"{mode}: all due; draining")
    t0 = time.perf_counter()
    await client.set_schedule(paused=False)
    deadline = time.monotonic() + 600
    done = start
    last_report = time.monotonic()
    while time.monotonic() < deadline:
        done = await _offsets(client, url)
        if all(d >= t for d, t in zip(done, target, strict=True)):
            break
        if time.monotonic() - last_report > 5:
            last_report = time.monotonic()
            moved = sum(d - s for d, s in zip(done, start, strict=True))
            progress(f"{mode}: {moved}/{levels * per_level} delivered")
        await asyncio.sleep(0.01)
    elapsed = time.perf_counter() - t0
    delivered = sum(d - s for d, s in zip(done, start, strict=True))
    if delivered < levels * per_level:
        raise RuntimeError(f"{mode}: only {delivered} of {levels * per_level} delivered in 600 s")
    rate = delivered / elapsed
    progress(f"{mode}: {delivered} messages in {elapsed:.2f} s = {rate:,.0f} msgs/s")
    return {"messages": delivered, "seconds": round(elapsed, 3), "messages_per_s": round(rate)}


async def _lateness_phase(
    cluster: LocalCluster, client: Client, levels: int, rate: int, duration: int, body: str
) -> dict[str, Any]:
    topic = "bench-steady"
    await client.set_schedule(mode="async", paused=False)
    due: dict[str, int] = {}
    tick_s = 0.02
    per_tick = max(1, round(rate * tick_s))
    ticks = int(duration / tick_s)
    progress(f"steady: {rate} msgs/s for {duration} s over {levels} levels")
    t0 = time.monotonic()
    sends = []
    for k in range(ticks):
        target = t0 + k * tick_s
        delay = target - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        batch = [{"body": body, "delay_level": 1 + (k + i) % levels} for i in range(per_tick)]
        sends.append(asyncio.create_task(client.produce(topic, batch)))
    for answer in await asyncio.gather(*sends):
        for r in answer["results"]:
            due[r["msg_id"]] = r["deliver_ms"]
    progress(f"steady: {len(due)} sent; collecting deliveries")
    seen: dict[str, list[int]] = {}
    offsets = [0] * QUEUES
    deadline = time.monotonic() + levels + 60
    while len(seen) < len(due) and time.monotonic() < deadline:
        for q in range(QUEUES):
            page = await client.pull(topic, q, offsets[q], 1000)
            for m in page["messages"]:
                seen.setdefault(m["msg_id"], []).append(m["store_ms"])
            offsets[q] = page["next_offset"]
        await asyncio.sleep(0.05)
    late = sorted(copies[0] - due[mid] for mid, copies in seen.items() if mid in due)
    return {
        "rate": rate,
        "duration_s": duration,
        "sent": len(due),
        "delivered": len(seen),
        "lost": sum(1 for mid in due if mid not in seen),
        "duplicated": sum(1 for copies in seen.values() if len(copies) > 1),
        "early": sum(1 for x in late if x < 0),
        "lateness_ms_p50": round(percentile(late, 0.5), 1) if late else None,
        "lateness_ms_p99": round(percentile(late, 0.99), 1) if late else None,
        "lateness_ms_max": late[-1] if late else None,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    settings = {"message_delay_level": level_table(args.levels), **parse_sets(args.set)}
    data_dir = Path(args.data_dir)  # set by bench_dir in main
    body = os.urandom(args.body_bytes // 2 + 1).hex()[: args.body_bytes]
    cluster = LocalCluster(
        args.nodes, data_dir, http_port=args.http_port, raft_port=args.raft_port, settings=settings
    )
    result: dict[str, Any] = {
        "nodes": args.nodes,
        "levels": args.levels,
        "messages_per_level": args.messages_per_level,
        "body_bytes": args.body_bytes,
        "settings": settings,
        "raft": "append_entries_use_batch=false for both modes (no batching delay)",
    }

    async def go() -> None:
        async with Client(
            cluster.urls, token=cluster.auth_token, ca_file=cluster.ca_file, deadline_s=60
        ) as client:
            for mode in ("sync", "async"):
                result[mode] = await _drain_phase(
                    cluster, client, mode, args.levels, args.messages_per_level, body
                )
            result["speedup"] = round(
                result["async"]["messages_per_s"] / max(1, result["sync"]["messages_per_s"]), 2
            )
            if args.rate:
                result.update(
                    await _lateness_phase(
                        cluster, client, args.levels, args.rate, args.duration, body
                    )
                )

    try:
        cluster.start()
        cluster.wait_leader(60)
        progress(f"cluster of {args.nodes} up; levels {settings['message_delay_level']}")
        asyncio.run(go())
    finally:
        cluster.stop()
    return result


def main(args: argparse.Namespace) -> int:
    with bench_dir(args, "chronomq-bench-schedule-"):
        result = run(args)
    rows: list[tuple[str, Any]] = [
        ("nodes", result["nodes"]),
        ("levels", result["levels"]),
        ("messages per level", result["messages_per_level"]),
        ("body bytes", result["body_bytes"]),
        ("sync msgs/s", result["sync"]["messages_per_s"]),
        ("async msgs/s", result["async"]["messages_per_s"]),
        ("speedup (async/sync)", result["speedup"]),
    ]
    if "rate" in result:
        rows += [
            ("steady rate msgs/s", result["rate"]),
            ("lateness p50 ms", result["lateness_ms_p50"]),
            ("lateness p99 ms", result["lateness_ms_p99"]),
            ("lateness max ms", result["lateness_ms_max"]),
            ("early", result["early"]),
            ("lost", result["lost"]),
            ("duplicated", result["duplicated"]),
        ]
    print_figures(rows, result, args.out)
    failed = result.get("lost") or result.get("duplicated") or result.get("early")
    return 1 if failed else 0


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "schedule",
        help="delay-level delivery: sync against async drain rate, and lateness",
        description=__doc__,
        epilog="examples:\n"
        "  chronomq bench schedule --nodes 3 --levels 4 --messages-per-level 20000 "
        "--out schedule.json\n"
        "  chronomq bench schedule --levels 4 --messages-per-level 5000 --rate 2000 "
        "--duration 30",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--nodes", type=int, choices=[1, 3, 5], default=3, help="cluster size (default 3)"
    )
    p.add_argument("--levels", type=positive, default=4, help="levels 1s 2s ... Ns (default 4)")
    p.add_argument(
        "--messages-per-level",
        dest="messages_per_level",
        type=positive,
        default=10_000,
        help="messages pre-loaded on each level for the drain (default 10000)",
    )
    p.add_argument(
        "--body-bytes",
        dest="body_bytes",
        type=positive,
        default=256,
        help="body size (default 256)",
    )
    p.add_argument(
        "--rate", type=non_negative, default=0, help="steady msgs/s for the lateness phase"
    )
    p.add_argument(
        "--duration", type=non_negative, default=30, help="seconds of the lateness phase"
    )
    p.add_argument("--out", help="write the figures as JSON here")
    add_data_dir_argument(p)
    p.add_argument(
        "--http-port",
        dest="http_port",
        type=port_base,
        default=18080,
        help="node i serves HTTP on this port + i",
    )
    p.add_argument(
        "--raft-port",
        dest="raft_port",
        type=port_base,
        default=19080,
        help="node i uses Raft port + i",
    )
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="extra node config")
    p.set_defaults(func=cluster_command("bench schedule", main))
