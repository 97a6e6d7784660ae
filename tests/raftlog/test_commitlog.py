"""CommitLog segments: placement, blanks, reopen, torn tails, truncation and reads."""

from __future__ import annotations

import os
import random
import struct
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from chronomq.raftlog import durable, record
from chronomq.raftlog.commitlog import CommitLog
from chronomq.raftlog.errors import StoreCorruption

from ._fsync import Faults
from ._util import rec, segment_files

SEG = 4096


@pytest.fixture
def log_dir(tmp_path: Path) -> Path:
    return tmp_path / "commitlog"


@pytest.fixture
def cl(log_dir: Path) -> Iterator[CommitLog]:
    commitlog = CommitLog(log_dir, segment_bytes=SEG, flush="async", flush_interval_ms=60_000)
    yield commitlog
    commitlog.close()


def append(cl: CommitLog, recs: Sequence[bytes], first_qoff: int = 0) -> list[int]:
    blob = bytearray(b"".join(recs))
    return cl.append_records(
        blob, [len(r) for r in recs], list(range(first_qoff, first_qoff + len(recs)))
    )


def body_of(size: int) -> bytes:
    """A body that makes a record of exactly ``size`` bytes on topic "t"."""
    return b"b" * (size - record.HEADER_SIZE - 1)


def check_layout(cl: CommitLog) -> None:
    """Space left in the last segment is 0 or room for a blank; earlier segments are full."""
    left = (SEG - cl.length % SEG) % SEG
    assert left == 0 or left >= record.BLANK_SIZE, left
    files = segment_files(cl.directory)
    for path in files[:-1]:
        assert path.stat().st_size == SEG
    if files:
        assert int(files[-1].name) + files[-1].stat().st_size == cl.length


# ---------------------------------------------------------------------- append and read


def test_empty_log(cl: CommitLog) -> None:
    assert cl.length == 0
    assert cl.min_offset == 0
    assert list(cl.iter_records(0)) == []
    with pytest.raises(IndexError):
        cl.read(0, 1)


def test_append_and_read(cl: CommitLog) -> None:
    recs = [rec("t", 0, b"first", 1), rec("t", 0, b"second", 2), rec("u", 1, b"3rd", 3)]
    offsets = append(cl, recs, first_qoff=10)
    assert offsets == [0, len(recs[0]), len(recs[0]) + len(recs[1])]
    assert cl.length == sum(len(r) for r in recs)
    for i, (at, data) in enumerate(zip(offsets, recs, strict=True)):
        msg = cl.read_message(at)
        assert msg.body == record.decode(data).body
        assert msg.physical_offset == at
        assert msg.queue_offset == 10 + i
        assert cl.read_message(at, len(data)) == msg
    assert cl.read(offsets[1], 4) == struct.pack(">I", len(recs[1]))


def test_append_seals_the_callers_blob(cl: CommitLog) -> None:
    recs = [rec("t", 0, b"a", 1), rec("t", 0, b"b", 2)]
    blob = bytearray(b"".join(recs))
    cl.append_records(blob, [len(r) for r in recs], [4, 5])
    assert cl.read(0, len(blob)) == bytes(blob)
    assert record.decode(blob, len(recs[0])).queue_offset == 5


def test_reads_outside_the_log(cl: CommitLog) -> None:
    append(cl, [rec("t", 0, b"x" * 10)])
    with pytest.raises(IndexError):
        cl.read(cl.length, 1)
    with pytest.raises(IndexError):
        cl.read(0, cl.length + 1)


def test_write_raw_only_at_the_end(cl: CommitLog) -> None:
    append(cl, [rec("t", 0, b"x")])
    with pytest.raises(StoreCorruption):
        cl.write_raw(0, b"zz")
    with pytest.raises(StoreCorruption):
        cl.write_raw(cl.length + 1, b"zz")


