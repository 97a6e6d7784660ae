"""A single-node RaftLog on loopback: leadership, appends, idempotent retries, restarts."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from chronomq.raftlog.config import RaftConfig
from chronomq.raftlog.errors import InvalidInput, MessageTooLarge, UnknownQueue
from chronomq.raftlog.node import NewMessage, RaftLog
from chronomq.raftlog.store import OK, Store

from ._util import free_port, wait_until

TIMEOUT_S = 20.0

pytestmark = pytest.mark.timeout(120)


def config(data_dir: Path, **over: Any) -> RaftConfig:
    fields: dict[str, Any] = {
        "data_dir": str(data_dir),
        "raft_address": f"127.0.0.1:{free_port()}",
        "fetch_address": f"127.0.0.1:{free_port()}",
        "commitlog_segment_bytes": 64 * 1024,
        "raft_min_timeout_ms": 100,
        "raft_max_timeout_ms": 200,
        "append_entries_period_ms": 20,
        "commit_timeout_ms": 10_000,
    }
    fields.update(over)
    return RaftConfig(**fields)


class Nodes:
    """Starts RaftLogs and closes whatever is still open at the end."""

    def __init__(self) -> None:
        self.open: list[RaftLog] = []

    def start(self, cfg: RaftConfig) -> RaftLog:
        node = RaftLog(cfg)
        self.open.append(node)
        assert node.wait_leader(TIMEOUT_S), "no leader"
        return node

    def stop(self, node: RaftLog) -> None:
        self.open.remove(node)
        node.close()
        # Nothing may touch the store after close: the Raft thread is gone.
        assert not node.machine.tick_thread_alive()


@pytest.fixture
def nodes() -> Iterator[Nodes]:
    n = Nodes()
    yield n
    for node in list(n.open):
        n.stop(node)


def produce(node: RaftLog, batches: int, per_batch: int = 3, topic: str = "orders") -> list[Any]:
    futures = [
        node.append(
            [
                NewMessage(topic, f"b{b}m{m}".encode(), properties={"TAGS": f"tag{m}"})
                for m in range(per_batch)
            ],
            key=f"{topic}-{b}",
        )
        for b in range(batches)
    ]
    return [f.result(TIMEOUT_S) for f in futures]


def length(node: RaftLog) -> int:
    value = node.digest()["length"]
    assert isinstance(value, int)
    return value


def read_all(node: RaftLog, topic: str = "orders") -> dict[int, list[bytes]]:
    count = node.store.queue_count(topic) or 0
    return {q: [m.body for m in node.read(topic, q, 0, 100_000)] for q in range(count)}


def test_append_read_and_idempotent_retry(nodes: Nodes, tmp_path: Path) -> None:
    node = nodes.start(config(tmp_path))
    assert node.is_leader
    outcomes = produce(node, 10)
    placed = [p for o in outcomes for p in o.placed]
    assert all(o.status == OK and not o.duplicate for o in outcomes)
    assert len(placed) == 30
    assert len({p.msg_id for p in placed}) == 30
    queues = read_all(node)
    assert sum(len(v) for v in queues.values()) == 30
    for p in placed:
        [msg] = node.read(p.topic, p.queue_id, p.queue_offset, 1)
        assert msg.msg_id == p.msg_id
        assert msg.physical_offset == p.physical_offset
    # A retry with the same key is not stored again and answers with the first placement.
    before = length(node)
    retry = node.append([NewMessage("orders", b"again")], key="orders-3").result(TIMEOUT_S)
    assert retry.duplicate
    assert retry.placed == outcomes[3].placed
    assert length(node) == before
    assert read_all(node) == queues


def test_bad_input_is_refused_before_anything_is_proposed(nodes: Nodes, tmp_path: Path) -> None:
    node = nodes.start(config(tmp_path, max_message_bytes=1000))
    node.create_topic("fixed", 2).result(TIMEOUT_S)
    before = length(node)
    with pytest.raises(MessageTooLarge) as too_large:
        node.append([NewMessage("t", b"ok"), NewMessage("t", b"x" * 1001)])
    assert too_large.value.field == "messages[1].body"
    with pytest.raises(InvalidInput) as bad_topic:
        node.append([NewMessage("bad topic", b"x")])
    assert bad_topic.value.field == "messages[0].topic"
    with pytest.raises(InvalidInput) as bad_props:
        node.append([NewMessage("t", b"x", properties={"a\x01": "b"})])
    assert bad_props.value.field == "messages[0].properties"
    with pytest.raises(UnknownQueue):
        node.append([NewMessage("fixed", b"x", queue_id=2)])
    assert length(node) == before


def test_a_message_larger_than_a_segment_is_refused(nodes: Nodes, tmp_path: Path) -> None:
    node = nodes.start(config(tmp_path, max_message_bytes=1024 * 1024))
    with pytest.raises(MessageTooLarge):
        node.append([NewMessage("t", b"x" * (64 * 1024))])
    out = node.append([NewMessage("t", b"x" * (60 * 1024))]).result(TIMEOUT_S)
    assert out.status == OK


def test_state_updates_and_conditions(nodes: Nodes, tmp_path: Path) -> None:
    node = nodes.start(config(tmp_path))
    node.update({"offset": 1}).result(TIMEOUT_S)
    node.update({"offset": 2}, expect={"offset": 1}).result(TIMEOUT_S)
    with pytest.raises(Exception, match="expected"):
        node.update({"offset": 9}, expect={"offset": 1}).result(TIMEOUT_S)
    assert node.store.kv == {"offset": 2}


def test_restart_replays_without_applying_twice(nodes: Nodes, tmp_path: Path) -> None:
    cfg = config(tmp_path)
    node = nodes.start(cfg)
    produce(node, 12)
    digest = node.digest()
    length_before = length(node)
    queues = read_all(node)
    nodes.stop(node)

    again = nodes.start(cfg)
    wait_until(lambda: length(again) >= length_before, TIMEOUT_S, "the journal to replay")
    assert again.digest()["length"] == digest["length"]
    assert again.digest()["chain"] == digest["chain"]
    assert read_all(again) == queues
    # A retry after the restart is still recognised.
    retry = again.append([NewMessage("orders", b"x")], key="orders-0").result(TIMEOUT_S)
    assert retry.duplicate
    assert again.digest()["length"] == digest["length"]
    produce(again, 2, topic="more")
    assert length(again) > length_before


def test_restart_from_a_snapshot(nodes: Nodes, tmp_path: Path) -> None:
    cfg = config(tmp_path, log_compaction_min_entries=10, log_compaction_min_time_s=3600)
    node = nodes.start(cfg)
    for round_ in range(60):
        node.append([NewMessage("orders", f"r{round_}".encode())], key=f"k{round_}").result(
            TIMEOUT_S
        )
    snapshot = tmp_path / "raft" / "snapshot"
    wait_until(snapshot.exists, TIMEOUT_S, "a snapshot")
    snap = Store.parse_snapshot(snapshot.read_bytes())
    digest = node.digest()  # read second: barriers keep adding entries (and snapshots)
    length_before = length(node)
    assert 10 <= int(snap["index"]) <= node.store.applied_index
    queues = read_all(node)
    assert sum(len(v) for v in queues.values()) == 60
    nodes.stop(node)

    again = nodes.start(cfg)
    wait_until(lambda: length(again) >= length_before, TIMEOUT_S, "the journal to replay")
    assert again.digest()["length"] == digest["length"]
    assert again.digest()["chain"] == digest["chain"]
    assert read_all(again) == queues
    retry = again.append([NewMessage("orders", b"x")], key="k0").result(TIMEOUT_S)
    assert retry.duplicate
    assert again.digest()["length"] == digest["length"]
