"""Handle-cache eviction (no fsync under flush=async, EMFILE evicts and retries) and the
topic and queue limits at apply (same outcome on every replica)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from chronomq.raftlog.consumequeue import UNIT, ConsumeQueueStore
from chronomq.raftlog.store import OK, REJECTED, TOO_MANY_TOPICS, Store, TopicLimits

from ._util import B, command


def _fill(cqs: ConsumeQueueStore, queues: int) -> None:
    for q in range(queues):
        cqs.append("t", q, 0, UNIT.pack(q, 10, 0))


def _count_fsyncs(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        calls.append(fd)
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return calls


def test_eviction_never_fsyncs_under_async(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cqs = ConsumeQueueStore(tmp_path, max_open_files=4, flush="async")
    fsyncs = _count_fsyncs(monkeypatch)
    _fill(cqs, 40)
    assert cqs.evictions == 36
    assert cqs.open_files == 4
    assert fsyncs == []
    # Evicted queues read back from their files.
    assert [cqs.read("t", q, 0, 1)[0].commitlog_offset for q in range(40)] == list(range(40))
    cqs.close()
    assert len(fsyncs) <= 4  # close syncs only what it holds open


def test_eviction_syncs_a_dirty_handle_under_sync(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cqs = ConsumeQueueStore(tmp_path, max_open_files=4, flush="sync")
    fsyncs = _count_fsyncs(monkeypatch)
    _fill(cqs, 8)
    assert len(fsyncs) == 4
    cqs.close()


def test_cache_never_holds_more_than_its_budget(tmp_path: Path) -> None:
    cqs = ConsumeQueueStore(tmp_path, max_open_files=3)
    for q in range(10):
        cqs.append("t", q, 0, UNIT.pack(q, 10, 0))
        assert cqs.open_files <= 3
    cqs.close()


def test_emfile_on_open_evicts_and_retries(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cqs = ConsumeQueueStore(tmp_path, max_open_files=100)
    _fill(cqs, 8)
    real_open = os.open
    failures = [1]

    def open_(path: str, flags: int, mode: int = 0o777) -> int:
        if failures:
            failures.pop()
            raise OSError(errno.EMFILE, "Too many open files")
        return real_open(path, flags, mode)

    monkeypatch.setattr(os, "open", open_)
    cqs.append("t", 8, 0, UNIT.pack(8, 10, 0))  # no exception: evicted, then opened
    assert cqs.emfile_retries == 1
    assert cqs.open_files == 8 - 2 + 1  # a quarter of 8 evicted, the new one added
    assert cqs.max_offset("t", 8) == 1
    cqs.close()


def test_emfile_with_nothing_to_evict_is_raised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cqs = ConsumeQueueStore(tmp_path, max_open_files=100)

    def open_(path: str, flags: int, mode: int = 0o777) -> int:
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr(os, "open", open_)
    with pytest.raises(OSError):
        cqs.append("t", 0, 0, UNIT.pack(0, 10, 0))


# ---------------------------------------------------------------- topic limits at apply


def _apply_all(store: Store, commands: list[bytes]) -> list[tuple[int, str]]:
    outcomes = []
    for i, data in enumerate(commands, start=1):
        res = store.apply(data, i)
        outcomes += [(o.status, o.detail or "") for o in res.outcomes]
    return outcomes


def _creating(n: int, queues: int = 4) -> list[bytes]:
    return [
        command([B(f"k{i}", [(f"t{i}", 0, b"x", i)], creates={f"t{i}": queues})]) for i in range(n)
    ]


def test_max_topics_at_apply_is_the_same_on_two_stores(tmp_path: Path) -> None:
    limits = TopicLimits(max_topics=3, max_queues=1000)
    a = Store(tmp_path / "a", segment_bytes=4096, topic_limits=limits)
    b = Store(tmp_path / "b", segment_bytes=4096, topic_limits=limits)
    commands = _creating(5)
    # A message to an existing topic is never refused by the limit.
    commands.append(command([B("again", [("t0", 1, b"y", 99)], creates={"t0": 4})]))
    out_a = _apply_all(a, commands)
    out_b = _apply_all(b, commands)
    assert out_a == out_b
    assert [s for s, _ in out_a] == [OK, OK, OK, REJECTED, REJECTED, OK]
    assert out_a[3][1].startswith(TOO_MANY_TOPICS) and "t3" in out_a[3][1]
    assert sorted(a.topics) == sorted(b.topics) == ["t0", "t1", "t2"]
    assert a.chain == b.chain
    a.close()
    b.close()


def test_max_queues_at_apply(tmp_path: Path) -> None:
    store = Store(tmp_path, segment_bytes=4096, topic_limits=TopicLimits(100, max_queues=10))
    out = _apply_all(store, _creating(3))
    assert [s for s, _ in out] == [OK, OK, REJECTED]
    assert "max_queues 10" in out[2][1]
    store.close()


def test_topic_limits_refusal() -> None:
    limits = TopicLimits(max_topics=2, max_queues=8)
    assert limits.refusal(1, 4, {}) is None
    assert limits.refusal(1, 4, {"x": 4}) is None
    assert "max_topics 2" in (limits.refusal(2, 4, {"x": 1}) or "")
    assert "max_queues 8" in (limits.refusal(1, 4, {"x": 5}) or "")