def test_bad_settings(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="segment_bytes"):
        CommitLog(tmp_path / "a", segment_bytes=1024)
    with pytest.raises(ValueError, match="flush"):
        CommitLog(tmp_path / "b", segment_bytes=SEG, flush="sometimes")


# ---------------------------------------------------------------------- segments and blanks


def test_records_never_span_segments(cl: CommitLog) -> None:
    seed = 20240601
    rng = random.Random(seed)
    placed: list[tuple[int, int]] = []
    n = 0
    for _ in range(120):
        recs = []
        for _ in range(rng.randint(1, 5)):
            n += 1
            recs.append(rec("t", 0, b"x" * rng.randint(0, 1500), n))
        offsets = append(cl, recs, first_qoff=n)
        placed += [(at, len(r)) for at, r in zip(offsets, recs, strict=True)]
        check_layout(cl)
    assert cl.length > 10 * SEG, f"seed {seed}"
    for at, size in placed:
        assert at // SEG == (at + size - 1) // SEG, f"record at {at} spans segments (seed {seed})"
    assert [(at, len(data)) for at, data in cl.iter_records(0)] == placed


def test_blank_fills_the_end_of_a_segment(cl: CommitLog) -> None:
    first = rec("t", 0, body_of(3000))
    second = rec("t", 0, body_of(2000))
    offsets = append(cl, [first, second])
    assert offsets == [0, SEG]
    assert record.peek(cl.read(3000, 8)) == (SEG - 3000, record.BLANK_MAGIC)
    assert record.check(cl.read(3000, SEG - 3000)) == SEG - 3000
    assert [at for at, _ in cl.iter_records(0)] == [0, SEG]
    check_layout(cl)


def test_a_record_that_would_leave_less_than_a_blank_goes_to_the_next_segment(
    cl: CommitLog,
) -> None:
    append(cl, [rec("t", 0, body_of(3000))])
    # 1090 bytes fit the 1096 left but would leave 6, too few for a blank.
    offsets, blanks = cl.layout([1090])
    assert offsets == [SEG]
    assert blanks == [(3000, 1096)]
    # 1096 fills the segment exactly; 1088 leaves exactly a blank's room.
    assert cl.layout([1096]) == ([3000], [])
    assert cl.layout([1088]) == ([3000], [])
    assert cl.length == 3000  # layout is pure


def test_layout_rejects_records_that_cannot_be_placed(cl: CommitLog) -> None:
    with pytest.raises(ValueError):
        cl.layout([SEG + 1])
    for size in range(SEG - record.BLANK_SIZE + 1, SEG):
        with pytest.raises(ValueError):
            cl.layout([size])
    assert cl.layout([SEG - record.BLANK_SIZE]) == ([0], [])
    assert cl.layout([SEG]) == ([0], [])


def test_a_record_filling_a_whole_segment(cl: CommitLog) -> None:
    small = rec("t", 0, b"s")
    whole = rec("t", 0, body_of(SEG))
    offsets = append(cl, [small, whole, small])
    assert offsets == [0, SEG, 2 * SEG]
    check_layout(cl)
    assert [at for at, _ in cl.iter_records(0)] == offsets
    assert len(segment_files(cl.directory)) == 3


def test_many_blanks_in_one_append(cl: CommitLog) -> None:
    recs = [rec("t", 0, body_of(2500), i) for i in range(6)]
    offsets = append(cl, recs)
    assert offsets == [i * SEG for i in range(6)]
    assert [record.decode(d).msg_id for _, d in cl.iter_records(0)] == [
        record.decode(r).msg_id for r in recs
    ]


# ---------------------------------------------------------------------- reopen and recovery


def _fill(cl: CommitLog, count: int = 40) -> list[int]:
    offsets: list[int] = []
    for i in range(count):
        offsets += append(cl, [rec("t", i % 2, b"m" * (100 + 37 * i), i)], first_qoff=i)
    return offsets


