"""Disk on 3 real nodes, each on a small tmpfs of its own: produce answers 507 before the disk fills and nothing
acknowledged is lost; retention deletes old CommitLog segments but never a delayed message
that still waits."""

from __future__ import annotations

import asyncio
import random
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from chronomq.aio import Client
from chronomq.cluster.process.launcher import LocalCluster
from chronomq.errors import ApiError, ChronomqError
from tests.integration.conftest import dump_logs, free_port_base, wait_for

pytestmark = pytest.mark.integration

TOPIC = "disk"
QUEUES = 4


@pytest.fixture
def mount_tmpfs() -> Iterator[Any]:
    """``mount_tmpfs(path, size)`` mounts a tmpfs there (unmounted afterwards); the test is
    skipped where mounting is refused."""
    mounted: list[Path] = []

    def mount(path: Path, size: str) -> None:
        path.mkdir(parents=True, exist_ok=True)
        try:
            done = subprocess.run(
                ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                capture_output=True,
                timeout=30,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            pytest.skip(f"cannot mount a tmpfs: {exc}")
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs: {done.stderr.decode(errors='replace').strip()}")
        mounted.append(path)

    yield mount
    for path in reversed(mounted):
        subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=30)


@pytest.fixture
def cluster_on(mount_tmpfs: Any, tmp_path: Path) -> Iterator[Any]:
    """A 3-node cluster whose nodes each have a disk of their own: a 96 MiB tmpfs per node
    directory, as each node of a real cluster has its own disk."""
    clusters: list[LocalCluster] = []

    def make(sizes: tuple[str, str, str] = ("96m", "96m", "96m"), **settings: Any) -> LocalCluster:
        http, raft = free_port_base(3, random.Random())
        base = tmp_path / f"c{len(clusters)}"
        for i in range(3):
            mount_tmpfs(base / f"node-{i}", sizes[i])
        c = LocalCluster(
            3,
            base,
            http_port=http,
            raft_port=raft,
            settings={"default_topic_queues": QUEUES, "ops_log_enabled": False, **settings},
        )
        clusters.append(c)
        c.start()
        return c

    yield make
    for c in clusters:
        c.stop()


async def node(client: Client, url: str) -> dict[str, Any]:
    status: dict[str, Any] = await client.request("GET", "/v1/admin/node", url=url)
    return status


async def read_all(client: Client, url: str, topic: str) -> dict[str, dict[str, Any]]:
    """Every message of ``topic`` one node serves, by msg_id, each queue from offset 0."""
    out: dict[str, dict[str, Any]] = {}
    for q in range(QUEUES):
        offset = 0
        while True:
            page = await client.pull(topic, q, offset, 500, url=url)
            for m in page["messages"]:
                out[m["msg_id"]] = m
            if not page["messages"]:
                break
            offset = page["next_offset"]
    return out


async def test_produce_answers_507_before_the_disk_fills_and_nothing_acknowledged_is_lost(
    cluster_on: Any,
) -> None:
    # The margin above the warning level must hold about a second of writes, the Raft
    # journal's growth included.
    cluster = cluster_on(
        commitlog_segment_bytes=1 << 20,
        disk_space_warning_level_ratio=0.6,
        disk_max_used_space_ratio=0.5,
    )
    cluster.wait_leader()
    body = "x" * 4000
    acked: set[str] = set()
    refused: ApiError | None = None
    async with Client(cluster.urls, deadline_s=30) as client:
        deadline = time.monotonic() + 240
        while refused is None:
            assert time.monotonic() < deadline, "no 507 within 240 s\n" + dump_logs(cluster)
            try:
                answer = await client.produce(TOPIC, [{"body": body} for _ in range(10)])
            except ChronomqError as exc:
                if not isinstance(exc, ApiError) or exc.status != 507:
                    raise AssertionError(f"{exc}\n{dump_logs(cluster)}") from exc
                refused = exc
                break
            acked.update(r["msg_id"] for r in answer["results"])
        assert refused.body["error"] == "disk_full"
        assert acked, "the disk was full before anything was stored"

        # The answer carries Retry-After, from the leader and through a follower alike. Near
        # the level a request may still fit a moment later (a follower's fresher report, a
        # compacted journal): each node is asked until it refuses, every answer 200 or 507.
        async with aiohttp.ClientSession() as http:
            for url in cluster.urls:
                for _attempt in range(100):
                    async with http.post(
                        f"{url}/v1/topics/{TOPIC}/messages",
                        json={"messages": [{"body": body} for _ in range(10)]},
                    ) as r:
                        assert r.status in (200, 507), await r.text()
                        if r.status == 200:
                            acked.update(m["msg_id"] for m in (await r.json())["results"])
                            continue
                        assert int(r.headers["Retry-After"]) > 0
                        break
                else:
                    raise AssertionError(f"{url} admitted 100 more requests after a 507")

        # No node exited; admin, digests and consumption still work.
        assert all(cluster.alive(i) for i in range(3)), dump_logs(cluster)
        await asyncio.to_thread(cluster.wait_converged, 60.0)
        for url in cluster.urls:
            status = await node(client, url)
            disk = status["disk"]
            # The refusals were checked above, when they were answered. Each node has its own
            # disk: once a node snapshots, its Raft journal (as large as the CommitLog here) is
            # compacted and its used ratio can fall well below the warning level again, so
            # only what must hold at any time is checked now: no disk ever filled.
            assert disk["free_bytes"] > 0, disk
            served = await read_all(client, url, TOPIC)
            missing = acked - served.keys()
            assert not missing, f"{url} lost {len(missing)} acknowledged messages"
        async with aiohttp.ClientSession() as http, http.get(f"{cluster.urls[0]}/metrics") as r:
            text = await r.text()
            assert "chronomq_disk_used_ratio" in text
            assert "chronomq_produce_disk_full_rejections_total" in text
        assert all(cluster.alive(i) for i in range(3)), dump_logs(cluster)


