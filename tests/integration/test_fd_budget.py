"""A node under ``ulimit -n 1024`` with 3,000 active queues and 2,000 idle connections keeps
serving and never exits; its log stays small; topic creation stops at max_topics with 429."""

from __future__ import annotations

import asyncio
import contextlib
import random
import resource
import socket
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from chronomq.aio import Client
from chronomq.cluster.process import fdbudget
from chronomq.cluster.process.launcher import LocalCluster
from tests.integration.conftest import dump_logs, free_port_base

LIMIT = 1024
TOPICS = 750  # x 4 queues = 3,000 active queues, far more than 40 % of 1,024 handles
IDLE_CONNECTIONS = 2_000
LOG_BOUND_BYTES = 8 * 1024 * 1024


@pytest.fixture
def limited_cluster(tmp_path: Path) -> Any:
    http, raft = free_port_base(3, random.Random())
    cluster = LocalCluster(
        3,
        tmp_path / "cluster",
        http_port=http,
        raft_port=raft,
        settings={"max_topics": TOPICS + 5},
        prefix=lambda i: ["prlimit", f"--nofile={LIMIT}:{LIMIT}", "--"],
    )
    cluster.start()
    yield cluster
    cluster.stop()


async def _produce_everywhere(client: Client) -> None:
    gate = asyncio.Semaphore(16)

    async def one(t: int) -> None:
        async with gate:
            # Four messages: one per queue of the auto-created topic.
            await client.produce(f"fd-{t}", [{"body": f"m{t}-{q}"} for q in range(4)])

    await asyncio.gather(*(one(t) for t in range(TOPICS)))


def _idle_connections(url: str, count: int) -> list[socket.socket]:
    host, port = url.removeprefix("http://").split(":")
    socks = []
    for _ in range(count):
        s = socket.socket()
        s.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            s.connect((host, int(port)))
        socks.append(s)
    return socks


def test_a_node_under_1024_files_keeps_serving(limited_cluster: LocalCluster) -> None:
    fdbudget.raise_soft_limit()  # this test opens 2,000 sockets of its own
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < IDLE_CONNECTIONS + 256:
        pytest.skip(f"the test process may open only {soft} files")
    cluster = limited_cluster
    leader = cluster.wait_leader(60)
    try:
        asyncio.run(_scenario(cluster, leader))
    except BaseException:
        print(dump_logs(cluster))
        raise
    for i in range(cluster.n):
        assert cluster.alive(i), f"node {i} exited\n{dump_logs(cluster)}"
        log = cluster.node_dir(i) / "node.log"
        assert log.stat().st_size < LOG_BOUND_BYTES
        text = log.read_text(errors="replace")
        assert "apply failed" not in text
        # An accept() that runs out of descriptors is reported at most once per 10 s.
        assert text.count("accept() failed") <= 10
    first = (cluster.node_dir(0) / "node.log").read_text(errors="replace")
    assert f"open files {LIMIT}: ConsumeQueue cache 409, HTTP connections 409" in first


async def _scenario(cluster: LocalCluster, leader: int) -> None:
    url = cluster.http_url(leader)
    async with Client([url], token=cluster.auth_token, ca_file=cluster.ca_file) as client:
        await _produce_everywhere(client)
        idle = _idle_connections(url, IDLE_CONNECTIONS)
        try:
            async with aiohttp.ClientSession() as s, s.get(url + "/healthz") as r:
                assert r.status == 200
            # Every queue of every topic can be written and read while the idle sockets sit.
            out = await client.produce("fd-0", [{"body": "after"}] * 4)
            for placed in out["results"]:
                got = await client.pull("fd-0", placed["queue"], placed["offset"])
                assert got["messages"][0]["body"] == "after"
            for t in (1, TOPICS // 2, TOPICS - 1):
                for q in range(4):
                    got = await client.pull(f"fd-{t}", q, 0)
                    assert got["messages"], (t, q)
            # Past max_topics: 429 too_many_topics naming the topic, and nothing created.
            for t in range(TOPICS, TOPICS + 5):
                await client.produce(f"fd-{t}", [{"body": "x"}])
            async with aiohttp.ClientSession() as s:
                async with s.post(
                    url + "/v1/topics/one-too-many/messages", json={"messages": [{"body": "x"}]}
                ) as r:
                    assert r.status == 429
                    body = await r.json()
                    assert body["error"] == "too_many_topics"
                    assert body["field"] == "topic"
                async with s.get(url + "/v1/topics?limit=100") as r:
                    page = await r.json()
                    assert len(page["topics"]) == 100 and page["truncated"] is True
        finally:
            for sock in idle:
                sock.close()