def test_reopen_finds_the_same_length(log_dir: Path) -> None:
    cl = CommitLog(log_dir, segment_bytes=SEG, flush="async")
    offsets = _fill(cl)
    length = cl.length
    cl.close()
    again = CommitLog(log_dir, segment_bytes=SEG, flush="async")
    try:
        assert again.length == length
        assert [at for at, _ in again.iter_records(0)] == offsets
        assert again.recover() == length
        more = append(again, [rec("t", 0, b"after")])
        assert more[0] >= length
    finally:
        again.close()


@pytest.mark.parametrize(
    "garbage",
    [
        b"\x00" * 50,  # zeros where a record should be
        b"\xff" * 3,  # less than a blank header
        "partial",  # the first part of a real record
        "bad-crc",  # a whole record with a flipped byte
    ],
)
def test_torn_tail_is_truncated_by_recover(log_dir: Path, garbage: bytes | str) -> None:
    cl = CommitLog(log_dir, segment_bytes=SEG, flush="async", flush_interval_ms=60_000)
    offsets = _fill(cl, 10)
    good = cl.length
    if garbage == "partial":
        data = rec("t", 0, b"torn" * 50)[:120]
    elif garbage == "bad-crc":
        whole = bytearray(rec("t", 0, b"flip"))
        whole[-1] ^= 1
        data = bytes(whole)
    else:
        assert isinstance(garbage, bytes)
        data = garbage
    cl.write_raw(good, data)
    cl.close()
    cl = CommitLog(log_dir, segment_bytes=SEG, flush="async", flush_interval_ms=60_000)
    try:
        assert cl.length == good + len(data)
        assert cl.recover() == good
        assert cl.length == good
        assert [at for at, _ in cl.iter_records(0)] == offsets
        append(cl, [rec("t", 0, b"new")])
        assert [at for at, _ in cl.iter_records(0)] == [*offsets, good]
    finally:
        cl.close()


def test_torn_tail_in_a_new_segment_removes_the_segment(log_dir: Path) -> None:
    cl = CommitLog(log_dir, segment_bytes=SEG, flush="async", flush_interval_ms=60_000)
    append(cl, [rec("t", 0, body_of(SEG))])
    assert cl.length == SEG
    cl.write_raw(SEG, b"\x01\x02\x03\x04garbage")
    assert len(segment_files(log_dir)) == 2
    assert cl.recover() == SEG
    assert len(segment_files(log_dir)) == 1
    cl.close()


def test_recover_from_a_point(cl: CommitLog) -> None:
    offsets = _fill(cl, 20)
    assert cl.recover(offsets[10]) == cl.length


def test_segments_after_a_partial_one_are_removed_on_open(log_dir: Path) -> None:
    cl = CommitLog(log_dir, segment_bytes=SEG, flush="async", flush_interval_ms=60_000)
    append(cl, [rec("t", 0, b"x")])
    cl.close()
    stray = log_dir / f"{SEG:020d}"
    stray.write_bytes(b"left over")
    cl = CommitLog(log_dir, segment_bytes=SEG, flush="async", flush_interval_ms=60_000)
    try:
        assert not stray.exists()
        assert cl.length == len(rec("t", 0, b"x"))
    finally:
        cl.close()


def test_missing_middle_segment_is_corruption(log_dir: Path) -> None:
    cl = CommitLog(log_dir, segment_bytes=SEG, flush="async", flush_interval_ms=60_000)
    _fill(cl, 60)
    assert len(segment_files(log_dir)) >= 3
    cl.close()
    segment_files(log_dir)[1].unlink()
    with pytest.raises(StoreCorruption, match="missing"):
        CommitLog(log_dir, segment_bytes=SEG, flush="async", flush_interval_ms=60_000)


