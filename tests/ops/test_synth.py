"""Synthetic logs: valid lines only, deterministic, and telling the story they claim to."""

from __future__ import annotations

import hashlib
from collections import Counter
from pathlib import Path

import pytest

from chronomq.cluster.logs.schema import (
    EventRecord,
    LatencyRecord,
    MessageKind,
    RecordType,
    ReplicationRecord,
    Stage,
    decode,
)
from chronomq.ops.synth import SynthResult, SynthSpec, synth_logs


def records(root: Path, record_type: RecordType) -> list[object]:
    out = []
    for path in sorted(root.glob(f"*/{record_type}-*.jsonl")):
        out += [decode(line, record_type) for line in path.read_bytes().splitlines()]
    return out


def digest(root: Path) -> str:
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.jsonl")):
        h.update(path.relative_to(root).as_posix().encode() + path.read_bytes())
    return h.hexdigest()


def test_every_line_is_valid_and_counted(small_logs: tuple[Path, SynthResult]) -> None:
    root, result = small_logs
    latency = records(root, RecordType.LATENCY)
    replication = records(root, RecordType.REPLICATION)
    events = records(root, RecordType.EVENTS)
    assert len(latency) == result.latency_rows == 20_000
    assert len(replication) == result.replication_rows > 0
    assert len(events) == result.event_rows > 0
    assert sorted(p.name for p in root.iterdir()) == ["drill", "n0", "n1", "n2"]
    assert len({r.msg_id for r in latency if isinstance(r, LatencyRecord)}) == result.messages


def test_message_mix_and_stages(small_logs: tuple[Path, SynthResult]) -> None:
    latency = [
        r for r in records(small_logs[0], RecordType.LATENCY) if isinstance(r, LatencyRecord)
    ]
    stored = [r for r in latency if r.stage is Stage.STORED]
    kinds = Counter(r.kind for r in stored)
    assert 0.3 < kinds[MessageKind.PLAIN] / len(stored) < 0.5
    assert 0.3 < kinds[MessageKind.LEVEL] / len(stored) < 0.5
    assert 0.1 < kinds[MessageKind.TIMER] / len(stored) < 0.3
    delivered = [r for r in latency if r.stage is Stage.DELIVERED]
    assert delivered and all(r.kind is not MessageKind.PLAIN for r in delivered)
    late = [r.delivered_ms - r.due_ms for r in delivered]  # type: ignore[operator]
    assert sorted(late)[len(late) // 2] < 100 < max(late)


def test_replication_tells_two_failovers(small_logs: tuple[Path, SynthResult]) -> None:
    rows = [
        r
        for r in records(small_logs[0], RecordType.REPLICATION)
        if isinstance(r, ReplicationRecord)
    ]
    leaders = {(r.term, r.node) for r in rows if r.propose_ms is not None}
    assert leaders == {(1, "n0"), (2, "n1"), (3, "n2")}
    # Every node applies every command once; n0 applies what it missed while down late.
    assert set(Counter(r.index for r in rows).values()) == {3}
    commit = {r.index: r.commit_ms for r in rows if r.commit_ms is not None}
    n0_lag = [r.apply_ms - commit[r.index] for r in rows if r.node == "n0"]
    assert max(n0_lag) > 3_000 and sorted(n0_lag)[len(n0_lag) // 2] < 10
    events = [e for e in records(small_logs[0], RecordType.EVENTS) if isinstance(e, EventRecord)]
    faults = [e.detail["fault"] for e in events if e.type == "drill_fault"]
    assert faults == ["kill -9", "restart"]


def test_same_seed_same_bytes(tmp_path: Path) -> None:
    spec = SynthSpec(rows=3_000, seed=9, rotate_bytes=64 * 1024)
    a, b = synth_logs(tmp_path / "a", spec), synth_logs(tmp_path / "b", spec)
    assert a.files > 6  # rotated
    assert digest(tmp_path / "a") == digest(tmp_path / "b")
    synth_logs(tmp_path / "c", SynthSpec(rows=3_000, seed=10, rotate_bytes=64 * 1024))
    assert digest(tmp_path / "c") != digest(tmp_path / "a")
    assert b.latency_rows == 3_000
    for path in (tmp_path / "a").rglob("*.jsonl"):
        assert path.stat().st_size <= 64 * 1024


@pytest.mark.parametrize(
    "kwargs",
    [
        {"rows": 0},
        {"rows": 10, "nodes": 2},
        {"rows": 10, "rate_per_s": 0},
        {"rows": 1, "start_ms": -1},
    ],
)
def test_bad_spec_is_refused(kwargs: dict[str, int]) -> None:
    with pytest.raises(ValueError):
        SynthSpec(**kwargs)
