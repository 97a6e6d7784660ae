"""Pop consumption with the official RocketMQ 5 Python client, unchanged, against 3 real nodes:
a ``SimpleConsumer`` receives and acks normal and timer messages (none early, recalled ones
never), an unacked message comes back after its invisible time with the next delivery attempt;
a ``PushConsumer`` whose listener fails a message sees it again, then finds it in the group's
DLQ after ``max_reconsume_times``; a ``PushConsumer`` whose listener holds a message for
several invisible times has it renewed by the server and gets it once; and the same
consumption goes on across a SIGKILL of the leader with nothing lost and nothing acked handed
out again. Every wait has a deadline."""

from __future__ import annotations

import asyncio
import signal
import threading
import time
import urllib.parse
from collections import Counter, defaultdict
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families
from rocketmq import (
    ClientConfiguration,
    ConsumeResult,
    Credentials,
    FilterExpression,
    Message,
    MessageListener,
    Producer,
    PushConsumer,
    SimpleConsumer,
)

from chronomq.cluster.logs.schema import LatencyRecord, MessageKind, RecordType, Stage, decode
from chronomq.cluster.process.launcher import LocalCluster
from tests.integration.conftest import dump_logs, wait_for

pytestmark = pytest.mark.integration

PRECISION_MS = 100
# Short retry waits: redelivery n waits as long as level 3 + n - 1 (3 s, then 4 s).
SETTINGS: dict[str, Any] = {
    "max_reconsume_times": 2,
    "message_delay_level": "1s 2s 3s 4s 5s",
    "timer_precision_ms": PRECISION_MS,
}


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def config(cluster: LocalCluster) -> ClientConfiguration:
    return ClientConfiguration(cluster.grpc_endpoints, Credentials(), request_timeout=10)


def message(topic: str, body: bytes, tag: str = "", deliver_s: int | None = None) -> Message:
    m = Message()
    m.topic = topic
    m.body = body
    if tag:
        m.tag = tag
    if deliver_s is not None:
        m.delivery_timestamp = deliver_s  # the client takes seconds
    return m


