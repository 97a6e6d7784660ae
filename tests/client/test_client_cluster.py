"""The public client (``chronomq`` and ``chronomq.aio``) against three real nodes."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

import chronomq
import chronomq.aio
from chronomq.cluster.process.launcher import LocalCluster

pytestmark = pytest.mark.integration

#: Short delay levels: a send-back (level 3 + reconsume_times) comes back within 3 s.
LEVELS = "1s 2s 3s"


def committed(urls: list[str], group: str, topic: str) -> dict[int, int]:
    from chronomq import _api
    from chronomq._http_sync import SyncTransport
    from chronomq._policy import RequestPolicy

    t = SyncTransport(RequestPolicy(urls))
    try:
        answer = t.call(_api.group_offsets(group, topic))
        return {int(o["queue"]): int(o["offset"]) for o in answer["offsets"]}
    finally:
        t.close()


def max_offsets(urls: list[str], topic: str) -> dict[int, int]:
    from chronomq import _api
    from chronomq._http_sync import SyncTransport
    from chronomq._policy import RequestPolicy

    t = SyncTransport(RequestPolicy(urls))
    try:
        answer = t.call(_api.describe_topic(topic))
        return {int(q["queue"]): int(q["max_offset"]) for q in answer["queues"]}
    finally:
        t.close()


def consume(consumer: chronomq.Consumer, count: int, timeout_s: float) -> list[chronomq.Message]:
    got: list[chronomq.Message] = []
    deadline = time.monotonic() + timeout_s
    while len(got) < count and time.monotonic() < deadline:
        msg = consumer.poll(0.5)
        if msg is not None:
            got.append(msg)
    return got


def create_topic(urls: list[str], topic: str, queues: int) -> None:
    from chronomq._api import Req
    from chronomq._http_sync import SyncTransport
    from chronomq._policy import RequestPolicy
    from chronomq._wire import path

    t = SyncTransport(RequestPolicy(urls))
    try:
        t.call(Req("PUT", path("v1", "topics", topic), {"queues": queues}, write=True))
    finally:
        t.close()


def test_sync_producer_and_consumer(make_cluster: Any) -> None:
    """Threads send through one producer (batched); the consumer reads every queue, commits
    on its period and on close; a second consumer of the group finds nothing left."""
    cluster: LocalCluster = make_cluster(3)
    cluster.wait_leader(60)
    urls = cluster.urls
    create_topic(urls, "orders", 4)
    with chronomq.Producer(urls, linger_ms=10) as producer:
        futures = []

        def send(t: int) -> None:
            for i in range(50):
                futures.append(producer.send_async("orders", f"t{t}-{i}", keys=[f"k{i}"]))

        threads = [threading.Thread(target=send, args=(t,)) for t in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        results = [f.result(30) for f in futures]
        assert len({r.msg_id for r in results}) == 200
        assert {r.queue for r in results} == {0, 1, 2, 3}  # spread over every queue
        assert not any(r.duplicate for r in results)
        binary = producer.send("orders", b"\xff\x00raw", tags="bin")
    with chronomq.Consumer(urls, "billing", "orders", auto_commit_interval_ms=200) as consumer:
        got = consume(consumer, 201, 60)
        assert len(got) == 201
        assert "%RETRY%billing" in consumer.topics
    bodies = Counter(m.body for m in got)
    assert max(bodies.values()) == 1
    assert {m.text for m in got if m.msg_id != binary.msg_id} == {
        f"t{t}-{i}" for t in range(4) for i in range(50)
    }
    raw = next(m for m in got if m.msg_id == binary.msg_id)
    assert raw.body == b"\xff\x00raw" and raw.tags == "bin"
    assert committed(urls, "billing", "orders") == max_offsets(urls, "orders")
    with chronomq.Consumer(urls, "billing", ["orders"]) as again:
        assert again.poll(1.5) is None


def test_sync_producer_delays_and_cancel(make_cluster: Any) -> None:
    cluster: LocalCluster = make_cluster(3, message_delay_level=LEVELS)
    cluster.wait_leader(60)
    urls = cluster.urls
    create_topic(urls, "reminders", 1)
    with chronomq.Producer(urls) as producer:
        level = producer.send("reminders", "by level", delay_level=2)
        assert level.topic == "SCHEDULE_TOPIC_XXXX" and level.delay_level == 2
        timer = producer.send("reminders", "by delay", delay_ms=500)
        assert timer.topic == "rmq_sys_wheel_timer" and timer.deliver_ms is not None
        at = producer.send("reminders", "at a time", deliver_at_ms=int(time.time() * 1000) + 800)
        later = producer.send("reminders", "never", delay_ms=600_000)
        assert producer.cancel(later.msg_id).status == "cancelled"
        with pytest.raises(ValueError):
            producer.send("reminders", "x", delay_ms=1, delay_level=1)
        with pytest.raises(chronomq.RequestError) as err:
            producer.send("reminders", "x", delay_level=-3)
        assert err.value.status == 400 and err.value.field is not None
    with chronomq.Consumer(urls, "app", "reminders", auto_commit=False) as consumer:
        got = consume(consumer, 3, 30)
        consumer.commit()
    assert sorted(m.msg_id for m in got) == sorted([level.msg_id, timer.msg_id, at.msg_id])
    assert committed(urls, "app", "reminders") == {0: 3}


def test_retry_path_with_group_default(make_cluster: Any) -> None:
    """``default`` starts with two hex digits: ``%RETRY%default`` must travel encoded, or
    the node reads another topic. The sent-back message returns through the same loop."""
    cluster: LocalCluster = make_cluster(3, message_delay_level=LEVELS)
    cluster.wait_leader(60)
    urls = cluster.urls
    with chronomq.Producer(urls) as producer:
        sent = producer.send("orders", "order 7 timed out")
    outcomes: list[tuple[str, str, int, str]] = []
    with chronomq.Consumer(urls, "default", "orders", auto_commit_interval_ms=200) as consumer:
        deadline = time.monotonic() + 60
        for msg in consumer:
            outcomes.append((msg.topic, msg.origin_topic, msg.reconsume_times, msg.origin_msg_id))
            if msg.reconsume_times < 2:
                assert msg.reconsume_later() == "retry"
            if len(outcomes) == 3 or time.monotonic() > deadline:
                break
    assert outcomes == [
        ("orders", "orders", 0, sent.msg_id),
        ("%RETRY%default", "orders", 1, sent.msg_id),
        ("%RETRY%default", "orders", 2, sent.msg_id),
    ]
    assert committed(urls, "default", "%RETRY%default") == {0: 2}
    assert committed(urls, "default", "orders") == {0: 1}


def test_failover_during_a_consume_loop(make_cluster: Any) -> None:
    """SIGKILL the leader while a producer sends and a consumer reads with auto-commit:
    every stored message is handed out exactly once, and the committed offsets end at the
    queues' ends (a new consumer of the group gets nothing)."""
    cluster: LocalCluster = make_cluster(3)
    leader = cluster.wait_leader(60)
    urls = cluster.urls
    create_topic(urls, "payments", 3)
    total = 600
    sent: list[str] = []
    errors: list[BaseException] = []

    def produce() -> None:
        try:
            with chronomq.Producer(urls, linger_ms=5) as producer:
                for i in range(total):
                    producer.send("payments", f"p{i}")
                    sent.append(f"p{i}")
                    time.sleep(0.004)
        except BaseException as exc:  # reported below
            errors.append(exc)

    producer_thread = threading.Thread(target=produce)
    producer_thread.start()
    delivered: list[chronomq.Message] = []
    killed_at = None
    with chronomq.Consumer(
        urls, "ledger", "payments", auto_commit_interval_ms=100, fetch_wait_ms=1000
    ) as consumer:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is not None:
                delivered.append(msg)
            if killed_at is None and len(delivered) >= 150:
                cluster.kill(leader)
                killed_at = len(delivered)
            if not producer_thread.is_alive() and len(delivered) >= len(sent):
                break
    producer_thread.join(60)
    assert not errors, errors
    assert killed_at is not None
    live = [u for i, u in enumerate(urls) if i != leader]
    stored = max_offsets(live, "payments")
    ids = Counter(m.msg_id for m in delivered)
    assert max(ids.values()) == 1, "a message was handed out twice"
    assert {m.text for m in delivered} == set(sent), "a message was lost"
    assert len(delivered) == sum(stored.values())  # every stored copy once
    assert committed(live, "ledger", "payments") == stored
    with chronomq.Consumer(live, "ledger", "payments") as again:
        assert again.poll(1.5) is None