async def test_retention_deletes_old_segments_but_never_a_waiting_delayed_message(
    cluster_on: Any,
) -> None:
    cluster = cluster_on(
        commitlog_segment_bytes=1 << 16,
        file_reserved_time_h=0.002,  # 7.2 s
        message_delay_level="1s 40s",
        log_compaction_min_entries=10,
        log_compaction_min_time_s=1,
    )
    cluster.wait_leader()
    filler = "f" * 6000
    async with Client(cluster.urls, deadline_s=30) as client:

        async def fill(n: int) -> None:
            for _ in range(n):
                await client.produce("filler", [{"body": filler} for _ in range(10)])

        await fill(20)  # ~1.2 MB: segments that expire and hold nothing waiting
        delayed = await client.produce(
            TOPIC,
            [{"body": "level", "delay_level": 2}, {"body": "timer", "delay_ms": 40_000}],
        )
        ids = {r["msg_id"] for r in delayed["results"]}
        due_ms = max(r["deliver_ms"] for r in delayed["results"])
        await fill(20)

        async def old_segments_gone() -> bool:
            for url in cluster.urls:
                disk = (await node(client, url))["disk"]
                if disk["segments_deleted"] == 0:
                    return False
            return True

        await wait_for(old_segments_gone, 30, "old CommitLog segments deleted", cluster)
        # Deleted while the delayed messages still wait (their due time is ahead).
        assert time.time() * 1000 < due_ms
        assert not (await read_all(client, cluster.urls[0], TOPIC))
        for url in cluster.urls:
            disk = (await node(client, url))["disk"]
            assert disk["commitlog_min_offset"] > 0
            assert disk["needed_offset"] is not None
            assert disk["commitlog_min_offset"] <= disk["needed_offset"]
            topic = await client.request("GET", "/v1/topics/filler", url=url)
            assert any(q["min_offset"] > 0 for q in topic["queues"])
            # A pull from 0 answers from the new minimum.
            q = next(q for q in topic["queues"] if q["min_offset"] > 0)
            page = await client.pull("filler", q["queue"], 0, 1, url=url)
            assert page["messages"][0]["offset"] == q["min_offset"]
        await asyncio.to_thread(cluster.wait_converged, 30.0)

        async def delivered() -> dict[str, dict[str, Any]] | None:
            got = await read_all(client, cluster.urls[1], TOPIC)
            return got if ids <= got.keys() else None

        got = await wait_for(delivered, 90, "both delayed messages delivered", cluster)
        assert sorted(m["body"] for m in got.values()) == ["level", "timer"]
        assert all(cluster.alive(i) for i in range(3)), dump_logs(cluster)
        await asyncio.to_thread(cluster.wait_converged, 30.0)


def _grow(path: Path, size: str) -> None:
    done = subprocess.run(
        ["mount", "-o", f"remount,size={size}", str(path)], capture_output=True, timeout=30
    )
    assert done.returncode == 0, done.stderr.decode(errors="replace")


Flood = tuple[dict[str, tuple[int, int]], dict[int, int]]


