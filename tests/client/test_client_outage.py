"""A consumer started while no node answers keeps polling (a warning, no exception) and reads
once the cluster is up: a whole-cluster outage longer than the client's deadline does not end
the application's consume loop."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from pathlib import Path

import pytest

import chronomq
import chronomq.aio
from chronomq.cluster.process.launcher import LocalCluster
from tests.client.test_client_cluster import create_topic
from tests.integration.conftest import free_port_base

pytestmark = pytest.mark.integration


def _cluster(tmp_path: Path) -> LocalCluster:
    http, raft = free_port_base(3, random.Random())
    return LocalCluster(3, tmp_path / "c", http_port=http, raft_port=raft)


def test_sync_consumer_outlives_an_outage(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cluster = _cluster(tmp_path)
    caplog.set_level(logging.WARNING, logger="chronomq")
    with chronomq.Consumer(
        cluster.urls, "g", "t", deadline_s=0.3, auto_commit_interval_ms=100
    ) as consumer:
        assert consumer.poll(1.0) is None  # nothing answers: no exception
        assert "looking for queues to read failed" in caplog.text
        cluster.start()
        try:
            cluster.wait_leader(60)
            create_topic(cluster.urls, "t", 1)
            with chronomq.Producer(cluster.urls) as producer:
                sent = producer.send("t", "after the outage")
            deadline = time.monotonic() + 60
            got = None
            while got is None and time.monotonic() < deadline:
                got = consumer.poll(0.5)
            assert got is not None and got.msg_id == sent.msg_id
        finally:
            consumer.close()
            cluster.stop()


async def test_async_consumer_outlives_an_outage(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cluster = _cluster(tmp_path)
    caplog.set_level(logging.WARNING, logger="chronomq")
    async with chronomq.aio.Consumer(
        cluster.urls, "g", "t", deadline_s=0.3, auto_commit_interval_ms=100
    ) as consumer:
        assert await consumer.poll(1.0) is None
        assert "looking for queues to read failed" in caplog.text
        await asyncio.to_thread(cluster.start)
        try:
            await asyncio.to_thread(cluster.wait_leader, 60)
            await asyncio.to_thread(create_topic, cluster.urls, "t", 1)
            async with chronomq.aio.Producer(cluster.urls) as producer:
                sent = await producer.send("t", "after the outage")
            deadline = time.monotonic() + 60
            got = None
            while got is None and time.monotonic() < deadline:
                got = await consumer.poll(0.5)
            assert got is not None and got.msg_id == sent.msg_id
        finally:
            await consumer.close()
            await asyncio.to_thread(cluster.stop)
