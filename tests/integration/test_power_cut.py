"""Power cuts without a power-cut filesystem, on 3 real node processes with ``flush = sync``.

SIGKILL keeps the page cache, so a killed node loses nothing a power cut would. These tests
kill nodes, then take away by hand what a power cut may take under the durability model
(raftlog/journal.py, raftlog/store.py), and check what the durability table of the docs
(docs/explanation/durability.md) promises:

* every node at once loses every CommitLog and ConsumeQueue byte past its last snapshot (not
  synced under either setting: the journal is) and ends its journal in a torn record (a write
  in flight): every acknowledged message is there after the restart, on every node;
* one node's journal ends in a torn record: it is cut, the node rejoins and converges;
* a vote: term and vote on disk are those the node reported, and kept across a restart;
* an fsync that fails (injected into one node's process by ``sitecustomize``): the node stops
  with exit status 70 and a message naming the file; the others keep serving.

Every wait is a condition with a deadline.
"""

from __future__ import annotations

import asyncio
import json
import os
import textwrap
from pathlib import Path
from typing import Any

import orjson
import pytest

from chronomq.aio import Client
from chronomq.cluster.process.launcher import LocalCluster
from chronomq.raftlog.journal import encode_record, read_file
from chronomq.raftlog.store import Store
from tests.integration.test_restart_all import kill_all_at_once, node_log, wait_until

pytestmark = pytest.mark.integration

TOPIC = "cut"
SEG = 65536


def _settings(**over: Any) -> dict[str, Any]:
    return {
        "flush": "sync",
        "commitlog_segment_bytes": SEG,
        "log_compaction_min_entries": 20,
        "default_topic_queues": 2,
        **over,
    }


async def _produce(urls: list[str], n: int, tag: str) -> dict[str, str]:
    """Produce ``n`` messages in small batches; msg_id -> body of every acknowledged one."""
    acked: dict[str, str] = {}
    async with Client(urls) as client:
        for k in range(0, n, 5):
            batch = [{"body": f"{tag}-{k + j}-" + "x" * 1500} for j in range(5)]
            answer = await client.produce(TOPIC, batch)
            for msg, r in zip(batch, answer["results"], strict=True):
                acked[r["msg_id"]] = msg["body"]
    return acked


async def _read_all(url: str) -> dict[str, str]:
    got: dict[str, str] = {}
    async with Client([url]) as client:
        for queue in range(2):
            offset = 0
            while True:
                page = await client.pull(TOPIC, queue, offset, 500)
                for m in page["messages"]:
                    got[m["msg_id"]] = m["body"]
                if not page["messages"]:
                    break
                offset = page["next_offset"]
    return got


