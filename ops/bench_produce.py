"""``chronomq bench produce``: committed-message throughput and commit latency.

Starts its own cluster of real processes on loopback. By default the leader runs inside the
benchmark process and producers call its in-process API (``RaftLog.append``), so the figures
measure the replicated log, not HTTP; followers are separate processes. With ``--http`` every
node is a process and producers send batches over HTTP to the leader.

Two phases: as fast as possible (``--messages``), then, with ``--rate``, a steady rate for
``--duration`` seconds whose commit latencies give the percentiles.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import os
import time
from pathlib import Path
from typing import Any

from chronomq.cluster.process import fdbudget
from chronomq.cluster.process.launcher import LocalCluster, parse_sets
from chronomq.ops.benchdir import add_data_dir_argument, bench_dir
from chronomq.ops.benchutil import (
    cluster_command,
    figure_rows,
    non_negative,
    port_base,
    positive,
    print_figures,
    progress,
)
from chronomq.ops.stats import percentile

FOLLOWER_SETTINGS = {"raft_min_timeout_ms": 1500, "raft_max_timeout_ms": 3000}


def topic_names(base: str, count: int) -> list[str]:
    """The topics a run spreads its messages over: ``base`` alone, or ``base-0`` .. ``base-N-1``."""
    return [base] if count <= 1 else [f"{base}-{i}" for i in range(count)]


async def _produce_inprocess(
    rl: Any, total: int, producers: int, batch: int, body: bytes, topics: list[str]
) -> tuple[float, list[float]]:
    from chronomq.raftlog.node import NewMessage

    lat: list[float] = []
    sent = 0
    msgs = {t: [NewMessage(t, body) for _ in range(batch)] for t in topics}
    turn = itertools.cycle(topics)

    async def producer() -> None:
        nonlocal sent
        while sent < total:
            n = min(batch, total - sent)
            sent += n
            t0 = time.perf_counter()
            await asyncio.wrap_future(rl.append(msgs[next(turn)][:n]))
            lat.append((time.perf_counter() - t0) * 1000)

    t0 = time.perf_counter()
    await asyncio.gather(*(producer() for _ in range(producers)))
    return time.perf_counter() - t0, lat


def _latency_recorder(lat: list[float], t0: float) -> Any:
    def record(_fut: Any) -> None:
        lat.append((time.perf_counter() - t0) * 1000)

    return record


async def _steady_inprocess(
    rl: Any, rate: int, duration_s: float, body: bytes, topic: str
) -> tuple[int, list[float]]:
    from chronomq.raftlog.node import NewMessage

    tick_s = 0.005
    per_tick = max(1, round(rate * tick_s))
    lat: list[float] = []
    pending: set[asyncio.Future[Any]] = set()
    count = 0
    loop = asyncio.get_running_loop()
    start = loop.time()
    n_ticks = int(duration_s / tick_s)
    for k in range(n_ticks):
        target = start + k * tick_s
        delay = target - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        t0 = time.perf_counter()
        fut = asyncio.wrap_future(rl.append([NewMessage(topic, body)] * per_tick))
        fut.add_done_callback(_latency_recorder(lat, t0))
        pending.add(fut)
        fut.add_done_callback(pending.discard)
        count += per_tick
    if pending:
        await asyncio.gather(*pending, return_exceptions=True)
    return count, lat


async def _produce_http(
    cluster: LocalCluster, total: int, producers: int, batch: int, body: str, topics: list[str]
) -> tuple[float, list[float]]:
    from chronomq.aio import Client

    lat: list[float] = []
    sent = 0
    turn = itertools.cycle(topics)
    async with Client(cluster.urls, token=cluster.auth_token, ca_file=cluster.ca_file) as client:
        await client.produce(topics[0], [{"body": body}])  # find the leader, create the topic

        async def producer() -> None:
            nonlocal sent
            while sent < total:
                n = min(batch, total - sent)
                sent += n
                t0 = time.perf_counter()
                await client.produce(next(turn), [{"body": body}] * n)
                lat.append((time.perf_counter() - t0) * 1000)

        t0 = time.perf_counter()
        await asyncio.gather(*(producer() for _ in range(producers)))
        return time.perf_counter() - t0, lat


def run(args: argparse.Namespace) -> dict[str, Any]:
    settings = parse_sets(args.set)
    data_dir = Path(args.data_dir)  # set by bench_dir in main
    cluster = LocalCluster(
        args.nodes,
        data_dir,
        http_port=args.http_port,
        raft_port=args.raft_port,
        settings=settings,
        node_settings={i: FOLLOWER_SETTINGS for i in range(1, args.nodes)}
        if not args.http
        else None,
    )
    cluster.write_configs()
    body = os.urandom(args.body_bytes // 2 + 1).hex()[: args.body_bytes]
    result: dict[str, Any] = {
        "nodes": args.nodes,
        "mode": "http" if args.http else "in-process",
        "messages": args.messages,
        "body_bytes": args.body_bytes,
        "producers": args.producers,
        "batch": args.batch,
        "topics": args.topics,
        "settings": settings,
    }
    topics = topic_names("bench", args.topics)
    rl = None
    try:
        if args.http:
            cluster.start()
            cluster.wait_leader(60)
            progress(f"cluster of {args.nodes} up; producing {args.messages} messages over HTTP")
            elapsed, lat = asyncio.run(
                _produce_http(cluster, args.messages, args.producers, args.batch, body, topics)
            )
        else:
            from chronomq.cluster.config.nodeconfig import load
            from chronomq.raftlog.node import RaftLog

            for i in range(1, args.nodes):
                cluster.start(i)
            cfg = load(cluster.node_dir(0) / "node.toml", environ={})
            budget = fdbudget.plan(fdbudget.raise_soft_limit()[0], cfg.max_http_connections)
            rl = RaftLog(
                dataclasses.replace(cfg.raft_config(), max_open_cq_files=budget.cache_files),
            )
            if not rl.wait_leader(60):
                raise RuntimeError("the in-process node did not become leader")
            progress(
                f"cluster of {args.nodes} up (leader in-process); producing {args.messages} messages"
            )
            elapsed, lat = asyncio.run(
                _produce_inprocess(
                    rl, args.messages, args.producers, args.batch, body.encode(), topics
                )
            )
        lat.sort()
        result.update(
            messages_per_s=round(args.messages / elapsed),
            mb_per_s=round(args.messages * args.body_bytes / elapsed / 1e6, 2),
            seconds=round(elapsed, 3),
            throughput_commit_latency_ms_p50=round(percentile(lat, 0.5), 2),
            throughput_commit_latency_ms_p99=round(percentile(lat, 0.99), 2),
        )
        progress(f"throughput phase: {result['messages_per_s']} msgs/s in {elapsed:.1f} s")
        if args.rate and rl is not None:
            progress(f"steady phase: {args.rate} msgs/s for {args.duration} s")
            count, slat = asyncio.run(
                _steady_inprocess(rl, args.rate, args.duration, body.encode(), "bench")
            )
            slat.sort()
            result.update(
                rate=args.rate,
                rate_messages=count,
                commit_latency_ms_p50=round(percentile(slat, 0.5), 2),
                commit_latency_ms_p99=round(percentile(slat, 0.99), 2),
                commit_latency_ms_max=round(slat[-1], 2),
            )
        else:
            result.update(
                commit_latency_ms_p50=result["throughput_commit_latency_ms_p50"],
                commit_latency_ms_p99=result["throughput_commit_latency_ms_p99"],
            )
        if rl is not None:
            result["digest"] = rl.digest()
            # The leader's journal: under flush=async the longest an acknowledged entry was
            # not on disk, the loss bound of a power cut of every node; under sync, the wait
            # for a group commit.
            result.update(rl.machine.durability())
    finally:
        if rl is not None:
            rl.close()
        cluster.stop()
    return result


def main(args: argparse.Namespace) -> int:
    with bench_dir(args, "chronomq-bench-"):
        result = run(args)
    rows = figure_rows(
        result,
        (
            "nodes",
            "mode",
            "messages",
            "body_bytes",
            "topics",
            "messages_per_s",
            "mb_per_s",
            "commit_latency_ms_p50",
            "commit_latency_ms_p99",
            "journal_syncs",
            "journal_unsynced_ms_max",
        ),
    )
    if "rate" in result:
        rows.insert(6, ("steady_rate", result["rate"]))
    print_figures(rows, result, args.out)
    return 0


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "produce",
        help="committed throughput and commit latency of the replicated log",
        description=__doc__,
        epilog="examples:\n  chronomq bench produce --nodes 3 --messages 300000 --rate 10000 --duration 20 --out produce.json\n"
        "  chronomq bench produce --http --nodes 3 --batch 100 --messages 200000\n"
        "  chronomq bench produce --nodes 3 --messages 200000 --topics 2500  # 10,000 queues",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--nodes", type=int, choices=[1, 3, 5], default=3, help="cluster size (default 3)"
    )
    p.add_argument(
        "--messages",
        type=positive,
        default=200_000,
        help="messages of the as-fast-as-possible phase",
    )
    p.add_argument("--body-bytes", type=positive, default=256, help="body size (default 256)")
    p.add_argument(
        "--topics",
        type=positive,
        default=1,
        help="spread the messages over this many topics (bench-0 ..), each of "
        "default_topic_queues queues, one request after another (default 1: topic bench)",
    )
    p.add_argument(
        "--producers", type=positive, default=64, help="concurrent producers (default 64)"
    )
    p.add_argument(
        "--batch",
        type=positive,
        default=16,
        help="messages per append call (per HTTP request with --http)",
    )
    p.add_argument(
        "--rate",
        type=non_negative,
        default=0,
        help="then send a steady rate (msgs/s) to measure commit latency",
    )
    p.add_argument("--duration", type=float, default=10.0, help="seconds of the steady phase")
    p.add_argument(
        "--http", action="store_true", help="produce over HTTP to the leader instead of in-process"
    )
    p.add_argument(
        "--http-port", type=port_base, default=28080, help="node i serves HTTP on this port + i"
    )
    p.add_argument("--raft-port", type=port_base, default=29080, help="node i uses Raft port + i")
    add_data_dir_argument(p)
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="config key for every node")
    p.add_argument("--out", help="write the figures as JSON here")
    p.set_defaults(func=cluster_command("bench produce", main))