class Received:
    """What a consumer saw: (message id, body, attempt, received ms) in order."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.items: list[tuple[str, bytes, int, int]] = []
        self.acked: Counter[str] = Counter()
        self.acked_ms: dict[str, int] = {}

    def add(self, m: Any) -> None:
        with self.lock:
            self.items.append((m.message_id, bytes(m.body), int(m.delivery_attempt), now_ms()))

    def ids(self) -> Counter[str]:
        with self.lock:
            return Counter(i for i, *_ in self.items)


def receive_until(
    consumer: SimpleConsumer,
    seen: Received,
    done: Any,
    timeout_s: float,
    invisible_s: int,
    ack: Any = lambda m: True,
) -> None:
    """Receive (and ack what ``ack`` accepts) until ``done()`` or the deadline."""
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            raise AssertionError(f"not done in {timeout_s} s; saw {len(seen.items)} deliveries")
        try:
            batch = consumer.receive(32, invisible_s)
        except Exception as exc:  # a node dying under the call: the client tries again
            print("receive failed:", exc)
            time.sleep(0.2)
            continue
        for m in batch:
            seen.add(m)
            if ack(m):
                try:
                    consumer.ack(m)
                except Exception as exc:
                    print("ack failed:", exc)
                    continue
                with seen.lock:
                    seen.acked[m.message_id] += 1
                    seen.acked_ms.setdefault(m.message_id, now_ms())


async def dlq_bodies(cluster: LocalCluster, node: int, group: str) -> list[str]:
    topic = urllib.parse.quote(f"%DLQ%{group}", safe="")
    url = f"{cluster.urls[node]}/v1/topics/{topic}/queues/0/messages"
    async with aiohttp.ClientSession() as s, s.get(url, params={"offset": "0"}) as r:
        if r.status == 404:
            return []
        assert r.status == 200, await r.text()
        page = await r.json()
    return [m["body"] for m in page["messages"]]


async def test_simple_consumer_receives_acks_and_sees_unacked_again(make_cluster: Any) -> None:
    cluster = make_cluster(3, **SETTINGS)
    cluster.wait_all_know_leader(60)
    topic = "orders"
    producer = Producer(config(cluster), (topic,))
    await asyncio.to_thread(producer.startup)
    consumer = SimpleConsumer(
        config(cluster), "default", {topic: FilterExpression()}, await_duration=2
    )
    try:
        plain = {}
        for i in range(20):
            r = await asyncio.to_thread(producer.send, message(topic, f"p{i}".encode(), "A"))
            plain[r.message_id] = f"p{i}"
        due_s = int(time.time()) + 4
        timers: dict[str, tuple[str, int]] = {}
        recalled: set[str] = set()
        for i in range(8):
            body = f"t{i}"
            r = await asyncio.to_thread(producer.send, message(topic, body.encode(), "B", due_s))
            timers[r.message_id] = (body, due_s * 1000)
            if i % 3 == 0:
                await asyncio.to_thread(producer.recall_message, topic, r.recall_handle)
                recalled.add(r.message_id)
        await asyncio.to_thread(consumer.startup)
        expected = (set(plain) | set(timers)) - recalled
        keep = next(iter(plain))  # received, never acked the first time
        seen = Received()

        def done() -> bool:
            ids = seen.ids()
            return expected <= set(ids) and ids[keep] >= 2

        def ack(m: Any) -> bool:
            return not (m.message_id == keep and m.delivery_attempt == 1)

        await asyncio.to_thread(receive_until, consumer, seen, done, 90, 3, ack)
        # Past every timer's due time, one more long poll: the recalled never come.
        await asyncio.to_thread(
            receive_until, consumer, seen, lambda: now_ms() > due_s * 1000 + 2000, 30, 3
        )
        ids = seen.ids()
        assert not recalled & set(ids), "a recalled message was delivered"
        assert set(ids) == expected
        for msg_id, n in ids.items():
            assert n == (2 if msg_id == keep else 1), (msg_id, n)  # acked: never again
        attempts = [(a, ms) for i, _, a, ms in seen.items if i == keep]
        assert [a for a, _ in attempts] == [1, 2]
        assert attempts[1][1] - attempts[0][1] >= 3000 - PRECISION_MS  # its invisible time
        for msg_id, body, _attempt, got_ms in seen.items:
            if msg_id in timers:
                assert body.decode() == timers[msg_id][0]
                assert got_ms >= timers[msg_id][1] - PRECISION_MS, "a timer message came early"
            else:
                assert body.decode() == plain[msg_id]

        # The node that served the receives logged each first delivery as consumed: the
        # Spark report's end-to-end lateness of timer messages consumed over gRPC.
        def consumed() -> list[LatencyRecord]:
            out = []
            for i in range(cluster.n):
                for f in cluster.node_dir(i).rglob("latency-*.jsonl"):
                    for line in f.read_bytes().splitlines():
                        rec = decode(line, RecordType.LATENCY)
                        assert isinstance(rec, LatencyRecord)
                        if rec.stage == Stage.CONSUMED and rec.topic == topic:
                            out.append(rec)
            return out

        async def all_consumed() -> bool:
            return len(await asyncio.to_thread(consumed)) >= len(expected)

        await wait_for(all_consumed, 30, "consumed lines for every message", cluster)
        lines = await asyncio.to_thread(consumed)
        timer_lines = [r for r in lines if r.kind == MessageKind.TIMER]
        assert len(timer_lines) == len(set(timers) - recalled)
        assert all(r.due_ms is not None and r.consumed_ms >= r.due_ms for r in timer_lines)
    except BaseException:
        print(dump_logs(cluster))
        raise
    finally:
        await asyncio.to_thread(consumer.shutdown)
        await asyncio.to_thread(producer.shutdown)


class Flaky(MessageListener):
    """Fails every delivery of ``poison``; acks the rest."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.attempts: dict[bytes, list[int]] = defaultdict(list)

    def consume(self, message: Any) -> ConsumeResult:
        with self.lock:
            self.attempts[bytes(message.body)].append(int(message.delivery_attempt))
        return ConsumeResult.FAILURE if message.body == b"poison" else ConsumeResult.SUCCESS


