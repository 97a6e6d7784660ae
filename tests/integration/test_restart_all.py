"""Whole-cluster restarts, bounded stops and damaged files, on 3 real node processes.

* Every node SIGKILLed at once under plain, delay-level and timer traffic, with messages due
  during the outage, then started again on the same directories: the cluster becomes ready
  and delivers every acknowledged message once, never early.
* SIGTERM stops a node within 10 s whatever it is doing: its peers paused so nothing
  commits, restoring a snapshot from peers that do not answer, leading under a burst; and
  ``cluster up``'s Ctrl-C leaves no process behind.
* A node restarted on a damaged journal, snapshot or CommitLog either repairs from its peers
  or refuses to start naming the file, while the other two keep serving.

Every wait is a condition with a deadline.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from chronomq.aio import Client
from chronomq.cluster.process.launcher import LocalCluster, wait_stopped
from chronomq.errors import ChronomqError
from chronomq.raftlog.journal import TORN_GROUPS, encode_record, header, read_file
from chronomq.raftlog.store import Store
from tests.integration.conftest import dump_logs, free_port_base, wait_for

pytestmark = pytest.mark.integration

LEVELS = "1s 2s 3s"
TOPIC = "orders"
QUEUES = 4
STOP_BOUND_S = 10.0


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def wait_until(predicate: Any, timeout_s: float, what: str, cluster: LocalCluster) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"{what} not within {timeout_s} s\n{dump_logs(cluster)}")


def kill_all_at_once(cluster: LocalCluster) -> None:
    """SIGKILL every node before reaping any: a power cut of the rack."""
    running = {i: p for i, p in cluster.procs.items() if p.poll() is None}
    for p in running.values():
        os.kill(p.pid, signal.SIGKILL)
    for i, p in running.items():
        p.wait(timeout=10)
        cluster.kill(i)  # reaps
    assert not any(cluster.alive(i) for i in range(cluster.n))


def node_log(cluster: LocalCluster, i: int) -> str:
    path = cluster.node_dir(i) / "node.log"
    return path.read_text(errors="replace") if path.exists() else ""


def stops_within(p: subprocess.Popen[bytes], bound_s: float = STOP_BOUND_S) -> float:
    """Send SIGTERM and return how long the process took to exit (fails past ``bound_s``)."""
    t0 = time.monotonic()
    p.send_signal(signal.SIGTERM)
    try:
        p.wait(timeout=bound_s)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait(timeout=10)
        raise AssertionError(f"pid {p.pid} still running {bound_s} s after SIGTERM") from None
    return time.monotonic() - t0


class Ledger:
    """What was acknowledged: msg_id -> (body, earliest delivery time in ms)."""

    def __init__(self) -> None:
        self.acked: dict[str, tuple[str, int]] = {}

    def record(self, sent: list[dict[str, Any]], answer: dict[str, Any]) -> None:
        for msg, r in zip(sent, answer["results"], strict=True):
            self.acked[r["msg_id"]] = (msg["body"], int(r.get("deliver_ms") or 0))


async def producer(client: Client, ledger: Ledger, rng: random.Random, name: str, until: float):
    """Plain, delay-level and delay_ms messages in small batches until ``until``."""
    n = 0
    while time.monotonic() < until:
        batch = []
        for _ in range(10):
            kind = rng.choice(("plain", "level", "timer"))
            msg: dict[str, Any] = {"body": f"{name}-{n}-{kind}"}
            if kind == "level":
                msg["delay_level"] = rng.randint(1, 3)
            elif kind == "timer":
                msg["delay_ms"] = rng.randint(500, 4000)
            batch.append(msg)
            n += 1
        try:
            ledger.record(batch, await client.produce(TOPIC, batch))
        except ChronomqError:
            continue  # not acknowledged: the checker does not expect it


class Collector:
    """Reads every queue of the real topic from one node; keeps every copy."""

    def __init__(self, client: Client, url: str) -> None:
        self.client = client
        self.url = url
        self.offsets = [0] * QUEUES
        self.copies: list[dict[str, Any]] = []

    async def poll(self) -> int:
        for q in range(QUEUES):
            try:
                page = await self.client.pull(TOPIC, q, self.offsets[q], 1000, url=self.url)
            except ChronomqError:
                continue
            self.copies.extend(page["messages"])
            self.offsets[q] = page["next_offset"]
        return len({m["msg_id"] for m in self.copies})

    def check(self, ledger: Ledger) -> dict[str, int]:
        """The checker's counts (as in ops/drill/checker.py)."""
        counts = Counter(m["msg_id"] for m in self.copies)
        first = {}
        for m in self.copies:
            first.setdefault(m["msg_id"], m)
        return {
            "lost": len(set(ledger.acked) - set(counts)),
            "duplicated": sum(1 for n in counts.values() if n > 1),
            "early": sum(
                1
                for k, m in first.items()
                if k in ledger.acked and m["store_ms"] < ledger.acked[k][1]
            ),
            "wrong_body": sum(
                1 for k, m in first.items() if k in ledger.acked and m["body"] != ledger.acked[k][0]
            ),
            "unexpected": len(set(counts) - set(ledger.acked)),
        }


