"""The public consumers (``chronomq.Consumer`` and ``chronomq.aio.Consumer``) across a log that
lost its newest entries on every node at once (a power cut under ``flush = async``): the
offsets the lost messages held are written again, and a consumer that had read past them must
read the new ones instead of skipping them.

Three real node processes; the loss is made by hand on the stopped nodes
(tests/integration/rewind.py). Every wait is a condition with a deadline.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import chronomq
import chronomq.aio
from chronomq.aio import Client
from chronomq.cluster.process.launcher import LocalCluster
from chronomq.ops.drill.history import History
from chronomq.ops.drill.workload import TOPIC as DRILL_TOPIC
from chronomq.ops.drill.workload import Workload
from tests.client.test_client_cluster import committed, consume
from tests.integration.rewind import SETTINGS, last_index, rewind_every_node
from tests.integration.test_restart_all import kill_all_at_once

pytestmark = pytest.mark.integration

TOPIC = DRILL_TOPIC  # the drill's consumer reads its own topic
CONSUMER = {"fetch_wait_ms": 1000, "auto_commit_interval_ms": 200, "deadline_s": 60.0}


def produce(urls: list[str], tag: str, n: int) -> list[str]:
    with chronomq.Producer(urls) as producer:
        futures = [producer.send_async(TOPIC, f"{tag}-{k}") for k in range(n)]
        return [f.result(30).msg_id for f in futures]


def pull_waiters(url: str) -> int:
    """Long-polls waiting on the node now (0 while it does not answer)."""
    from chronomq._api import Req
    from chronomq._http_sync import SyncTransport
    from chronomq._policy import RequestPolicy

    t = SyncTransport(RequestPolicy([url], deadline_s=2))
    try:
        return int(t.call(Req("GET", "/v1/admin/node"))["pull_waiters"])
    except chronomq.ChronomqError:
        return 0
    finally:
        t.close()


def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"{what} not within {timeout_s} s"
        time.sleep(0.05)


class AioReader(threading.Thread):
    """A ``chronomq.aio.Consumer`` on its own event loop, collecting what it is handed."""

    def __init__(self, urls: list[str], group: str) -> None:
        super().__init__(name="aio-reader", daemon=True)
        self.urls = urls
        self.group = group
        self.got: list[str] = []
        self.error: BaseException | None = None
        self.stop = threading.Event()

    def run(self) -> None:
        try:
            asyncio.run(self._read())
        except BaseException as exc:  # reported by the test
            self.error = exc

    async def _read(self) -> None:
        async with chronomq.aio.Consumer(self.urls, self.group, TOPIC, **CONSUMER) as consumer:
            while not self.stop.is_set():
                msg = await consumer.poll(0.2)
                if msg is not None:
                    self.got.append(msg.msg_id)

    def wait_for(self, count: int, timeout_s: float) -> list[str]:
        wait_until(lambda: len(self.got) >= count or self.error is not None, timeout_s, "aio")
        assert self.error is None, self.error
        return list(self.got)


class DrillReader(AioReader):
    """The failover drill's consumer of queue 0 (``Workload._consumer``), collecting what it
    reads, its history (with the rewind it records) in ``history``."""

    def __init__(self, urls: list[str], history: Path) -> None:
        super().__init__(urls, "drill")
        self.history = history

    async def _read(self) -> None:
        stop = asyncio.Event()
        async with Client(self.urls) as client:
            history = History(self.history)
            workload = Workload(client, history, random.Random(0), 0)
            workload.latency_sink = lambda m, _t: self.got.append(m["msg_id"])
            task = asyncio.create_task(workload._consumer(0, stop))
            while not self.stop.is_set():
                await asyncio.sleep(0.05)
            stop.set()
            await asyncio.wait_for(task, 10)
            history.close()

    def rewinds(self) -> list[dict[str, Any]]:
        lines = self.history.read_text().splitlines()
        return [r for r in map(json.loads, lines) if r["op"] == "rewind"]


def test_consumers_read_every_message_written_again_after_a_rewind(
    make_cluster: Any, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    """The client's sync and asyncio consumers and the drill's consumer."""
    caplog.set_level(logging.WARNING, logger="chronomq")
    cluster: LocalCluster = make_cluster(3, default_topic_queues=1, **SETTINGS)
    leader = cluster.wait_leader(60)
    urls = cluster.urls
    kept = produce(urls, "a", 30)  # offsets 0..29
    mark = last_index(cluster, leader)
    lost = produce(urls, "b", 20)  # 30..49: gone with the rewind

    aio = AioReader(urls, "aio")
    aio.start()
    drill = DrillReader(urls, tmp_path / "history.jsonl")
    drill.start()
    consumer = chronomq.Consumer(urls, "sync", TOPIC, **CONSUMER)
    try:
        got = consume(consumer, 50, 60)
        assert [m.msg_id for m in got] == kept + lost
        assert aio.wait_for(50, 60) == kept + lost
        assert drill.wait_for(50, 60) == kept + lost
        consumer.commit()  # the commit is lost with the log too

        kill_all_at_once(cluster)
        assert rewind_every_node(cluster, mark) > 0
        cluster.start()
        cluster.wait_leader(60)
        # Both fetchers are back and waiting: at 30 if a caught-up leader told them of the
        # rewind, or at 50 on a node that cannot tell before offset 49 is written again.
        wait_until(
            lambda: sum(pull_waiters(u) for u in urls) >= 3,
            60,
            "the three consumers long-polling",
        )
        again = produce(urls, "c", 40)  # 30..69

        got = consume(consumer, 40, 60)
        assert [m.msg_id for m in got] == again, "a message written again was skipped"
        assert aio.wait_for(90, 60)[50:] == again
        assert drill.wait_for(90, 60)[50:] == again
        assert consumer.poll(0.3) is None
    finally:
        aio.stop.set()
        drill.stop.set()
        consumer.close()
        aio.join(30)
        drill.join(30)
    assert aio.error is None, aio.error
    assert drill.error is None, drill.error
    assert [(r["offset"], r["resume"]) for r in drill.rewinds()] == [(50, 30)]
    assert committed(urls, "sync", TOPIC) == {0: 70}
    assert committed(urls, "aio", TOPIC) == {0: 70}
    warnings = [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and "written again" in r.getMessage()
    ]
    assert len(warnings) == 2, warnings  # one per consumer
    assert all(
        w.startswith(f"{TOPIC}/0: ") and "from offset 30 instead of 50" in w for w in warnings
    )
