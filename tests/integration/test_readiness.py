"""Readiness on real nodes: /readyz, the node status, `chronomq status` and the answers of a
leader that stepped down all say whether a write sent to that node can commit now."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from typing import Any

import aiohttp
import pytest

from chronomq.cluster.process.launcher import LocalCluster
from tests.integration.conftest import wait_for

pytestmark = pytest.mark.integration


async def _readyz(url: str) -> tuple[int, dict[str, Any]]:
    async with (
        aiohttp.ClientSession() as s,
        s.get(f"{url}/readyz", timeout=aiohttp.ClientTimeout(total=3)) as r,
    ):
        return r.status, await r.json()


async def _node(url: str) -> dict[str, Any]:
    async with (
        aiohttp.ClientSession() as s,
        s.get(f"{url}/v1/admin/node", timeout=aiohttp.ClientTimeout(total=3)) as r,
    ):
        assert r.status == 200, await r.text()
        data: dict[str, Any] = await r.json()
        return data


def _status_json(url: str) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-m", "chronomq.cluster", "status", "--json", "--url", url],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr
    view: dict[str, Any] = json.loads(done.stdout)
    return view


def _not_ready_within(cluster: LocalCluster, node: int, timeout_s: float) -> dict[str, Any]:
    url = cluster.http_url(node)

    async def not_ready() -> dict[str, Any] | None:
        status, body = await _readyz(url)
        return body if status == 503 else None

    body: dict[str, Any] = asyncio.run(
        wait_for(not_ready, timeout_s, f"node {node}'s /readyz turning 503", cluster)
    )
    return body


def test_survivor_of_two_kills_is_not_ready_and_status_agrees(make_cluster: Any) -> None:
    cluster = make_cluster(3)
    leader = cluster.wait_leader(60)
    survivor, other = (i for i in range(3) if i != leader)
    url = cluster.http_url(survivor)
    status, body = asyncio.run(_readyz(url))
    assert status == 200 and body["leader"] == leader, body

    cluster.kill(leader)
    cluster.kill(other)
    # The lease (1.5 s) and a few heartbeats: well within 10 s. Before, the survivor said
    # ready, naming the dead leader, for as long as it stayed alone.
    body = _not_ready_within(cluster, survivor, 10)
    assert body["status"] == "no_leader" and body["error"] == "no_leader"
    assert "not ready" in body["message"], body

    st = asyncio.run(_node(url))
    assert st["ready"] is False and st["ready_reason"], st
    view = _status_json(url)
    assert view["leader"] is None, view
    me = next(n for n in view["nodes"] if n["id"] == survivor)
    assert me["ready"] is False and me["reachable"] is True, me
    assert [n["reachable"] for n in view["nodes"] if n["id"] != survivor] == [False, False]
    table = subprocess.run(
        [sys.executable, "-m", "chronomq.cluster", "status", "--url", url],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert table.returncode == 0, table.stderr
    assert f"node {survivor} not ready:" in table.stdout, table.stdout

    # A majority again: ready again, and every view agrees.
    cluster.restart(other)
    new_leader = cluster.wait_leader(60, among=[survivor, other])

    async def ready_again() -> bool:
        status, body = await _readyz(url)
        return status == 200 and body["leader"] == new_leader

    asyncio.run(wait_for(ready_again, 30, "the survivor ready again", cluster))
    assert asyncio.run(_node(url))["ready"] is True


def test_leader_that_lost_its_followers_steps_down_and_names_no_leader(
    make_cluster: Any,
) -> None:
    # pysyncobj would keep the leader role for 30 s; the lease (1.5 s) decides readiness.
    cluster = make_cluster(3, leader_fallback_timeout_ms=30_000)
    leader = cluster.wait_leader(60)
    url = cluster.http_url(leader)
    for i in range(3):
        if i != leader:
            cluster.kill(i)
    _not_ready_within(cluster, leader, 10)
    st = asyncio.run(_node(url))
    assert st["ready"] is False, st
    assert st["leader"] != leader and st["leader_url"] != url, st

    async def produce() -> tuple[int, dict[str, Any]]:
        async with (
            aiohttp.ClientSession() as s,
            s.post(
                f"{url}/v1/topics/t/messages",
                json={"messages": [{"body": "x"}]},
                timeout=aiohttp.ClientTimeout(total=30),
            ) as r,
        ):
            return r.status, await r.json()

    status, body = asyncio.run(produce())
    assert status == 503, body
    assert body.get("leader") != url, body