async def test_async_producer_and_consumer_with_retry(make_cluster: Any) -> None:
    cluster: LocalCluster = make_cluster(3, message_delay_level=LEVELS)
    await asyncio.to_thread(cluster.wait_leader, 60)
    urls = cluster.urls
    async with chronomq.aio.Producer(urls, linger_ms=10) as producer:
        results = await asyncio.gather(*(producer.send("events", f"e{i}") for i in range(120)))
        assert len({r.msg_id for r in results}) == 120
        timer = await producer.send("events", "soon", delay_ms=300)
        far = await producer.send("events", "far", delay_ms=600_000)
        assert (await producer.cancel(far.msg_id)).status == "cancelled"
    seen: list[chronomq.aio.Message] = []
    retried = None
    async with chronomq.aio.Consumer(urls, "default", "events", auto_commit_interval_ms=200) as c:
        async for msg in c:
            seen.append(msg)
            if msg.text == "e7" and not msg.is_retry:
                assert await msg.reconsume_later() == "retry"
            if msg.is_retry:
                retried = msg
            if len(seen) == 122:
                break
    assert retried is not None and retried.text == "e7" and retried.origin_topic == "events"
    assert Counter(m.text for m in seen) == Counter([f"e{i}" for i in range(120)] + ["soon", "e7"])
    assert any(m.msg_id == timer.msg_id for m in seen)
    assert committed(urls, "default", "events") == max_offsets(urls, "events")
    assert committed(urls, "default", "%RETRY%default") == {0: 1}