async def flood(cluster: LocalCluster, producers: int = 16, limit_s: float = 120) -> Flood:
    """``producers`` clients each sending 4 x 256 KiB per request to the nodes in turn until
    five 507s in a row (or ``limit_s``): the acknowledged msg_ids with their queue and offset,
    and how often each status came. Fails on any status but 200, 507 and 429."""
    body = "b" * (256 * 1024)
    payload = {"messages": [{"body": body} for _ in range(4)]}
    acked: dict[str, tuple[int, int]] = {}
    statuses: dict[int, int] = {}
    odd: list[str] = []
    stop_at = time.monotonic() + limit_s

    async def producer(n: int, http: aiohttp.ClientSession) -> None:
        refused_in_a_row = 0
        i = 0
        while refused_in_a_row < 5 and time.monotonic() < stop_at:
            url = cluster.urls[(n + i) % 3]  # followers forward to the leader
            i += 1
            async with http.post(
                f"{url}/v1/topics/{TOPIC}/messages",
                json=payload,
                timeout=aiohttp.ClientTimeout(total=60),
            ) as r:
                statuses[r.status] = statuses.get(r.status, 0) + 1
                answer = await r.json()
                if r.status == 200:
                    refused_in_a_row = 0
                    for res in answer["results"]:
                        acked[res["msg_id"]] = (res["queue"], res["offset"])
                elif r.status == 507 and answer.get("error") == "disk_full":
                    refused_in_a_row += 1
                elif r.status != 429:
                    odd.append(f"{r.status} from {url}: {answer}")
                    return

    async with aiohttp.ClientSession() as http:
        await asyncio.gather(*(producer(n, http) for n in range(producers)))
    print(f"statuses {statuses}, acknowledged {len(acked)}")
    assert not odd, f"answers other than 200/507/429: {odd[:5]}\n{dump_logs(cluster)}"
    assert statuses.get(507), f"the flood never reached the guard: {statuses}"
    assert acked, statuses
    assert all(cluster.alive(i) for i in range(3)), dump_logs(cluster)
    return acked, statuses


async def grow_and_converge(cluster: LocalCluster, client: Client, acked: Any) -> None:
    """Every disk twice as large: every node takes entries again, converges and serves every
    acknowledged message; a write is admitted again."""
    for i in range(3):
        _grow(cluster.node_dir(i), "192m")

    async def resumed() -> bool:
        for url in cluster.urls:
            if (await node(client, url))["disk"]["paused"]:
                return False
        return True

    await wait_for(resumed, 30, "every node taking entries again", cluster)
    await asyncio.to_thread(cluster.wait_converged, 60.0)
    for url in cluster.urls:
        served = await read_all(client, url, TOPIC)
        missing = acked.keys() - served.keys()
        assert not missing, f"{url} lacks {len(missing)} of {len(acked)} acknowledged messages"
    answer = await client.produce(TOPIC, [{"body": "after"}])
    assert answer["results"]
    assert all(cluster.alive(i) for i in range(3)), dump_logs(cluster)


async def test_a_flood_of_large_messages_is_refused_before_any_disk_fills_and_no_node_exits(
    cluster_on: Any,
) -> None:
    """16 producers of 4 x 256 KiB against 3 nodes on 96 MiB disks, default guard settings:
    every answer is 200, 507 or 429; no node exits; every acknowledged message is readable;
    once the disks grow, every node takes entries again and writes are admitted."""
    cluster = cluster_on()
    leader = cluster.wait_leader()
    cluster.wait_all_know_leader(30)
    acked, _statuses = await flood(cluster)
    async with Client([cluster.http_url(leader)], deadline_s=30) as client:
        served = await read_all(client, cluster.http_url(leader), TOPIC)
        missing = acked.keys() - served.keys()
        assert not missing, f"the leader lost {len(missing)} of {len(acked)} acknowledged messages"
        for url in cluster.urls:
            disk = (await node(client, url))["disk"]
            print(url, {k: disk[k] for k in ("free_bytes", "paused", "produce_rejections")})
            assert disk["free_bytes"] > 0, disk
        await grow_and_converge(cluster, client, acked)


async def test_a_follower_on_a_smaller_disk_pauses_serves_reads_and_resumes(
    cluster_on: Any,
) -> None:
    """One follower's disk is a third smaller: the leader goes on with the other follower as
    its majority; the small one pauses at its floor instead of exiting (ENOSPC never reached),
    keeps serving reads, and catches up once its disk grows."""
    cluster = cluster_on(sizes=("96m", "96m", "64m"))
    # Node 2, the small one, is a follower: leadership is moved off it if it won.
    leader = cluster.wait_leader()
    async with Client(cluster.urls, deadline_s=30) as client:
        if leader == 2:
            await client.request(
                "POST", "/v1/admin/leadership/transfer", json_body={"to": 0}, url=cluster.urls[2]
            )
            leader = cluster.wait_leader(30, among=[0, 1])
        cluster.wait_all_know_leader(30)
        acked, _statuses = await flood(cluster)
        small = cluster.urls[2]

        async def paused() -> bool:
            return bool((await node(client, small))["disk"]["paused"])

        await wait_for(paused, 30, "the small follower pausing", cluster)
        text = (cluster.node_dir(2) / "node.log").read_text(errors="replace")
        assert "stops taking Raft entries" in text, text[-3000:]
        assert '"level":"critical"' not in text, text[-3000:]
        # It still serves reads of what it holds.
        page = await client.pull(TOPIC, 0, 0, 1, url=small)
        assert page["messages"], page
        assert all(cluster.alive(i) for i in range(3)), dump_logs(cluster)
        await grow_and_converge(cluster, client, acked)
        text = (cluster.node_dir(2) / "node.log").read_text(errors="replace")
        assert "has room again" in text, text[-3000:]
