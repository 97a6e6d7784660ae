"""A release starts on the data directories the release before it left, and loses nothing.

``tests/fixtures/release-data.tar.gz`` holds a stopped 3-node cluster's data as the previous
release wrote it (``tests/fixtures/make_release_data.py``, run from that release's tag at each
release, see ``CONTRIBUTING.md``; its ``manifest.json`` names the version that wrote it). The
current code starts on it, as after a whole-cluster stop and upgrade, and must deliver every
waiting delay-level message and timer once and never early (no cancelled timer), keep the
topics, the committed offsets and the pop group's state (what it acked never comes back, what
it did not ack does), and answer with its own version.
"""

from __future__ import annotations

import asyncio
import json
import socket
import tarfile
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from chronomq.aio import Client
from chronomq.cluster.process.launcher import LocalCluster
from chronomq.version import VERSION
from tests.conftest import register_cluster
from tests.integration.conftest import dump_logs, wait_for

pytestmark = pytest.mark.integration

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "release-data.tar.gz"
DELIVERY_S = 90  # the fixture's waits (40 s at most) may not have passed yet when it is fresh


def _extract(into: Path) -> dict[str, Any]:
    with tarfile.open(FIXTURE) as tar:
        tar.extractall(into, filter="data")  # keeps the TimerWheel sparse
    manifest: dict[str, Any] = json.loads((into / "manifest.json").read_text())
    return manifest


def _ports_free(manifest: dict[str, Any]) -> list[int]:
    """The ports the fixture's cluster ran on (its Raft addresses are in its membership, so it
    must run on them again) that something else holds."""
    n, http, raft = manifest["nodes"], manifest["http_port"], manifest["raft_port"]
    ports = [p + i for p in (http, http + 100, raft, raft + 1000) for i in range(n)]
    taken = []
    for port in ports:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                taken.append(port)
    return taken


@pytest.fixture
def upgraded(tmp_path: Path, request: pytest.FixtureRequest) -> Any:
    root = tmp_path / "cluster"
    manifest = _extract(root)
    taken = _ports_free(manifest)
    assert not taken, f"ports the fixture's cluster needs are taken: {taken}"
    cluster = LocalCluster(
        manifest["nodes"],
        root,
        http_port=manifest["http_port"],
        raft_port=manifest["raft_port"],
        settings=manifest["settings"],
    )
    register_cluster(request.node, cluster)
    try:
        cluster.start()
        yield cluster, manifest
    finally:
        cluster.stop()


def test_this_release_reads_the_previous_release_s_data_directory(upgraded: Any) -> None:
    cluster, manifest = upgraded
    expect = manifest["expect"]
    topic, pop_topic, pop_group = manifest["topic"], manifest["pop_topic"], manifest["pop_group"]
    leader = cluster.wait_leader(60)
    cluster.wait_all_know_leader(60)

    async def check() -> None:
        async with Client(cluster.urls, deadline_s=30) as client:
            for i in range(cluster.n):
                node = await client.node(cluster.urls[i])
                assert node["version"] == VERSION, node
            topics = {t["topic"]: t for t in (await client.topics())["topics"]}
            assert topics[topic]["queues"] == 2 and pop_topic in topics, topics
            for group, offsets in expect["offsets"].items():
                got = {str(o["queue"]): o["offset"] for o in await client.offsets(group, topic)}
                assert got == offsets, (group, got)

            # Every waiting message is delivered once, never early; no cancelled timer.
            copies: list[dict[str, Any]] = []
            read = [0, 0]
            wanted = {m["msg_id"] for m in expect["delayed"]} | set(expect["plain"])

            async def delivered() -> bool:
                for q in range(2):
                    page = await client.pull(topic, q, read[q], 1000, url=cluster.urls[leader])
                    copies.extend(page["messages"])
                    read[q] = page["next_offset"]
                return wanted <= {m["msg_id"] for m in copies}

            await wait_for(delivered, DELIVERY_S, "every waiting message delivered", cluster)
            counts = Counter(m["msg_id"] for m in copies)
            assert {k for k, n in counts.items() if n > 1} == set()
            assert set(counts) == wanted, set(counts) ^ wanted
            by_id = {m["msg_id"]: m for m in copies}
            for m in expect["delayed"]:
                got = by_id[m["msg_id"]]
                assert got["body"] == m["body"]
                assert got["store_ms"] >= m["due_ms"], f"{m} delivered early: {got}"
            assert not {m["msg_id"] for m in expect["cancelled"]} & set(counts)

    asyncio.run(check())

    async def pop_group_state() -> None:
        unacked = set(expect["pop"]["unacked"])
        got: list[str] = []
        async with aiohttp.ClientSession() as s:
            url = f"{cluster.urls[leader]}/v1/groups/{pop_group}/pop"

            async def popped_all() -> bool:
                async with s.post(url, json={"topic": pop_topic, "max": 32, "wait_ms": 500}) as r:
                    assert r.status == 200, await r.text()
                    got.extend(m["body"] for m in (await r.json())["messages"])
                return unacked <= set(got)

            await wait_for(popped_all, DELIVERY_S, "the unacked jobs popped again", cluster)
        assert sorted(got) == sorted(unacked), f"popped {got}\n{dump_logs(cluster)}"

    asyncio.run(pop_group_state())
    cluster.wait_converged(60)
