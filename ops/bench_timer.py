"""``chronomq bench timer``: delivery precision and burst drain of arbitrary-time messages.

Starts its own cluster of real node processes on loopback (every node a process; producers
and consumers talk HTTP, as clients would) and runs up to two phases:

(a) **Precision** (``--rate`` > 0): for ``--duration`` seconds, ``--rate`` messages a second,
    each due at a uniformly random time within the next ``--horizon`` seconds (a minute by
    default). Every delivered copy is pulled from a follower. Lateness is the delivered copy's
    store time (stamped by the leader when it wrote the delivery) minus the deliver time;
    ``visible_lateness`` is when the consumer first saw it minus the deliver time. ``early``,
    ``lost`` and ``duplicated`` count broken promises (each must be 0).
(b) **Burst** (``--burst N`` > 0): delivery is paused cluster-wide (the replicated
    ``stop_dequeue`` switch), ``N`` messages due within one second are produced and put into
    the wheel, then delivery resumes after their second has passed: ``drain_messages_per_s``
    is ``N`` over the time from resuming to the last delivery. Pausing separates the drain
    from the production of the burst; once resumed, the wheel holds exactly what it would
    hold had the clock reached that second with ``N`` messages waiting. ``peak_rss_bytes`` is
    the leader process's high-water mark (``VmHWM``) over the run; ``produce_peak_rss_bytes``
    is that mark before delivery resumes and ``drain_peak_rss_bytes`` the mark of the drain
    alone (reset through ``/proc/<pid>/clear_refs``), which separates what the timer holds
    from what producing the burst costs (HTTP batches, the Raft log between compactions). Run
    ``--burst 100000`` and ``--burst 1000000`` to compare.

Prints a table and, with ``--out``, writes the figures as one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import signal
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from chronomq.cluster.process.launcher import LocalCluster, parse_sets
from chronomq.cluster.process.stopping import take_signals
from chronomq.ops.benchdir import add_data_dir_argument, bench_dir
from chronomq.ops.benchutil import (
    cluster_command,
    cpu_sample,
    figure_rows,
    node_cpu_s,
    non_negative,
    port_base,
    positive,
    print_figures,
    progress,
)
from chronomq.ops.stats import percentile

TOPIC = "bench-timer"


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


def _pcts(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p99": None, "max": None}
    xs = sorted(values)
    return {
        "p50": round(percentile(xs, 0.5), 1),
        "p99": round(percentile(xs, 0.99), 1),
        "max": round(xs[-1], 1),
    }


def peak_rss_bytes(pid: int) -> int | None:
    """The high-water mark of a process's resident set (Linux ``VmHWM``)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def reset_peak_rss(pid: int) -> bool:
    """Restart a process's ``VmHWM`` from its current RSS (Linux ``clear_refs`` = 5)."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    except OSError:
        return False
    return True


class Consumer:
    """Long-polls every queue of the bench topic on one node; keeps (copy, seen_ms)."""

    def __init__(self, client: Any, url: str, queues: int) -> None:
        self.client = client
        self.url = url
        self.offsets = [0] * queues
        self.seen: list[tuple[dict[str, Any], int]] = []
        self.stop = asyncio.Event()

    async def run_queue(self, q: int) -> None:
        while not self.stop.is_set():
            try:
                page = await self.client.pull(
                    TOPIC, q, self.offsets[q], 1000, wait_ms=500, url=self.url
                )
            except Exception:
                await asyncio.sleep(0.2)  # topic not created yet, or a node restarting
                continue
            now = _now_ms()
            self.seen.extend((m, now) for m in page["messages"])
            self.offsets[q] = page["next_offset"]

    async def run(self) -> None:
        await asyncio.gather(*(self.run_queue(q) for q in range(len(self.offsets))))


async def _queues(client: Any) -> int:
    for _ in range(100):
        try:
            return len((await client.topic(TOPIC))["queues"])
        except Exception:
            await asyncio.sleep(0.1)
    raise RuntimeError(f"topic {TOPIC} did not appear")


async def _precision(
    cluster: LocalCluster, leader: int, rate: int, duration_s: float, horizon_s: float
) -> dict[str, Any]:
    from chronomq.aio import Client

    rng = random.Random(1)
    follower = next((i for i in range(cluster.n) if i != leader), leader)
    async with Client(
        cluster.urls, token=cluster.auth_token, ca_file=cluster.ca_file, deadline_s=60
    ) as client:
        await client.produce(TOPIC, [{"body": "warm-up"}])  # creates the topic
        queues = await _queues(client)
        consumer = Consumer(client, cluster.http_url(follower), queues)
        consuming = asyncio.create_task(consumer.run())
        due: dict[str, int] = {}
        tick_s = 0.05
        per_tick = max(1, round(rate * tick_s))
        body = "x" * 100
        pending: set[asyncio.Task[Any]] = set()
        failed = 0

        async def send(batch: list[dict[str, Any]]) -> None:
            nonlocal failed
            try:
                result = await client.produce(TOPIC, batch)
            except Exception:
                failed += len(batch)
                return
            for r in result["results"]:
                due[r["msg_id"]] = r["deliver_ms"]

        loop = asyncio.get_running_loop()
        start = loop.time()
        ticks = int(duration_s / tick_s)
        for k in range(ticks):
            delay = start + k * tick_s - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            now = _now_ms()
            batch = [
                {"body": body, "deliver_at_ms": now + rng.randint(0, int(horizon_s * 1000))}
                for _ in range(per_tick)
            ]
            task = asyncio.create_task(send(batch))
            pending.add(task)
            task.add_done_callback(pending.discard)
        if pending:
            await asyncio.gather(*pending)
        last_due = max(due.values(), default=_now_ms())
        progress(
            f"precision: {len(due)} produced; waiting for the last one due at +{(last_due - _now_ms()) / 1000:.0f} s"
        )
        deadline = time.monotonic() + max(0, last_due - _now_ms()) / 1000 + 30
        while time.monotonic() < deadline:
            ids = {m["msg_id"] for m, _ in consumer.seen if m["body"] != "warm-up"}
            if ids >= set(due):
                break
            await asyncio.sleep(0.2)
        await asyncio.sleep(1.0)  # a straggling duplicate would show up now
        consumer.stop.set()
        await consuming
    copies = [(m, seen) for m, seen in consumer.seen if m["msg_id"] in due]
    counts = Counter(m["msg_id"] for m, _ in copies)
    lateness = [float(m["store_ms"] - due[m["msg_id"]]) for m, _ in copies]
    visible = [float(seen - due[m["msg_id"]]) for m, seen in copies]
    late = _pcts(lateness)
    vis = _pcts(visible)
    return {
        "rate": rate,
        "duration_s": duration_s,
        "horizon_s": horizon_s,
        "produced": len(due),
        "produce_failed": failed,
        "delivered": len(counts),
        "lateness_ms_p50": late["p50"],
        "lateness_ms_p99": late["p99"],
        "lateness_ms_max": late["max"],
        "visible_lateness_ms_p50": vis["p50"],
        "visible_lateness_ms_p99": vis["p99"],
        "visible_lateness_ms_max": vis["max"],
        "early": sum(1 for x in lateness if x < 0),
        "lost": len(set(due) - set(counts)),
        "duplicated": sum(n - 1 for n in counts.values() if n > 1),
    }


async def _delivered_count(client: Any, url: str) -> int:
    try:
        topic = await client.request("GET", f"/v1/topics/{TOPIC}", url=url)
    except Exception:
        return 0
    return sum(int(q["max_offset"]) for q in topic["queues"])


async def _burst(cluster: LocalCluster, leader: int, n: int, producers: int) -> dict[str, Any]:
    from chronomq.aio import Client

    url = cluster.http_url(leader)
    async with Client(
        [url], token=cluster.auth_token, ca_file=cluster.ca_file, deadline_s=120
    ) as client:
        before = await _delivered_count(client, url)
        await client.timer_switches(stop_dequeue=True)
        due_ms = _now_ms() + 1_000
        body = "x" * 100
        sent = 0
        t0 = time.monotonic()

        async def producer() -> None:
            nonlocal sent
            rng = random.Random()
            while sent < n:
                k = min(1000, n - sent)
                sent += k
                await client.produce(
                    TOPIC,
                    [
                        {"body": body, "deliver_at_ms": due_ms + rng.randint(0, 999)}
                        for _ in range(k)
                    ],
                )

        async def report() -> None:
            while True:
                await asyncio.sleep(10)
                progress(f"burst: {min(sent, n)}/{n} sent, {time.monotonic() - t0:.0f} s")

        reporter = asyncio.create_task(report())
        try:
            await asyncio.gather(*(producer() for _ in range(producers)))
        finally:
            reporter.cancel()
        produce_s = time.monotonic() - t0
        progress(
            f"burst: {n} produced in {produce_s:.1f} s ({n / produce_s:.0f}/s); waiting for the wheel"
        )
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            st = await client.timer_status(url)
            if st["offset_behind"] == 0 and st["backlog"]["total"] >= n:
                break
            await asyncio.sleep(0.2)
        wait_s = (due_ms + 1_000 - _now_ms()) / 1000
        if wait_s > 0:
            await asyncio.sleep(wait_s)
        pids = {i: p.pid for i, p in cluster.procs.items()}
        cpu_before = cpu_sample(pids)
        produce_peaks = {i: peak_rss_bytes(pid) for i, pid in pids.items()}
        drain_peaks_known = all([reset_peak_rss(pid) for pid in pids.values()])
        term_before = (await client.node(url))["term"]
        resumed = time.monotonic()
        await client.timer_switches(stop_dequeue=False)
        target = before + n
        last = before
        while time.monotonic() < resumed + 1_800:
            last = await _delivered_count(client, url)
            if last >= target:
                break
            await asyncio.sleep(0.05)
        drain_s = time.monotonic() - resumed
        cpu_after = cpu_sample(pids)
        drain_peaks = {
            i: peak_rss_bytes(pid) if drain_peaks_known else None for i, pid in pids.items()
        }
        leader_after = cluster.wait_leader(60)
        term_after = (await client.node(cluster.http_url(leader_after)))["term"]

        def name(i: int) -> str:
            roles = [
                r for r, who in (("leader", leader), ("leader after", leader_after)) if who == i
            ]
            return f"node{i}" + (f"({', '.join(roles)})" if roles else "")

        drain_cpu = {
            name(i): round(spent, 2)
            for i, spent in node_cpu_s(cpu_before, cpu_after).items()
            if spent is not None
        }
        peaks = {i: max(produce_peaks[i] or 0, drain_peaks[i] or 0) or None for i in pids}
        return {
            "burst": n,
            "burst_produce_s": round(produce_s, 2),
            "drained": last - before,
            "drain_s": round(drain_s, 2),
            "drain_messages_per_s": round((last - before) / drain_s) if drain_s > 0 else None,
            "peak_rss_bytes": peaks[leader],
            "max_node_peak_rss_bytes": max((v for v in peaks.values() if v), default=None),
            "produce_peak_rss_bytes": produce_peaks[leader],
            "drain_peak_rss_bytes": drain_peaks[leader],
            "peak_rss_bytes_by_node": {name(i): peaks[i] for i in pids},
            "drain_term_changes": term_after - term_before,
            "drain_cpu_s": drain_cpu,
        }


def _check_ports_free(nodes: int, http_port: int, raft_port: int) -> None:
    """Refuse to start when a port is taken: our node would die and the benchmark would
    measure (and write into) whatever cluster answers there."""
    import socket

    ports = [p + i for i in range(nodes) for p in (http_port, raft_port, raft_port + 1000)]
    for port in ports:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                raise RuntimeError(
                    f"port {port} is in use: another cluster runs there; pick free ports with "
                    "--http-port/--raft-port"
                ) from None


def _check_ours(cluster: LocalCluster, leader: int, started: float) -> None:
    """The leader that answered must be one of the nodes we just started."""
    dead = [i for i in range(cluster.n) if not cluster.alive(i)]
    status = cluster.node_status(leader) or {}
    if dead or float(status.get("uptime_s", 1e9)) > time.monotonic() - started + 5:
        raise RuntimeError(
            f"the cluster answering on port {cluster.http_port} is not the one just started "
            f"(dead nodes {dead}); see {cluster.node_dir(0) / 'node.log'}"
        )


def _terminate(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds through run()'s finally: the nodes are stopped


def run(args: argparse.Namespace) -> dict[str, Any]:
    settings = parse_sets(args.set)
    data_dir = Path(args.data_dir)  # set by bench_dir in main
    cluster = LocalCluster(
        args.nodes, data_dir, http_port=args.http_port, raft_port=args.raft_port, settings=settings
    )
    result: dict[str, Any] = {"nodes": args.nodes, "settings": settings}
    _check_ports_free(args.nodes, args.http_port, args.raft_port)
    previous = take_signals(_terminate, frozenset({signal.SIGTERM}))
    started = time.monotonic()
    try:
        cluster.start()
        leader = cluster.wait_leader(60)
        _check_ours(cluster, leader, started)
        progress(f"cluster of {args.nodes} up, leader node {leader}")
        if args.rate:
            progress(f"precision: {args.rate}/s for {args.duration} s, due within {args.horizon} s")
            result.update(
                asyncio.run(_precision(cluster, leader, args.rate, args.duration, args.horizon))
            )
        if args.burst:
            leader = cluster.wait_leader(60)
            _check_ours(cluster, leader, started)
            result.update(asyncio.run(_burst(cluster, leader, args.burst, args.producers)))
        result["digest"] = cluster.wait_converged(120)
    finally:
        cluster.stop()
        signal.signal(signal.SIGTERM, previous[signal.SIGTERM])
    return result


_ROWS = (
    "nodes",
    "rate",
    "duration_s",
    "produced",
    "delivered",
    "lateness_ms_p50",
    "lateness_ms_p99",
    "lateness_ms_max",
    "visible_lateness_ms_p99",
    "early",
    "lost",
    "duplicated",
    "burst",
    "burst_produce_s",
    "drain_s",
    "drain_messages_per_s",
    "peak_rss_bytes",
    "produce_peak_rss_bytes",
    "drain_peak_rss_bytes",
    "max_node_peak_rss_bytes",
    "peak_rss_bytes_by_node",
    "drain_term_changes",
    "drain_cpu_s",
)


def main(args: argparse.Namespace) -> int:
    with bench_dir(args, "chronomq-bench-timer-") as data:
        try:
            result = run(args)
        except RuntimeError as exc:
            data.keep()
            print(f"chronomq bench timer: {exc}", file=sys.stderr)
            return 2
        broken = any(result.get(k) for k in ("early", "lost", "duplicated"))
        if broken:
            data.keep()
    print_figures(figure_rows(result, _ROWS, with_settings=True), result, args.out)
    return 1 if broken else 0


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "timer",
        help="timer precision (lateness at a steady rate) and burst drain rate",
        description=__doc__,
        epilog="examples:\n"
        "  chronomq bench timer --nodes 3 --rate 2000 --duration 60 --out timer.json\n"
        "  chronomq bench timer --nodes 3 --rate 2000 --duration 60 --set timer_precision_ms=10\n"
        "  chronomq bench timer --nodes 3 --rate 0 --burst 1000000 --out burst.json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--nodes", type=int, choices=[1, 3, 5], default=3, help="cluster size (default 3)"
    )
    p.add_argument("--rate", type=non_negative, default=2000, help="messages per second (0: skip)")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of producing")
    p.add_argument(
        "--horizon", type=float, default=60.0, help="messages fall due within this many seconds"
    )
    p.add_argument(
        "--burst", type=non_negative, default=0, help="messages due in one second (0: skip)"
    )
    p.add_argument(
        "--producers", type=positive, default=8, help="concurrent producers of the burst"
    )
    p.add_argument(
        "--http-port", type=port_base, default=28180, help="node i serves HTTP on this port + i"
    )
    p.add_argument("--raft-port", type=port_base, default=29180, help="node i uses Raft port + i")
    add_data_dir_argument(p)
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="config key for every node")
    p.add_argument("--out", help="write the figures as JSON here")
    p.set_defaults(func=cluster_command("bench timer", main))