@pytest.mark.parametrize("new_segment_bytes", [SEG, 3 * SEG, 4 * SEG])
def test_changed_segment_bytes_is_corruption_and_deletes_nothing(
    log_dir: Path, new_segment_bytes: int
) -> None:
    cl = CommitLog(log_dir, segment_bytes=2 * SEG, flush="async", flush_interval_ms=60_000)
    _fill(cl, 80)
    length = cl.length
    cl.close()
    before = [p.name for p in segment_files(log_dir)]
    assert len(before) >= 3
    with pytest.raises(StoreCorruption):
        CommitLog(log_dir, segment_bytes=new_segment_bytes, flush="async", flush_interval_ms=60_000)
    assert [p.name for p in segment_files(log_dir)] == before
    cl = CommitLog(log_dir, segment_bytes=2 * SEG, flush="async", flush_interval_ms=60_000)
    assert cl.length == length
    cl.close()


# ---------------------------------------------------------------------- truncation


def test_truncate_across_segments(cl: CommitLog) -> None:
    offsets = _fill(cl, 60)
    n_files = len(segment_files(cl.directory))
    assert n_files >= 3
    cut = offsets[5]
    assert cut < SEG
    cl.truncate(cut)
    assert cl.length == cut
    assert len(segment_files(cl.directory)) == 1
    assert [at for at, _ in cl.iter_records(0)] == offsets[:5]
    with pytest.raises(ValueError):
        cl.truncate(cut + 1)
    # The log grows again over the removed segments.
    _fill(cl, 60)
    check_layout(cl)


def test_truncate_to_a_segment_boundary(cl: CommitLog) -> None:
    _fill(cl, 60)
    cl.truncate(SEG)
    assert cl.length == SEG
    assert [int(p.name) for p in segment_files(cl.directory)] == [0]
    append(cl, [rec("t", 0, b"y")])
    assert [int(p.name) for p in segment_files(cl.directory)] == [0, SEG]


def test_truncate_to_zero(cl: CommitLog) -> None:
    _fill(cl, 60)
    cl.truncate(0)
    assert cl.length == 0
    assert list(cl.iter_records(0)) == []
    assert append(cl, [rec("t", 0, b"z")]) == [0]


def test_truncate_survives_reopen(log_dir: Path) -> None:
    cl = CommitLog(log_dir, segment_bytes=SEG, flush="async")
    offsets = _fill(cl, 60)
    cl.truncate(offsets[30])
    cl.close()
    cl = CommitLog(log_dir, segment_bytes=SEG, flush="async")
    try:
        assert cl.length == offsets[30]
    finally:
        cl.close()


# ---------------------------------------------------------------------- iteration and ranges


def test_iter_records_skips_blanks_and_reads_in_chunks(cl: CommitLog) -> None:
    offsets = _fill(cl, 60)
    every = [(at, bytes(data)) for at, data in cl.iter_records(0)]
    assert [at for at, _ in every] == offsets
    for chunk in (8, 97, 500, 5000):
        assert [(at, bytes(d)) for at, d in cl.iter_records(0, chunk_bytes=chunk)] == every
    assert [at for at, _ in cl.iter_records(offsets[10], offsets[20])] == offsets[10:20]
    assert all(record.decode(d).physical_offset == at for at, d in every)


@pytest.mark.timeout(10)
def test_iter_records_with_a_corrupt_size_raises(cl: CommitLog) -> None:
    offsets = _fill(cl, 5)
    seg_path = segment_files(cl.directory)[0]
    fd = os.open(seg_path, os.O_WRONLY)
    try:
        os.pwrite(fd, struct.pack(">I", 900_000), offsets[2])
    finally:
        os.close(fd)
    for chunk in (64, 4 << 20):
        with pytest.raises(StoreCorruption):
            list(cl.iter_records(0, chunk_bytes=chunk))
    assert cl.recover() == offsets[2]