ROOT = Path(__file__).resolve().parents[2]
# The node URLs as the examples write them; the tests put a real cluster's in their place.
WRITTEN_NODES = '["http://127.0.0.1:8080", "http://127.0.0.1:8081", "http://127.0.0.1:8082"]'


def run_example(page: Path, marker: str, make_cluster: Any) -> tuple[list[str], LocalCluster]:
    """Run the Python block between ``<!-- MARKER:start -->`` and ``<!-- MARKER:end -->`` of
    ``page`` against a real 3-node cluster; the lines it printed, and the cluster."""
    block = re.search(
        rf"<!-- {marker}:start -->\n```python\n(.*?)```\n<!-- {marker}:end -->",
        page.read_text(),
        re.S,
    )
    assert block is not None, f"{page.relative_to(ROOT)} has no {marker} block"
    assert WRITTEN_NODES in block.group(1)
    cluster: LocalCluster = make_cluster(3)
    cluster.wait_leader(60)
    cluster.wait_all_know_leader(30)
    code = block.group(1).replace(WRITTEN_NODES, repr(cluster.urls))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.splitlines(), cluster


def test_readme_example_runs(make_cluster: Any) -> None:
    """The README's short example, as written but for the node URLs: a timer message comes
    back to the consumer, not before it is due."""
    lines, _cluster = run_example(ROOT / "README.md", "readme-example", make_cluster)
    [line] = lines
    found = re.fullmatch(r"call the customer due at (\d+) stored at (\d+)", line)
    assert found is not None, lines
    assert int(found[2]) >= int(found[1])


def test_docs_example_runs(make_cluster: Any) -> None:
    """The docs' "Use the Python client" example, as written but for the node URLs."""
    page = ROOT / "docs" / "howto" / "python-client.md"
    lines, cluster = run_example(page, "python-client-example", make_cluster)
    assert lines[0] == "order 43 timeout: cancelled", lines
    assert sorted(lines[1:]) == [
        "got 'order 42: cancel if unpaid' from checkout reconsume_times 0",
        "got 'order 44: send the invoice' from %RETRY%default reconsume_times 1",
        "got 'order 44: send the invoice' from checkout reconsume_times 0",
    ]
    stored = max_offsets(cluster.urls, "checkout")
    assert committed(cluster.urls, "default", "checkout") == {q: o for q, o in stored.items() if o}
