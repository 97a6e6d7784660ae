"""CommitLog retention: the pure decision (fake clock), head deletion in the CommitLog, the
ConsumeQueue minimum that follows it, and a store whose digest does not move."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from chronomq.raftlog.catchup_proto import Status
from chronomq.raftlog.commitlog import MIN_OFFSET_FILE, CommitLog
from chronomq.raftlog.errors import StoreCorruption
from chronomq.raftlog.retention import RetentionPolicy, SegmentInfo, Stop, plan_retention
from chronomq.raftlog.store import Store

from ._util import B, command, rec

SEG = 4096
HOUR_MS = 3_600_000
POLICY = RetentionPolicy(reserved_ms=72 * HOUR_MS, max_used_ratio=0.75, batch_max=2)


def segs(*mtimes_h: float) -> list[SegmentInfo]:
    """Segments of 100 bytes each, last written at the given hours."""
    return [SegmentInfo(i * 100, (i + 1) * 100, int(h * HOUR_MS)) for i, h in enumerate(mtimes_h)]


# ---------------------------------------------------------------------- the decision


class FakeClock:
    """Milliseconds that never go backwards."""

    def __init__(self, now_ms: int = 0) -> None:
        self.now_ms = now_ms

    def advance(self, ms: int) -> int:
        if ms < 0:
            raise ValueError("a clock never goes back")
        self.now_ms += ms
        return self.now_ms


def test_nothing_expires_before_the_reserved_time() -> None:
    clock = FakeClock(0)
    s = segs(0, 0, 0, 0)
    clock.advance(72 * HOUR_MS - 1)
    d = plan_retention(s, needed_offset=10**9, now_ms=clock.now_ms, used_ratio=0.1, policy=POLICY)
    assert d.delete == () and d.stop is Stop.NOT_EXPIRED
    clock.advance(1)
    d = plan_retention(s, needed_offset=10**9, now_ms=clock.now_ms, used_ratio=0.1, policy=POLICY)
    assert d.delete == (0, 100)  # batch_max, oldest first; the active segment never goes
    assert d.stop is Stop.BATCH and not d.pressure


def test_the_active_segment_is_never_deleted() -> None:
    d = plan_retention(
        segs(0, 0), needed_offset=10**9, now_ms=10**12, used_ratio=0.99, policy=POLICY
    )
    assert d.delete == (0,) and d.stop is Stop.ACTIVE
    d = plan_retention(segs(0), needed_offset=10**9, now_ms=10**12, used_ratio=0.99, policy=POLICY)
    assert d.delete == () and d.stop is Stop.NOTHING


def test_a_segment_holding_a_waiting_message_stops_the_walk() -> None:
    # A message 5 days out waits at offset 150 (segment [100, 200)): everything from there stays,
    # though every segment expired long ago.
    d = plan_retention(
        segs(0, 0, 0, 0), needed_offset=150, now_ms=200 * HOUR_MS, used_ratio=0.99, policy=POLICY
    )
    assert d.delete == (0,) and d.stop is Stop.NEEDED
    # Exactly at a boundary: the segment ending there may go.
    d = plan_retention(
        segs(0, 0, 0, 0), needed_offset=200, now_ms=200 * HOUR_MS, used_ratio=0.99, policy=POLICY
    )
    assert d.delete == (0, 100)


def test_only_a_prefix_goes() -> None:
    # The second segment was rewritten later (not expired): the third, older, stays too.
    d = plan_retention(
        segs(0, 100, 0, 0), needed_offset=10**9, now_ms=120 * HOUR_MS, used_ratio=0.1, policy=POLICY
    )
    assert d.delete == (0,) and d.stop is Stop.NOT_EXPIRED


def test_disk_pressure_deletes_every_expired_segment_at_once_but_never_unexpired_ones() -> None:
    s = segs(0, 0, 0, 0, 80, 0)
    d = plan_retention(s, needed_offset=10**9, now_ms=100 * HOUR_MS, used_ratio=0.80, policy=POLICY)
    assert d.pressure and d.delete == (0, 100, 200, 300) and d.stop is Stop.NOT_EXPIRED
    d = plan_retention(s, needed_offset=10**9, now_ms=100 * HOUR_MS, used_ratio=0.75, policy=POLICY)
    assert not d.pressure and d.delete == (0, 100)


def test_fractional_hours() -> None:
    policy = RetentionPolicy(reserved_ms=int(0.001 * HOUR_MS), max_used_ratio=0.75)
    d = plan_retention(segs(0, 0), needed_offset=10**9, now_ms=3_600, used_ratio=0.0, policy=policy)
    assert d.delete == (0,)
    d = plan_retention(segs(0, 0), needed_offset=10**9, now_ms=3_599, used_ratio=0.0, policy=policy)
    assert d.delete == ()


def test_policy_refuses_nonsense() -> None:
    with pytest.raises(ValueError):
        RetentionPolicy(reserved_ms=-1, max_used_ratio=0.5)
    with pytest.raises(ValueError):
        RetentionPolicy(reserved_ms=0, max_used_ratio=0.0)


# ---------------------------------------------------------------------- the CommitLog


@pytest.fixture
def cl(tmp_path: Path) -> Iterator[CommitLog]:
    commitlog = CommitLog(
        tmp_path / "cl", segment_bytes=SEG, flush="async", flush_interval_ms=60_000
    )
    yield commitlog
    commitlog.close()


def fill(cl: CommitLog, n: int, size: int = 1000) -> list[int]:
    out = []
    for i in range(n):
        r = rec("t", 0, b"x" * (size - 100), i)
        out += cl.append_records(bytearray(r), [len(r)], [i])
    return out


def test_delete_head_keeps_offsets_and_the_last_segment(cl: CommitLog) -> None:
    offsets = fill(cl, 20)
    length = cl.length
    assert len(cl.segments()) > 3
    assert cl.delete_head(2 * SEG) == 2
    assert cl.min_offset == 2 * SEG and cl.length == length
    assert cl.segments_deleted == 2
    assert (cl.directory / MIN_OFFSET_FILE).read_text().strip() == str(2 * SEG)
    with pytest.raises(IndexError):
        cl.read_message(offsets[0])
    kept = [o for o in offsets if o >= 2 * SEG]
    assert cl.read_message(kept[0]).queue_offset == offsets.index(kept[0])
    assert [o for o, _ in cl.iter_records(cl.min_offset)] == kept
    cl.delete_head(10**9)
    assert len(cl.segments()) == 1  # never the one being written


def test_reopen_after_deletion_and_an_interrupted_one(tmp_path: Path) -> None:
    d = tmp_path / "cl"
    cl = CommitLog(d, segment_bytes=SEG)
    fill(cl, 20)
    cl.delete_head(SEG)
    length = cl.length
    cl.close()
    # A deletion that recorded its new start, then stopped before unlinking a segment.
    (d / MIN_OFFSET_FILE).write_text(f"{2 * SEG}\n")
    cl = CommitLog(d, segment_bytes=SEG)
    assert cl.min_offset == 2 * SEG and cl.length == length
    assert not (d / f"{SEG:020d}").exists()
    cl.close()
    # A segment missing above the recorded start is still corruption.
    (d / f"{3 * SEG:020d}").unlink()
    with pytest.raises(StoreCorruption, match="missing"):
        CommitLog(d, segment_bytes=SEG)


def test_truncate_below_the_retained_start_is_refused_and_to_zero_starts_over(
    cl: CommitLog,
) -> None:
    fill(cl, 20)
    cl.delete_head(2 * SEG)
    with pytest.raises(StoreCorruption, match="retention"):
        cl.truncate(SEG)
    cl.truncate(2 * SEG)  # exactly the start: empty but placed
    assert cl.min_offset == cl.length == 2 * SEG
    cl.truncate(0)
    assert cl.length == 0 and cl.min_offset == 0
    assert not (cl.directory / MIN_OFFSET_FILE).exists()
    fill(cl, 2)
    assert cl.min_offset == 0


# ---------------------------------------------------------------------- the store


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = Store(tmp_path / "s", segment_bytes=SEG)
    yield s
    s.close()


def produce(s: Store, count: int, first: int = 0) -> None:
    for i in range(first, first + count):
        s.apply(
            command([B(f"k{i}", [("t", 0, b"y" * 900, i)], creates={"t": 1} if i == 0 else None)]),
            s.applied_index + 1,
        )


def test_digest_and_max_offsets_do_not_move_and_pulls_start_at_the_new_minimum(
    store: Store,
) -> None:
    produce(store, 30)
    before = store.digest()
    assert store.min_offset("t", 0) == 0
    store.commitlog.delete_head(3 * SEG)
    assert store.digest() == before
    low = store.min_offset("t", 0)
    assert low > 0
    assert store.read_units("t", 0, low - 1, 1)[0].commitlog_offset < store.commitlog.min_offset
    assert store.read_units("t", 0, low, 1)[0].commitlog_offset >= store.commitlog.min_offset
    got = store.read_messages("t", 0, 0, 5)
    assert [m.queue_offset for m in got] == list(range(low, low + 5))
    assert store.max_offset("t", 0) == 30
    # Writing goes on, and the minimum stays put (cached) until the next deletion.
    produce(store, 10, 30)
    assert store.min_offset("t", 0) == low
    store.commitlog.delete_head(5 * SEG)
    assert store.min_offset("t", 0) > low


def test_a_repeated_key_whose_placement_was_deleted_is_still_a_duplicate(store: Store) -> None:
    produce(store, 30)
    store.commitlog.delete_head(3 * SEG)
    again = store.apply(command([B("k0", [("t", 0, b"z", 999)])]), store.applied_index + 1)
    assert again.outcomes[0].duplicate and again.bytes_written == 0


def test_catchup_has_a_status_for_deleted_bytes() -> None:
    assert Status.GONE.value == 3