async def test_push_consumer_retries_a_failed_message_then_dead_letters_it(
    make_cluster: Any,
) -> None:
    cluster = make_cluster(3, **SETTINGS)
    cluster.wait_all_know_leader(60)
    topic, group = "payments", "accounts"
    producer = Producer(config(cluster), (topic,))
    await asyncio.to_thread(producer.startup)
    listener = Flaky()
    consumer = PushConsumer(config(cluster), group, listener, {topic: FilterExpression()})
    try:
        for body in (b"ok-1", b"poison", b"ok-2"):
            await asyncio.to_thread(producer.send, message(topic, body))
        await asyncio.to_thread(consumer.startup)
        deadline = time.monotonic() + 90
        while b"poison" not in [b.encode() for b in await dlq_bodies(cluster, 1, group)]:
            assert time.monotonic() < deadline, f"not in the DLQ: {dict(listener.attempts)}"
            await asyncio.sleep(0.2)
        with listener.lock:
            attempts = {k: list(v) for k, v in listener.attempts.items()}
        # max_reconsume_times 2: the first delivery and two more, then the DLQ.
        assert attempts[b"poison"] == [1, 2, 3]
        assert attempts[b"ok-1"] == [1] and attempts[b"ok-2"] == [1]
    except BaseException:
        print(dump_logs(cluster))
        raise
    finally:
        await asyncio.to_thread(consumer.shutdown)
        await asyncio.to_thread(producer.shutdown)


async def test_consumption_goes_on_across_a_leader_kill(make_cluster: Any) -> None:
    cluster = make_cluster(3, **SETTINGS)
    leader = cluster.wait_leader(60)
    cluster.wait_all_know_leader(60)
    topic = "reminders"
    producer = Producer(config(cluster), (topic,))
    await asyncio.to_thread(producer.startup)
    consumer = SimpleConsumer(
        config(cluster), "default", {topic: FilterExpression()}, await_duration=2
    )
    await asyncio.to_thread(consumer.startup)
    sent: dict[str, str] = {}
    recalled: set[str] = set()
    failed_sends = 0
    seen = Received()
    stop = threading.Event()

    def produce() -> None:
        nonlocal failed_sends
        for i in range(160):
            if stop.is_set():
                return
            due = int(time.time()) + 2 if i % 4 == 0 else None
            try:
                r = producer.send(message(topic, f"m{i}".encode(), deliver_s=due))
            except Exception as exc:  # not acknowledged: may or may not be stored
                print("send failed:", exc)
                failed_sends += 1
                continue
            sent[r.message_id] = f"m{i}"
            if due is not None and i % 8 == 0:
                try:
                    producer.recall_message(topic, r.recall_handle)
                    recalled.add(r.message_id)
                except Exception as exc:
                    print("recall failed:", exc)
            time.sleep(0.02)

    try:
        sender = threading.Thread(target=produce, daemon=True)
        sender.start()

        def half_done() -> bool:
            return len(seen.acked) >= 40

        await asyncio.to_thread(receive_until, consumer, seen, half_done, 60, 5)
        cluster.kill(leader, signal.SIGKILL)
        await asyncio.to_thread(sender.join, 120)
        assert not sender.is_alive()

        def all_acked() -> bool:
            with seen.lock:
                return (set(sent) - recalled) <= set(seen.acked)

        await asyncio.to_thread(receive_until, consumer, seen, all_acked, 120, 5)
        ids = seen.ids()
        assert not recalled & set(ids), "a recalled message was delivered"
        # Nothing acked was handed out again: no delivery after a successful ack.
        with seen.lock:
            items = list(seen.items)
            acked_ms = dict(seen.acked_ms)
        again = [(i, a) for i, _b, a, ms in items if i in acked_ms and ms > acked_ms[i]]
        assert not again, f"received again after an ack: {again}"
        unexpected = set(ids) - set(sent)
        # A send that failed at the client may still have been stored: not unexpected.
        assert len(unexpected) <= failed_sends
        print(f"sent {len(sent)}, recalled {len(recalled)}, deliveries {len(items)}")
    except BaseException:
        print(dump_logs(cluster))
        raise
    finally:
        stop.set()
        await asyncio.to_thread(consumer.shutdown)
        await asyncio.to_thread(producer.shutdown)


async def scrape_sum(cluster: LocalCluster, sample: str, **labels: str) -> float:
    """``sample`` (with ``labels``) summed over every node's ``/metrics``."""
    total = 0.0
    async with aiohttp.ClientSession() as s:
        for url in cluster.urls:
            async with s.get(f"{url}/metrics") as r:
                assert r.status == 200, await r.text()
                text = await r.text()
            for family in text_string_to_metric_families(text):
                for smp in family.samples:
                    if smp.name == sample and all(
                        smp.labels.get(k) == v for k, v in labels.items()
                    ):
                        total += smp.value
    return total