def test_iter_records_with_a_flipped_byte_raises(cl: CommitLog) -> None:
    offsets = _fill(cl, 5)
    data = bytearray(cl.read(offsets[3], 40))
    fd = os.open(segment_files(cl.directory)[0], os.O_WRONLY)
    try:
        os.pwrite(fd, bytes([data[30] ^ 0xFF]), offsets[3] + 30)
    finally:
        os.close(fd)
    with pytest.raises(StoreCorruption):
        list(cl.iter_records(0))


def test_ranges_cover_exactly(cl: CommitLog) -> None:
    _fill(cl, 60)
    full = b"".join(p.read_bytes() for p in segment_files(cl.directory))
    assert len(full) == cl.length
    for start, end in [(0, cl.length), (100, 5000), (SEG - 1, SEG + 1), (SEG, 2 * SEG), (7, 7)]:
        pieces = list(cl.ranges(start, end))
        got = b"".join(os.pread(fd, n, off) for fd, off, n in pieces)
        assert got == full[start:end]
        assert all(0 < n <= SEG and off + n <= SEG for _, off, n in pieces)
    assert len(list(cl.ranges(SEG - 1, SEG + 1))) == 2
    assert len(list(cl.ranges(10, 20))) == 1


# ---------------------------------------------------------------------- durability


def test_sync_flush_fsyncs_every_append(log_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real_fsync = os.fsync

    def counting_fsync(fd: int) -> None:
        calls.append(fd)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", counting_fsync)
    cl = CommitLog(log_dir, segment_bytes=SEG, flush="sync")
    try:
        for i in range(5):
            before = len(calls)
            append(cl, [rec("t", 0, b"s" * 200, i)], first_qoff=i)
            assert len(calls) > before
            assert not cl._dirty
        assert cl.flush_mode == "sync"
    finally:
        cl.close()


def test_async_flush_syncs_on_close(log_dir: Path) -> None:
    cl = CommitLog(log_dir, segment_bytes=SEG, flush="async", flush_interval_ms=60_000)
    append(cl, [rec("t", 0, b"a")])
    assert cl._dirty
    cl.close()
    assert not cl._dirty
    cl.close()  # twice is harmless


# ---------------------------------------------------------------------- power cuts


def test_a_new_segment_s_name_is_synced_before_the_write_returns(log_dir: Path, spy: Any) -> None:
    """A segment created just before a power cut: its directory entry is durable as soon as
    the segment exists, so a sync of its bytes (before a snapshot, or by the flusher) is
    never a sync of a file that the directory then forgets."""
    cl = CommitLog(log_dir, segment_bytes=SEG, flush="sync")
    try:
        spy.calls.clear()
        append(cl, [rec("t", 0, body_of(1000), i) for i in range(6)])  # rolls into segment 2
        names = [p.name for p in segment_files(log_dir)]
        assert len(names) == 2
        paths = spy.paths()
        # The directory is synced after each creation, before that segment's bytes are.
        for created, name in enumerate(names, start=1):
            before = paths[: paths.index(str(log_dir / name))]
            assert before.count(str(log_dir)) == created
    finally:
        cl.close()


def test_a_failed_background_fsync_is_fatal_and_never_forgotten(log_dir: Path, spy: Any) -> None:
    """The flusher used to log a failed fsync and carry on; a later fsync could then succeed
    without the dropped pages (fsyncgate). Now it calls the fault handler, and every later
    sync fails as well."""
    faults = Faults()
    cl = CommitLog(log_dir, segment_bytes=SEG, flush="async", flush_interval_ms=5, on_fault=faults)
    spy.fail = lambda path: path.startswith(str(log_dir / "0"))
    append(cl, [rec("t", 0, b"x", 0)])
    deadline = time.monotonic() + 10
    while not faults.messages and time.monotonic() < deadline:
        time.sleep(0.005)
    assert faults.messages and "fsync of the CommitLog in" in faults.messages[0]
    spy.fail = lambda path: False
    with pytest.raises(durable.StorageFault):
        cl.sync()
    with pytest.raises(durable.StorageFault):
        cl.close()
