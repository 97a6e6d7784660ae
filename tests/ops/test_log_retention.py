"""Ops log retention: rotated files older than retention_ms, or past max_total_bytes, go
oldest first; the file being written never does. A fake wall clock, no sleeps."""

from __future__ import annotations

import os
from pathlib import Path

from chronomq.cluster.logs.writer import LogWriter, LogWriterConfig, prune

HOUR_MS = 3_600_000
NOW_MS = 1_800_000_000_000


def _file(directory: Path, name: str, size: int, age_ms: int) -> Path:
    path = directory / name
    path.write_bytes(b"x" * size)
    mtime_s = (NOW_MS - age_ms) / 1000
    os.utime(path, (mtime_s, mtime_s))
    return path


def _names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def test_old_rotated_files_go_and_current_ones_stay(tmp_path: Path) -> None:
    _file(tmp_path, "latency-000001.jsonl", 10, 5 * HOUR_MS)
    _file(tmp_path, "latency-000002.jsonl", 10, 3 * HOUR_MS)
    _file(tmp_path, "latency-000003.jsonl", 10, 1 * HOUR_MS)
    _file(tmp_path, "event-000001.jsonl", 10, 9 * HOUR_MS)  # old, but being written
    _file(tmp_path, "notes.txt", 10, 9 * HOUR_MS)  # not a log file
    deleted = prune(tmp_path, NOW_MS, retention_ms=2 * HOUR_MS, max_total_bytes=0)
    assert sorted(p.name for p in deleted) == ["latency-000001.jsonl", "latency-000002.jsonl"]
    assert _names(tmp_path) == ["event-000001.jsonl", "latency-000003.jsonl", "notes.txt"]


def test_size_bound_deletes_oldest_first(tmp_path: Path) -> None:
    _file(tmp_path, "replication-000001.jsonl", 100, 4 * HOUR_MS)
    _file(tmp_path, "latency-000001.jsonl", 100, 3 * HOUR_MS)
    _file(tmp_path, "replication-000002.jsonl", 100, 2 * HOUR_MS)
    _file(tmp_path, "latency-000002.jsonl", 100, 1 * HOUR_MS)
    _file(tmp_path, "replication-000003.jsonl", 100, 0)
    deleted = prune(tmp_path, NOW_MS, retention_ms=0, max_total_bytes=250)
    assert [p.name for p in deleted] == [
        "replication-000001.jsonl",
        "latency-000001.jsonl",
        "replication-000002.jsonl",
    ]
    assert _names(tmp_path) == ["latency-000002.jsonl", "replication-000003.jsonl"]


def test_nothing_goes_with_both_bounds_off(tmp_path: Path) -> None:
    _file(tmp_path, "latency-000001.jsonl", 100, 100 * HOUR_MS)
    _file(tmp_path, "latency-000002.jsonl", 100, 0)
    assert prune(tmp_path, NOW_MS, retention_ms=0, max_total_bytes=0) == []


def test_writer_prunes_on_its_wall_clock(tmp_path: Path) -> None:
    clock = [NOW_MS]
    config = LogWriterConfig(retention_ms=HOUR_MS, prune_interval_ms=60_000)
    writer = LogWriter(tmp_path, "node-0", config, wall_ms=lambda: clock[0])
    node_dir = tmp_path / "node-0"
    node_dir.mkdir()
    _file(node_dir, "latency-000001.jsonl", 10, 2 * HOUR_MS)
    _file(node_dir, "latency-000002.jsonl", 10, 0)
    assert [p.name for p in writer.prune_old_files()] == ["latency-000001.jsonl"]
    _file(node_dir, "latency-000003.jsonl", 10, 0)
    os.utime(node_dir / "latency-000002.jsonl", ((NOW_MS - 2 * HOUR_MS) / 1000,) * 2)
    clock[0] += 30_000  # inside the interval: not looked at again yet
    assert writer.prune_old_files() == []
    clock[0] += 30_000
    assert [p.name for p in writer.prune_old_files()] == ["latency-000002.jsonl"]
    assert writer.files_deleted == 2