class Holding(MessageListener):
    """Holds ``slow`` until ``release`` is set (within a deadline), acks everything."""

    def __init__(
        self,
        name: str,
        seen: list[tuple[str, bytes, int, int]],
        lock: threading.Lock,
        release: threading.Event,
    ) -> None:
        self.name = name
        self.seen = seen
        self.lock = lock
        self.release = release

    def consume(self, message: Any) -> ConsumeResult:
        with self.lock:
            self.seen.append(
                (self.name, bytes(message.body), int(message.delivery_attempt), now_ms())
            )
        if message.body == b"slow" and not self.release.wait(120):
            return ConsumeResult.FAILURE
        return ConsumeResult.SUCCESS


async def test_push_consumer_holding_a_message_past_its_invisible_time_gets_it_once(
    make_cluster: Any,
) -> None:
    """The node that served an auto_renew receive renews the message while the listener
    holds it for several invisible times: no other consumer of the group (nor this one) is
    handed it meanwhile, and the listener's ack with the handle it received acks it."""
    invisible_ms = 3_000
    cluster = make_cluster(3, **SETTINGS, default_invisible_time_ms=invisible_ms)
    cluster.wait_all_know_leader(60)
    topic, group = "slow-jobs", "workers"
    producer = Producer(config(cluster), (topic,))
    await asyncio.to_thread(producer.startup)
    lock = threading.Lock()
    seen: list[tuple[str, bytes, int, int]] = []
    release = threading.Event()
    consumers = [
        PushConsumer(
            config(cluster),
            group,
            Holding(name, seen, lock, release),
            {topic: FilterExpression()},
        )
        for name in ("a", "b")
    ]
    bodies = [b"slow", b"quick-1", b"quick-2", b"quick-3"]

    def deliveries(body: bytes) -> list[int]:
        with lock:
            return [attempt for _n, b, attempt, _ms in seen if b == body]

    try:
        for body in bodies:
            await asyncio.to_thread(producer.send, message(topic, body))
        for c in consumers:
            await asyncio.to_thread(c.startup)

        async def slow_received() -> bool:
            return bool(deliveries(b"slow"))

        await wait_for(slow_received, 60, "the slow message received", cluster)
        with lock:
            got_ms = next(ms for _n, b, _a, ms in seen if b == b"slow")

        # Three renewals: the listener has held it for more than twice its invisible time.
        async def renewed_thrice() -> bool:
            return await scrape_sum(cluster, "chronomq_grpc_auto_renew_renewals_total") >= 3

        await wait_for(renewed_thrice, 60, "three renewals", cluster)
        assert now_ms() - got_ms > 2 * invisible_ms
        assert deliveries(b"slow") == [1], "handed out again while the listener held it"
        release.set()

        async def all_acked() -> bool:
            acked = await scrape_sum(cluster, "chronomq_grpc_messages_acked_total")
            tracked = await scrape_sum(cluster, "chronomq_grpc_auto_renew_tracked")
            inflight = await scrape_sum(cluster, "chronomq_pop_held_messages", state="inflight")
            return acked >= len(bodies) and tracked == 0 and inflight == 0

        await wait_for(all_acked, 60, "every message acked and nothing held", cluster)
        # Acked with the handle the listener received, after renewals changed it: the
        # message is no longer in flight on any replica, so it cannot come back.
        for body in bodies:
            assert deliveries(body) == [1], (body, deliveries(body))
        assert await scrape_sum(cluster, "chronomq_grpc_messages_acked_total") == len(bodies)
        stopped = await scrape_sum(
            cluster, "chronomq_grpc_auto_renew_stopped_total", reason="acked"
        )
        assert stopped == len(bodies)
        assert (
            await scrape_sum(cluster, "chronomq_grpc_auto_renew_failures_total", reason="stale")
            == 0
        )
    except BaseException:
        print(dump_logs(cluster))
        raise
    finally:
        release.set()
        for c in consumers:
            await asyncio.to_thread(c.shutdown)
        await asyncio.to_thread(producer.shutdown)