async def quiescent(client: Client, cluster: LocalCluster, leader_url: str) -> bool:
    """Nothing left to deliver: every level and the wheel are empty on the leader, and the
    three CommitLogs are equal (no delivery command is in flight)."""
    sched = await client.request("GET", "/v1/admin/schedule", url=leader_url)
    timer = await client.request("GET", "/v1/admin/timer", url=leader_url)
    levels_done = all(lv["backlog"] == 0 and lv["pending"] == 0 for lv in sched["levels"])
    timer_done = timer["backlog"]["total"] == 0 and timer["offset_behind"] == 0
    digests = [d for d in cluster.digests().values()]
    same = (
        all(d is not None for d in digests)
        and len({(d["length"], d["chain"]) for d in digests if d}) == 1
    )
    return levels_done and timer_done and timer["inflight_commands"] == 0 and same


# ---------------------------------------------------------------------- restart all


def test_every_node_killed_at_once_comes_back_and_delivers_everything(make_cluster: Any) -> None:
    cluster: LocalCluster = make_cluster(
        3,
        message_delay_level=LEVELS,
        enable_schedule_async_deliver=True,
        log_compaction_min_entries=50,
    )
    cluster.wait_leader(60)
    seed = random.randrange(2**32)
    ledger = Ledger()

    async def load() -> None:
        async with Client(cluster.urls, deadline_s=10) as client:
            until = time.monotonic() + 6
            await asyncio.gather(
                *(
                    producer(client, ledger, random.Random(seed + k), f"p{k}", until)
                    for k in range(4)
                )
            )

    asyncio.run(load())
    killed_ms = now_ms()
    kill_all_at_once(cluster)
    assert len(ledger.acked) > 100, f"seed {seed}: only {len(ledger.acked)} acknowledged"
    assert all((cluster.node_dir(i) / "data" / "raft" / "snapshot").exists() for i in range(3))
    # Timers and levels fall due while every node is down.
    due_in_outage = [d for _, d in ledger.acked.values() if d > killed_ms]
    assert due_in_outage, f"seed {seed}: nothing due during the outage"
    wait_until(lambda: now_ms() > min(due_in_outage) + 500, 10, "a due time passing", cluster)

    cluster.start()
    leader = cluster.wait_leader(60)

    async def check() -> dict[str, int]:
        async with Client(cluster.urls, deadline_s=30) as client:
            collector = Collector(client, cluster.urls[leader])

            async def all_delivered() -> bool:
                return await collector.poll() >= len(ledger.acked)

            try:
                await wait_for(all_delivered, 60, f"seed {seed}: every acknowledged message")
            except AssertionError as exc:
                raise AssertionError(f"{exc}: {await missing(client, collector)}") from None

            async def settled() -> bool:
                return await quiescent(client, cluster, cluster.urls[leader])

            await wait_for(settled, 30, f"seed {seed}: nothing left to deliver", cluster)
            await collector.poll()  # after quiescence: a duplicate would be here by now
            for i in range(3):
                status = await client.request("GET", "/readyz", url=cluster.urls[i])
                assert status["status"] == "ready"
            return collector.check(ledger)

    async def missing(client: Client, collector: Collector) -> str:
        """Which acknowledged messages the collector lacks, and what each node knows of them."""
        seen = {m["msg_id"] for m in collector.copies}
        lacking = sorted(set(ledger.acked) - seen)
        lines = [f"{len(seen)} of {len(ledger.acked)} collected, {len(lacking)} lacking"]
        for msg_id in lacking[:5]:
            body, due = ledger.acked[msg_id]
            where = []
            for i in range(3):
                try:
                    found = await client.request(
                        "GET", f"/v1/messages/{msg_id}", url=cluster.urls[i]
                    )
                    where.append(f"n{i}: {found.get('status') or found}")
                except ChronomqError as exc:
                    where.append(f"n{i}: {exc}")
            lines.append(f"{msg_id} {body} due {due - killed_ms} ms after the kill: {where}")
        lines.append(f"offsets read {collector.offsets}")
        return "\n".join(lines) + f"\n{dump_logs(cluster)}"

    counts = asyncio.run(check())
    assert counts == {"lost": 0, "duplicated": 0, "early": 0, "wrong_body": 0, "unexpected": 0}, (
        f"seed {seed}: {counts}"
    )
    for i in range(3):
        assert "no peer could send TimerLog" not in node_log(cluster, i)


