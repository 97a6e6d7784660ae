"""``chronomq bench grpc``: send and receive+ack rates of the official RocketMQ 5 Python client.

Starts its own cluster of real node processes on loopback and drives their gRPC endpoints with
``rocketmq-python-client`` unchanged, in this process. Phases, one after another, on one topic:

(a) **sync sends**: ``--threads`` threads share one ``Producer`` and call ``send`` in a loop
    until ``--messages`` are sent; each send's latency is timed.
(b) **async sends**: one thread keeps ``--inflight`` ``send_async`` calls outstanding until
    ``--messages`` more are sent; latency is submit to receipt.
(c) **receive+ack**: ``--consumers`` ``SimpleConsumer`` of one group, each in its own thread,
    ``receive(--batch, --invisible-s)`` and ack every message, until every message sent above
    is acked (a new group starts at the topic's first offset). Each consumer runs up to
    ``--ack-inflight`` ``ack`` calls at a time on a pool of threads (the client's
    ``ack_async`` gives no way to learn the outcome).
    ``received`` counts distinct messages, ``redelivered`` copies handed out again, and
    ``left_after`` what one more receive finds once all are acked (each must be what it says).
(d) **HTTP** (``--http-messages`` > 0, for comparison): the same single-message sends over the
    HTTP API with ``chronomq.aio.Client``, ``--threads`` requests in flight.

Every phase records the CPU it cost: this process (the client), each node process (the leader
marked), and the whole machine, as percent of one core over the phase's wall time. A client
near 100 % of a core (the client's gRPC calls all run on one asyncio thread under the GIL)
with a leader well below it is a client-limited figure; the reverse is the node's limit; and a
machine near ``cores × 100 %`` is the machine's.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from chronomq.cluster.process.launcher import LocalCluster, parse_sets
from chronomq.ops.benchdir import add_data_dir_argument, bench_dir
from chronomq.ops.benchutil import (
    cluster_command,
    cpu_figures,
    cpu_sample,
    figure_rows,
    non_negative,
    port_base,
    positive,
    print_figures,
    progress,
)
from chronomq.ops.stats import percentile

TOPIC = "bench_grpc"
GROUP = "bench_grpc_group"
REQUEST_TIMEOUT_S = 10
#: How long the receive+ack phase may take, at most, before it gives up counting.
DRAIN_DEADLINE_S = 600.0


def _latency_figures(prefix: str, lat_ms: list[float]) -> dict[str, float | None]:
    xs = sorted(lat_ms)
    if not xs:
        return {f"{prefix}_ms_p50": None, f"{prefix}_ms_p99": None}
    return {
        f"{prefix}_ms_p50": round(percentile(xs, 0.5), 2),
        f"{prefix}_ms_p99": round(percentile(xs, 0.99), 2),
    }


def _message(body: bytes) -> Any:
    from rocketmq import Message

    m = Message()
    m.topic = TOPIC
    m.body = body
    return m


def _config(cluster: LocalCluster) -> Any:
    from rocketmq import ClientConfiguration, Credentials

    token = cluster.auth_token
    creds = Credentials("bench", token) if token else Credentials()
    return ClientConfiguration(cluster.grpc_endpoints, creds, request_timeout=REQUEST_TIMEOUT_S)


def sync_sends(producer: Any, total: int, threads: int, body: bytes) -> tuple[float, list[float]]:
    """``total`` sends by ``threads`` threads sharing ``producer``: (seconds, latencies)."""
    lat: list[float] = []
    left = [total]
    lock = threading.Lock()
    errors: list[BaseException] = []

    def worker() -> None:
        mine: list[float] = []
        try:
            while True:
                with lock:
                    if left[0] <= 0:
                        break
                    left[0] -= 1
                t0 = time.perf_counter()
                producer.send(_message(body))
                mine.append((time.perf_counter() - t0) * 1000)
        except BaseException as exc:  # reported after the join
            errors.append(exc)
        finally:
            with lock:
                lat.extend(mine)

    workers = [threading.Thread(target=worker, daemon=True) for _ in range(threads)]
    t0 = time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    elapsed = time.perf_counter() - t0
    if errors:
        raise RuntimeError(f"{len(errors)} sync sends failed, first: {errors[0]!r}")
    return elapsed, lat


def async_sends(producer: Any, total: int, inflight: int, body: bytes) -> tuple[float, list[float]]:
    """``total`` ``send_async`` calls, ``inflight`` outstanding at a time."""
    lat: list[float] = []
    slots = threading.Semaphore(inflight)
    errors: list[BaseException] = []

    def done(t0: float, fut: Future[Any]) -> None:
        exc = fut.exception()
        if exc is not None:
            errors.append(exc)
        else:
            lat.append((time.perf_counter() - t0) * 1000)
        slots.release()

    t0 = time.perf_counter()
    for _ in range(total):
        slots.acquire()
        if errors:
            break
        start = time.perf_counter()
        fut = producer.send_async(_message(body))
        fut.add_done_callback(lambda f, s=start: done(s, f))
    for _ in range(inflight):  # every outstanding send has settled
        slots.acquire()
    elapsed = time.perf_counter() - t0
    if errors:
        raise RuntimeError(f"{len(errors)} async sends failed, first: {errors[0]!r}")
    return elapsed, lat


class Drain:
    """What the consumers of the receive+ack phase saw, shared between their threads."""

    def __init__(self, expected: int) -> None:
        self.expected = expected
        self.lock = threading.Lock()
        self.copies: Counter[str] = Counter()
        self.acked: set[str] = set()
        self.ack_failed = 0
        self.ack_lat_ms: list[float] = []
        self.receive_lat_ms: list[float] = []
        self.receives = 0
        self.empty_receives = 0
        self.all_acked = threading.Event()
        self.errors: list[BaseException] = []

    def on_ack(self, msg_id: str, t0: float, fut: Future[Any]) -> None:
        with self.lock:
            if fut.exception() is not None:
                self.ack_failed += 1
            else:
                self.ack_lat_ms.append((time.perf_counter() - t0) * 1000)
                self.acked.add(msg_id)
                if len(self.acked) >= self.expected:
                    self.all_acked.set()


def consume(consumer: Any, drain: Drain, batch: int, invisible_s: int, ack_inflight: int) -> None:
    """Receive and ack until every expected message is acked (or the phase gives up)."""
    slots = threading.Semaphore(ack_inflight)
    # The client's ack_async drops its future (and completes it on an asyncio loop that only
    # runs in the main thread), so acks run as blocking ``ack`` calls on a pool of threads.
    acks = ThreadPoolExecutor(max_workers=ack_inflight, thread_name_prefix="ack")
    try:
        while not drain.all_acked.is_set():
            t0 = time.perf_counter()
            messages = consumer.receive(batch, invisible_s)
            with drain.lock:
                drain.receives += 1
                drain.receive_lat_ms.append((time.perf_counter() - t0) * 1000)
                if not messages:
                    drain.empty_receives += 1
                for m in messages:
                    drain.copies[m.message_id] += 1
            for m in messages:
                slots.acquire()
                start = time.perf_counter()
                fut = acks.submit(consumer.ack, m)
                fut.add_done_callback(functools.partial(drain.on_ack, str(m.message_id), start))
                fut.add_done_callback(lambda _f: slots.release())
    except BaseException as exc:
        drain.errors.append(exc)
        drain.all_acked.set()  # stop the others: the phase failed
    finally:
        acks.shutdown(wait=True)


def receive_and_ack(
    config: Any, expected: int, consumers: int, batch: int, invisible_s: int, ack_inflight: int,
    await_s: int,
) -> tuple[float, Drain, int]:  # fmt: skip
    """The consumers drain the topic: (seconds, what they saw, messages left after)."""
    from rocketmq import FilterExpression, SimpleConsumer

    drain = Drain(expected)
    clients = []
    try:
        for _ in range(consumers):
            c = SimpleConsumer(config, GROUP, {TOPIC: FilterExpression()}, await_duration=await_s)
            c.startup()
            clients.append(c)
        threads = [
            threading.Thread(
                target=consume, args=(c, drain, batch, invisible_s, ack_inflight), daemon=True
            )
            for c in clients
        ]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        reporter = threading.Thread(target=_report_drain, args=(drain, t0), daemon=True)
        reporter.start()
        drain.all_acked.wait(DRAIN_DEADLINE_S)
        elapsed = time.perf_counter() - t0
        drain.all_acked.set()
        for t in threads:
            t.join(await_s + REQUEST_TIMEOUT_S + 5)
        # Once every message is acked, one more receive must find nothing (after its long poll).
        left_after = len(clients[0].receive(batch, invisible_s)) if not drain.errors else -1
    finally:
        for c in clients:
            c.shutdown()
    if drain.errors:
        raise RuntimeError(f"a consumer failed: {drain.errors[0]!r}")
    return elapsed, drain, left_after


def _report_drain(drain: Drain, t0: float) -> None:
    while not drain.all_acked.wait(5.0):
        with drain.lock:
            acked = len(drain.acked)
        progress(f"receive+ack: {acked}/{drain.expected} acked, {time.perf_counter() - t0:.0f} s")


async def _http_sends(
    cluster: LocalCluster, total: int, concurrency: int, body: str
) -> tuple[float, list[float]]:
    from chronomq.aio import Client

    lat: list[float] = []
    left = total
    async with Client(cluster.urls, token=cluster.auth_token, ca_file=cluster.ca_file) as client:
        await client.produce(f"{TOPIC}_http", [{"body": body}])  # find the leader

        async def producer() -> None:
            nonlocal left
            while left > 0:
                left -= 1
                t0 = time.perf_counter()
                await client.produce(f"{TOPIC}_http", [{"body": body}])
                lat.append((time.perf_counter() - t0) * 1000)

        t0 = time.perf_counter()
        await asyncio.gather(*(producer() for _ in range(concurrency)))
        return time.perf_counter() - t0, lat


def _phase(
    name: str,
    pids: dict[int, int],
    leader: int,
    result: dict[str, Any],
    run_phase: Callable[[], tuple[float, list[float]]],
    count: int,
) -> None:
    before = cpu_sample(pids)
    elapsed, lat = run_phase()
    cpu = cpu_figures(before, cpu_sample(pids), leader)
    result[f"{name}_messages"] = len(lat)
    result[f"{name}_per_s"] = round(count / elapsed) if elapsed > 0 else None
    result.update(_latency_figures(f"{name}_latency", lat))
    result[f"{name}_cpu"] = cpu
    progress(
        f"{name}: {result[f'{name}_per_s']}/s in {elapsed:.1f} s; client {cpu['client_pct']} %, "
        f"leader {cpu['leader_pct']} % of a core"
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    from rocketmq import Producer

    settings = parse_sets(args.set)
    cluster = LocalCluster(
        args.nodes,
        Path(args.data_dir),
        http_port=args.http_port,
        raft_port=args.raft_port,
        grpc_port=args.grpc_port,
        settings=settings,
    )
    body = os.urandom(args.body_bytes // 2 + 1).hex()[: args.body_bytes]
    result: dict[str, Any] = {
        "nodes": args.nodes,
        "messages": args.messages,
        "body_bytes": args.body_bytes,
        "threads": args.threads,
        "inflight": args.inflight,
        "consumers": args.consumers,
        "batch": args.batch,
        "ack_inflight": args.ack_inflight,
        "cores": os.cpu_count(),
        "settings": settings,
    }
    try:
        cluster.start()
        leader = cluster.wait_leader(60)
        cluster.wait_all_know_leader(60)
        pids = {i: p.pid for i, p in cluster.procs.items()}
        result["leader"] = f"node{leader}"
        progress(f"cluster of {args.nodes} up, leader node {leader}; gRPC {cluster.grpc_endpoints}")
        config = _config(cluster)
        producer = Producer(config, (TOPIC,))
        producer.startup()
        try:
            producer.send(_message(b"warm-up"))  # creates the topic
            sent = 1
            if args.messages:
                _phase(
                    "sync_sends",
                    pids,
                    leader,
                    result,
                    lambda: sync_sends(producer, args.messages, args.threads, body.encode()),
                    args.messages,
                )
                sent += result["sync_sends_messages"]
                _phase(
                    "async_sends",
                    pids,
                    leader,
                    result,
                    lambda: async_sends(producer, args.messages, args.inflight, body.encode()),
                    args.messages,
                )
                sent += result["async_sends_messages"]
        finally:
            producer.shutdown()
        result["sent"] = sent
        progress(f"receive+ack: {args.consumers} consumers draining {sent} messages")
        before = cpu_sample(pids)
        elapsed, drain, left_after = receive_and_ack(
            config, sent, args.consumers, args.batch, args.invisible_s, args.ack_inflight,
            args.await_s,
        )  # fmt: skip
        cpu = cpu_figures(before, cpu_sample(pids), leader)
        result.update(
            received=len(drain.copies),
            acked=len(drain.acked),
            ack_failed=drain.ack_failed,
            redelivered=sum(n - 1 for n in drain.copies.values()),
            left_after=left_after,
            receive_calls=drain.receives,
            empty_receives=drain.empty_receives,
            receive_ack_per_s=round(len(drain.acked) / elapsed) if elapsed > 0 else None,
            **_latency_figures("receive_latency", drain.receive_lat_ms),
            **_latency_figures("ack_latency", drain.ack_lat_ms),
            receive_ack_cpu=cpu,
        )
        progress(
            f"receive+ack: {result['receive_ack_per_s']}/s in {elapsed:.1f} s; client "
            f"{cpu['client_pct']} %, leader {cpu['leader_pct']} % of a core"
        )
        if args.http_messages:
            _phase(
                "http_sends",
                pids,
                leader,
                result,
                lambda: asyncio.run(_http_sends(cluster, args.http_messages, args.threads, body)),
                args.http_messages,
            )
    finally:
        cluster.stop()
    return result


def _cpu_row(cpu: dict[str, Any]) -> str:
    nodes = ", ".join(f"{k} {v}" for k, v in cpu["nodes_pct"].items())
    return f"client {cpu['client_pct']}; {nodes}; machine {cpu['machine_pct']}"


_ROWS = (
    "nodes",
    "leader",
    "messages",
    "body_bytes",
    "threads",
    "inflight",
    "consumers",
    "batch",
    "sync_sends_per_s",
    "sync_sends_latency_ms_p50",
    "sync_sends_latency_ms_p99",
    "sync_sends_cpu",
    "async_sends_per_s",
    "async_sends_latency_ms_p50",
    "async_sends_latency_ms_p99",
    "async_sends_cpu",
    "sent",
    "received",
    "acked",
    "redelivered",
    "left_after",
    "receive_ack_per_s",
    "receive_latency_ms_p50",
    "receive_latency_ms_p99",
    "ack_latency_ms_p50",
    "ack_latency_ms_p99",
    "receive_ack_cpu",
    "http_sends_per_s",
    "http_sends_latency_ms_p50",
    "http_sends_latency_ms_p99",
    "http_sends_cpu",
)


def main(args: argparse.Namespace) -> int:
    with bench_dir(args, "chronomq-bench-grpc-") as data:
        result = run(args)
        complete = (
            result["received"] == result["acked"] == result["sent"] and result["left_after"] == 0
        )
        if not complete:
            data.keep()
    rows = [
        (k, _cpu_row(v) + " (% of one core)" if k.endswith("_cpu") else v)
        for k, v in figure_rows(result, _ROWS, with_settings=True)
    ]
    print_figures(rows, result, args.out)
    return 0 if complete else 1


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "grpc",
        help="send and receive+ack rates of the official RocketMQ 5 client over gRPC",
        description=__doc__,
        epilog="examples:\n"
        "  chronomq bench grpc --out grpc.json\n"
        "  chronomq bench grpc --messages 20000 --threads 16 --inflight 256 --consumers 8\n"
        "  chronomq bench grpc --messages 300 --http-messages 0  # a quick check",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--nodes", type=int, choices=[1, 3, 5], default=3, help="cluster size (default 3)"
    )
    p.add_argument(
        "--messages",
        type=positive,
        default=3_000,
        help="messages of each send phase (default 3000)",
    )
    p.add_argument("--body-bytes", type=positive, default=256, help="body size (default 256)")
    p.add_argument(
        "--threads",
        type=positive,
        default=8,
        help="threads of sync sends, and HTTP requests in flight",
    )
    p.add_argument(
        "--inflight", type=positive, default=64, help="async sends outstanding (default 64)"
    )
    p.add_argument("--consumers", type=positive, default=4, help="SimpleConsumers (default 4)")
    p.add_argument(
        "--batch", type=positive, default=32, help="max messages per receive (default 32)"
    )
    p.add_argument(
        "--ack-inflight",
        type=positive,
        default=32,
        help="acks outstanding per consumer (default 32)",
    )
    p.add_argument("--invisible-s", type=positive, default=60, help="invisible time of a receive")
    p.add_argument(
        "--await-s", type=non_negative, default=2, help="long poll of an empty receive (default 2)"
    )
    p.add_argument(
        "--http-messages",
        type=non_negative,
        default=2_000,
        help="single-message sends over HTTP for comparison (0: skip; default 2000)",
    )
    p.add_argument(
        "--http-port", type=port_base, default=28280, help="node i serves HTTP on this port + i"
    )
    p.add_argument(
        "--grpc-port", type=port_base, default=None, help="node i serves gRPC on this port + i "
        "(default HTTP port + 100)"
    )  # fmt: skip
    p.add_argument("--raft-port", type=port_base, default=29280, help="node i uses Raft port + i")
    add_data_dir_argument(p)
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="config key for every node")
    p.add_argument("--out", help="write the figures as JSON here")
    p.set_defaults(func=cluster_command("bench grpc", main))