def _lose_unsynced(data: Path) -> int:
    """What a power cut may take from a stopped node: CommitLog bytes and segments past the
    last snapshot, ConsumeQueue units past them; and the journal ends in a torn record.
    Returns the CommitLog bytes dropped."""
    snap_path = data / "raft" / "snapshot"
    length = 0
    if snap_path.exists():
        length = int(Store.parse_snapshot(snap_path.read_bytes())["length"])
    dropped = 0
    for seg in sorted((data / "commitlog").iterdir()):
        if not seg.name.isdigit():
            continue
        base, size = int(seg.name), seg.stat().st_size
        keep = max(0, min(size, length - base))
        dropped += size - keep
        if keep == 0 and base >= length and base > 0:
            seg.unlink()  # created after the snapshot: its bytes were never synced
        else:
            os.truncate(seg, keep)
    for cq in (data / "consumequeue").rglob("*"):
        if cq.is_file():
            os.truncate(cq, 0)
    journal = data / "raft" / "journal"
    torn = encode_record(b"\x01never-acknowledged", 10**9, 10**6)
    with open(journal, "ab") as f:
        f.write(torn[: len(torn) // 2])
    return dropped


def test_every_node_cut_at_once_keeps_every_acknowledged_message(make_cluster: Any) -> None:
    cluster: LocalCluster = make_cluster(3, **_settings())
    cluster.wait_leader(60)
    acked = asyncio.run(_produce(cluster.urls, 400, "a"))  # rolls several segments
    # Segments created just before the cut: written after the last snapshot, never synced.
    acked |= asyncio.run(_produce(cluster.urls, 15, "b"))
    kill_all_at_once(cluster)
    dropped = [_lose_unsynced(cluster.node_dir(i) / "data") for i in range(3)]
    assert any(dropped), "nothing past a snapshot: the test took nothing away"
    for i in range(3):
        cluster.start(i)
    cluster.wait_leader(60)
    cluster.wait_converged(60)
    for i in range(3):
        got = asyncio.run(_read_all(cluster.urls[i]))
        lost = set(acked) - set(got)
        assert not lost, f"node {i} lost {len(lost)} acknowledged messages"
        assert all(got[k] == acked[k] for k in acked)
        assert "torn record" in node_log(cluster, i)


def _tear_last_record(journal: Path) -> int:
    got = read_file(str(journal))
    assert got is not None and got.entries, "the journal holds no entry to tear"
    last = got.offsets[-1]
    with open(journal, "r+b") as f:
        f.seek(last + 8)
        f.write(b"\xde\xad\xbe\xef")  # the last record's index: its CRC no longer matches
    return last


def test_a_torn_journal_tail_is_cut_and_the_node_rejoins(make_cluster: Any) -> None:
    cluster: LocalCluster = make_cluster(3, **_settings())
    leader = cluster.wait_leader(60)
    node = next(i for i in range(3) if i != leader)
    others = [i for i in range(3) if i != node]
    acked = asyncio.run(_produce(cluster.urls, 60, "a"))
    cluster.wait_converged(30)
    cluster.kill(node)
    journal = cluster.node_dir(node) / "data" / "raft" / "journal"
    at = _tear_last_record(journal)
    acked |= asyncio.run(_produce([cluster.urls[i] for i in others], 20, "b"))
    cluster.start(node)
    cluster.wait_converged(60)
    text = node_log(cluster, node)
    assert f"ends in a torn record at byte {at}" in text, text[-2000:]
    got = asyncio.run(_read_all(cluster.urls[node]))
    assert set(acked) <= set(got)


def test_a_vote_is_on_disk_when_cast_and_kept_across_a_cut(make_cluster: Any) -> None:
    cluster: LocalCluster = make_cluster(3, **_settings())
    leader = cluster.wait_leader(60)
    asyncio.run(_produce(cluster.urls, 5, "a"))
    # A new election: the leader goes, the others vote in a new term.
    cluster.kill(leader)
    rest = [i for i in range(3) if i != leader]
    new = cluster.wait_leader(60, among=rest)
    status = cluster.node_status(new)
    assert status is not None
    term = int(status["term"])
    kill_all_at_once(cluster)  # just after the votes
    leader_id = None
    for i in rest:
        meta = orjson.loads((cluster.node_dir(i) / "data" / "raft" / "journal.meta").read_bytes())
        assert meta["term"] >= term
        if meta["term"] == term:
            leader_id = leader_id or meta["voted_for"]
            assert meta["voted_for"] == leader_id  # both voted for the one leader
    for i in range(3):
        cluster.start(i)
    cluster.wait_leader(60)
    for i in range(3):
        st = wait_until(lambda i=i: cluster.node_status(i), 30, f"node {i} status", cluster)
        assert int(st["term"]) >= term


_FAILING_FSYNC = textwrap.dedent(
    """
    # Test hook: once the file named by CHRONOMQ_TEST_FSYNC_FAIL exists, fsync and fdatasync
    # fail with EIO in this process, as a disk that lost a write would make them.
    import errno, os

    _trigger = os.environ.get("CHRONOMQ_TEST_FSYNC_FAIL")
    if _trigger:
        def _wrap(real):
            def call(fd):
                if os.path.exists(_trigger):
                    raise OSError(errno.EIO, "Input/output error")
                return real(fd)
            return call
        os.fsync = _wrap(os.fsync)
        os.fdatasync = _wrap(os.fdatasync)
    """
)


def test_a_failed_fsync_stops_the_node_with_a_message(make_cluster: Any, tmp_path: Path) -> None:
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(_FAILING_FSYNC)
    trigger = tmp_path / "fail-now"
    cluster: LocalCluster = make_cluster(3, **_settings())
    leader = cluster.wait_leader(60)
    node = next(i for i in range(3) if i != leader)
    cluster.kill(node)
    pythonpath = os.pathsep.join(
        p for p in (str(hook), os.environ.get("PYTHONPATH", ""), os.getcwd()) if p
    )
    cluster.node_env[node] = {"PYTHONPATH": pythonpath, "CHRONOMQ_TEST_FSYNC_FAIL": str(trigger)}
    cluster.start(node)
    cluster.wait_converged(60)
    acked = asyncio.run(_produce(cluster.urls, 10, "a"))
    trigger.touch()
    others = [i for i in range(3) if i != node]
    acked |= asyncio.run(_produce([cluster.urls[i] for i in others], 10, "b"))
    p = cluster.procs[node]
    p.wait(timeout=60)
    assert p.returncode == 70
    text = node_log(cluster, node)
    fatal = [json.loads(line) for line in text.splitlines() if '"critical"' in line]
    assert fatal and "fsync of" in fatal[-1]["msg"], text[-2000:]
    assert "Input/output error" in fatal[-1]["msg"]
    assert str(cluster.node_dir(node) / "data") in fatal[-1]["msg"]
    cluster.kill(node)
    cluster.procs.pop(node)
    # The other two keep serving, with everything acknowledged.
    acked |= asyncio.run(_produce([cluster.urls[i] for i in others], 10, "c"))
    got = asyncio.run(_read_all(cluster.urls[others[0]]))
    assert set(acked) <= set(got)