def _uncompact(journal: Path) -> int:
    """Make ``journal`` what a node leaves when it stops after writing a snapshot but before
    compacting its journal: two more entries the snapshot covers in front. Returns how many
    entries follow the snapshot's last one."""
    got = read_file(str(journal))
    assert got is not None and len(got.entries) >= 2
    cmd, idx, term = got.entries[0]  # the entry before the snapshot's last one
    covered = [(cmd, idx - 2, term), (cmd, idx - 1, term)]
    data = header() + b"".join(encode_record(c, i, t) for c, i, t in covered + got.entries)
    tmp = journal.with_suffix(".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, journal)
    return len(got.entries) - 2


def test_entries_after_a_snapshot_survive_a_stop_before_the_journal_was_compacted(
    make_cluster: Any,
) -> None:
    """Every node snapshots at the same index; stopped between the snapshot and the journal's
    compaction, pysyncobj would clear the journal at start and lose every entry after the
    snapshot, committed ones included, on every node at once."""
    cluster: LocalCluster = make_cluster(3, log_compaction_min_entries=20, default_topic_queues=2)
    cluster.wait_leader(60)
    journals = [cluster.node_dir(i) / "data" / "raft" / "journal" for i in range(3)]

    async def produce() -> dict[str, str]:
        acked: dict[str, str] = {}
        async with Client(cluster.urls) as client:
            deadline = time.monotonic() + 60
            k = 0
            # Past a snapshot on every node, and a few entries after it on each.
            while k < 150 or not all(
                (snap := read_file(str(j))) is not None and len(snap.entries) >= 5 for j in journals
            ):
                assert time.monotonic() < deadline, "no snapshot with entries after it"
                batch = [{"body": f"m-{k + j}"} for j in range(5)]
                answer = await client.produce("after-snap", batch)
                for msg, r in zip(batch, answer["results"], strict=True):
                    acked[r["msg_id"]] = msg["body"]
                k += 5
        return acked

    acked = asyncio.run(produce())
    kill_all_at_once(cluster)
    assert all((cluster.node_dir(i) / "data" / "raft" / "snapshot").exists() for i in range(3))
    after = [_uncompact(j) for j in journals]
    assert all(n > 0 for n in after), after
    cluster.start()
    cluster.wait_leader(60)
    cluster.wait_converged(60)

    async def read_all(url: str) -> set[str]:
        got: set[str] = set()
        async with Client([url]) as client:
            for queue in range(2):
                offset = 0
                while True:
                    page = await client.pull("after-snap", queue, offset, 500)
                    got |= {m["msg_id"] for m in page["messages"]}
                    if not page["messages"]:
                        break
                    offset = page["next_offset"]
        return got

    for i in range(3):
        lost = set(acked) - asyncio.run(read_all(cluster.urls[i]))
        assert not lost, f"node {i} lost {len(lost)} acknowledged messages\n{dump_logs(cluster)}"
        assert "the node stopped before compacting it" in node_log(cluster, i)


# ---------------------------------------------------------------------- bounded stops


def test_sigterm_stops_a_node_whose_peers_are_paused(make_cluster: Any) -> None:
    cluster: LocalCluster = make_cluster(3)
    leader = cluster.wait_leader(60)
    others = [i for i in range(3) if i != leader]
    for i in others:
        cluster.kill(i, signal.SIGSTOP)

    async def stuck_produce() -> None:
        async with Client([cluster.urls[leader]], deadline_s=3) as client:
            with pytest.raises(ChronomqError):
                await client.produce(TOPIC, [{"body": "never committed"}])

    asyncio.run(stuck_produce())
    took = stops_within(cluster.procs[leader])
    for i in others:
        cluster.kill(i, signal.SIGCONT)
    assert took < STOP_BOUND_S


def test_sigterm_stops_a_node_restoring_from_peers_that_do_not_answer(make_cluster: Any) -> None:
    cluster: LocalCluster = make_cluster(3, log_compaction_min_entries=20)
    leader = cluster.wait_leader(60)
    node = next(i for i in range(3) if i != leader)

    async def load() -> None:
        async with Client(cluster.urls) as client:
            for k in range(60):
                await client.produce(TOPIC, [{"body": f"m{k}" * 100}])

    asyncio.run(load())
    snapshot = cluster.node_dir(node) / "data" / "raft" / "snapshot"
    wait_until(snapshot.exists, 30, "a snapshot on the node", cluster)
    cluster.kill(node)
    # Its CommitLog is gone: the restore must fetch it all, from peers that are paused.
    for seg in (cluster.node_dir(node) / "data" / "commitlog").iterdir():
        seg.unlink()
    others = [i for i in range(3) if i != node]
    for i in others:
        cluster.kill(i, signal.SIGSTOP)
    try:
        cluster.start(node)
        wait_until(
            lambda: "fetching the rest from a peer" in node_log(cluster, node),
            30,
            "the restore to start fetching",
            cluster,
        )
        took = stops_within(cluster.procs[node])
    finally:
        for i in others:
            cluster.kill(i, signal.SIGCONT)
    assert took < STOP_BOUND_S
    assert "exiting" in node_log(cluster, node) or "stopped" in node_log(cluster, node)


def test_sigterm_stops_a_leader_with_a_burst_in_flight(make_cluster: Any) -> None:
    cluster: LocalCluster = make_cluster(3)
    leader = cluster.wait_leader(60)
    results: list[Any] = []

    async def burst() -> None:
        async with Client([cluster.urls[leader]], deadline_s=5) as client:
            sends = [
                client.produce(TOPIC, [{"body": "x" * 2000} for _ in range(200)]) for _ in range(40)
            ]
            tasks = [asyncio.ensure_future(s) for s in sends]
            await wait_for(
                lambda: asyncio.sleep(0, result=any(t.done() for t in tasks)),
                30,
                "the burst under way",
            )
            took = await asyncio.to_thread(stops_within, cluster.procs[leader])
            results.append(took)
            await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(burst())
    assert results and results[0] < STOP_BOUND_S
    # The other two go on.
    others = [i for i in range(3) if i != leader]
    cluster.wait_leader(60, among=others)


def _children(pid: int) -> list[int]:
    out = subprocess.run(
        ["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True, check=False
    ).stdout
    return [int(x) for x in out.split()]


def _exists(pid: int) -> bool:
    """Whether ``pid`` is a process that has not been reaped (zombies count as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_cluster_up_ctrl_c_leaves_no_process_behind(tmp_path: Path) -> None:
    http, raft = free_port_base(3, random.Random())
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "chronomq.cluster", "cluster", "up", "--nodes", "3",
            "--http-port", str(http), "--raft-port", str(raft),
            "--data-dir", str(tmp_path / "var"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line or line.startswith("ready"):
                break
        children = _children(proc.pid)
        assert len(children) == 3, children
        # One node paused, as a debugger or a drill would leave it.
        os.kill(children[0], signal.SIGSTOP)
        assert wait_stopped(children[0]), "the node did not stop"
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert rc == 0
    left = [pid for pid in children if _exists(pid)]
    assert not left, f"still running after cluster up exited: {left}"


# ---------------------------------------------------------------------- damaged files


def _synced_journal_records(data: Path) -> list[int]:
    """The journal records that later sync groups show were synced (a record in the newest
    TORN_GROUPS + 1 groups may be a torn write, which a start cuts instead of refusing)."""
    got = read_file(str(data / "raft" / "journal"))
    assert got is not None
    return [k for k, g in enumerate(got.groups) if g <= got.max_group - TORN_GROUPS - 1]


def _corrupt_journal(data: Path) -> str:
    """Damage a record that later records show was synced (a torn write of the last syncs is
    cut, see test_power_cut.py; damage followed by records written after it was synced is
    refused)."""
    path = data / "raft" / "journal"
    got = read_file(str(path))
    assert got is not None
    synced = _synced_journal_records(data)
    assert synced, f"no record the journal shows synced (groups {got.groups})"
    raw = bytearray(path.read_bytes())
    raw[got.offsets[synced[0]] + 8] ^= 0xFF  # its index: the CRC no longer matches
    path.write_bytes(bytes(raw))
    return str(path)


def _corrupt_snapshot(data: Path) -> str:
    path = data / "raft" / "snapshot"
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    path.write_bytes(bytes(raw))
    return str(path)


def _corrupt_commitlog_tail(data: Path) -> str:
    """Damage the last bytes the snapshot covers (those past it are replayed anyway)."""
    snap = Store.parse_snapshot((data / "raft" / "snapshot").read_bytes())
    length = int(snap["length"])
    seg_bytes = int(snap["segment_bytes"])
    seg = data / "commitlog" / f"{length - length % seg_bytes:020d}"
    at = length % seg_bytes - 40
    with open(seg, "r+b") as f:
        f.seek(at)
        f.write(b"\x00garbage\x00" * 3)
    return str(seg.parent)


@pytest.mark.parametrize("damage", ["journal", "snapshot", "commitlog"])
def test_a_node_on_a_damaged_file_repairs_or_refuses_and_the_others_serve(
    make_cluster: Any, damage: str
) -> None:
    cluster: LocalCluster = make_cluster(3, log_compaction_min_entries=20)
    leader = cluster.wait_leader(60)
    node = next(i for i in range(3) if i != leader)
    others = [i for i in range(3) if i != node]
    data = cluster.node_dir(node) / "data"

    async def produce(n: int, tag: str) -> None:
        async with Client([cluster.urls[i] for i in others]) as client:
            for k in range(n):
                await client.produce(TOPIC, [{"body": f"{tag}-{k}", "queue": 0}])

    asyncio.run(produce(50, "before"))
    wait_until((data / "raft" / "snapshot").exists, 30, "a snapshot on the node", cluster)
    asyncio.run(produce(5, "tail"))  # journal entries past the snapshot
    cluster.wait_converged(30)
    cluster.kill(node)
    for attempt in range(5):
        # A compaction rewrites the entries it keeps as one sync group, and one may come after
        # the tail (the count of entries, internal commands included, decides when): then no
        # record has later groups after it. Write more, a command at a time, until one has.
        if damage != "journal" or _synced_journal_records(data):
            break
        cluster.start(node)
        asyncio.run(produce(TORN_GROUPS + 2, f"more-{attempt}"))
        cluster.wait_converged(30)
        cluster.kill(node)
    damaged = {
        "journal": _corrupt_journal,
        "snapshot": _corrupt_snapshot,
        "commitlog": _corrupt_commitlog_tail,
    }[damage](data)
    cluster.start(node)

    if damage == "commitlog":
        # Repaired from its peers: it serves, equal to them.
        cluster.wait_converged(60)
        assert "fetching all" in node_log(cluster, node)
    else:
        p = cluster.procs[node]
        p.wait(timeout=30)
        assert p.returncode == 70
        text = node_log(cluster, node)
        refusal = [json.loads(line) for line in text.splitlines() if "refusing to start" in line]
        assert refusal and damaged in refusal[-1]["msg"], text[-2000:]
        assert "move this node's data directory" in refusal[-1]["msg"]
        cluster.kill(node)
        cluster.procs.pop(node)

    # The other two keep serving: produce and consume, and their digests converge.
    asyncio.run(produce(10, "after"))
    digest = cluster.wait_converged(30, nodes=others)
    assert digest["length"] > 0

    async def consume() -> list[str]:
        async with Client([cluster.urls[i] for i in others]) as client:
            page = await client.pull(TOPIC, 0, 0, 1000)
            return [m["body"] for m in page["messages"]]

    bodies = asyncio.run(consume())
    assert [f"after-{k}" for k in range(10)] == [b for b in bodies if b.startswith("after-")]

    if damage != "commitlog":
        # What the refusal says to do: move the data directory aside and start again.
        data.rename(data.with_name("data.damaged"))
        cluster.start(node)
        cluster.wait_converged(60)
