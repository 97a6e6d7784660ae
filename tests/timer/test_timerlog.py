from __future__ import annotations

import os
import zlib
from pathlib import Path

import pytest

from chronomq.timer.errors import (
    BadMagic,
    ChainBroken,
    ChecksumMismatch,
    TimerConfigMismatch,
    TimerCorruptionError,
    TimerStateError,
)
from chronomq.timer.timerlog import (
    NO_POS,
    RECORD_SIZE,
    RecordFlags,
    TimerLog,
    TimerRecord,
    decode_record,
    encode_record,
    topic_hash,
    uniq_key_hash,
)

SEG = 4096  # 51 records of 80 bytes, 16 bytes left unused at the end of each segment
PER_SEG = SEG // RECORD_SIZE

RECORD = TimerRecord(
    prev_pos=160,
    flags=RecordFlags.TOMBSTONE,
    write_ms=1_700_000_000_000,
    deliver_ms=1_700_000_060_050,
    slot_ms=1_700_000_060_000,
    cl_offset=4096,
    cl_size=321,
    topic_hash=0xDEADBEEF,
    key_hash=0x0123456789ABCDEF,
    roll_count=2,
)
GOLDEN_BODY = (
    (80).to_bytes(4, "big")  # size
    + b"CQTL"  # magic
    + (1).to_bytes(2, "big")  # version
    + (1).to_bytes(2, "big")  # flags: TOMBSTONE
    + (2).to_bytes(4, "big")  # roll count
    + (160).to_bytes(8, "big")  # prev_pos
    + (1_700_000_000_000).to_bytes(8, "big")  # write_ms
    + (1_700_000_060_050).to_bytes(8, "big")  # deliver_ms
    + (1_700_000_060_000).to_bytes(8, "big")  # slot_ms
    + (4096).to_bytes(8, "big")  # CommitLog offset
    + (321).to_bytes(4, "big")  # CommitLog size
    + bytes.fromhex("deadbeef")  # topic hash
    + bytes.fromhex("0123456789abcdef")  # key hash
    + bytes(4)  # reserved
)
GOLDEN = GOLDEN_BODY + bytes.fromhex("2dadbd49")


def rec(slot_ms: int, cl_offset: int, prev: int = NO_POS, **kw: object) -> TimerRecord:
    fields: dict[object, object] = {
        "prev_pos": prev,
        "flags": RecordFlags.NONE,
        "write_ms": 1,
        "deliver_ms": slot_ms + 5,
        "slot_ms": slot_ms,
        "cl_offset": cl_offset,
        "cl_size": 10,
    }
    fields.update(kw)
    return TimerRecord(**fields)  # type: ignore[arg-type]


def test_record_golden_bytes_both_ways() -> None:
    assert zlib.crc32(GOLDEN_BODY) == 0x2DADBD49
    assert len(GOLDEN) == RECORD_SIZE == 80
    assert encode_record(RECORD) == GOLDEN
    assert decode_record(GOLDEN) == RECORD
    assert RECORD.in_tombstone_chain and not RECORD.is_rolled


@pytest.mark.parametrize("offset", [11, 17, 33, 50, 63, 70, 77])
def test_corrupted_record_raises_checksum_error(offset: int) -> None:
    data = bytearray(GOLDEN)
    data[offset] ^= 0x40
    with pytest.raises(ChecksumMismatch) as info:
        decode_record(bytes(data), pos=1234)
    assert info.value.pos == 1234
    assert isinstance(info.value, TimerCorruptionError)
    assert not isinstance(info.value, ValueError)  # not a caller error


def test_record_with_wrong_magic_or_size() -> None:
    with pytest.raises(BadMagic):
        decode_record(GOLDEN[:4] + b"XXXX" + GOLDEN[8:])
    with pytest.raises(BadMagic):
        decode_record((81).to_bytes(4, "big") + GOLDEN[4:])
    with pytest.raises(TimerCorruptionError):
        decode_record(GOLDEN[:-1])


def test_hashes_are_stable_and_never_zero() -> None:
    assert uniq_key_hash("7F0000011D3C18B4AAC2000000000001") == uniq_key_hash(
        "7F0000011D3C18B4AAC2000000000001"
    )
    assert uniq_key_hash("a") != uniq_key_hash("b")
    assert uniq_key_hash("") != 0
    assert topic_hash("orders") == zlib.crc32(b"orders")


def test_append_and_read_back(tmp_path: Path) -> None:
    with TimerLog.open(tmp_path, segment_bytes=SEG) as log:
        assert (log.start_pos, log.end_pos) == (0, 0)
        p0 = log.append(rec(1000, 1))
        p1 = log.append(rec(1100, 2, prev=NO_POS))
        assert (p0, p1) == (0, 80)
        assert log.read(p1) == rec(1100, 2)
        assert log.end_pos == 160
        with pytest.raises(TimerStateError):
            log.read(160)  # not written yet
        with pytest.raises(TimerStateError):
            log.read(40)  # not a record boundary


def test_records_never_span_segments(tmp_path: Path) -> None:
    with TimerLog.open(tmp_path, segment_bytes=SEG) as log:
        positions = [log.append(rec(1000, i)) for i in range(PER_SEG + 2)]
    assert positions[PER_SEG - 1] == (PER_SEG - 1) * RECORD_SIZE
    assert positions[PER_SEG] == SEG  # the 16 spare bytes are skipped
    assert positions[PER_SEG + 1] == SEG + RECORD_SIZE
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [f"{0:020d}", f"{SEG:020d}"]
    assert (tmp_path / f"{0:020d}").stat().st_size == PER_SEG * RECORD_SIZE
    with TimerLog.open(tmp_path, segment_bytes=SEG) as log:
        assert log.end_pos == SEG + 2 * RECORD_SIZE
        assert [p for p, _ in log.scan(0)] == positions
        assert log.read(SEG).cl_offset == PER_SEG


def test_chains_of_interleaved_slots_iterate_backwards(tmp_path: Path) -> None:
    heads: dict[int, int] = {}
    with TimerLog.open(tmp_path, segment_bytes=SEG) as log:
        for i in range(120):  # three slots, spread over three segments
            slot = 1000 + 100 * (i % 3)
            heads[slot] = log.append(rec(slot, i, prev=heads.get(slot, NO_POS)))
        for s, slot in enumerate((1000, 1100, 1200)):
            chain = list(log.iter_chain(heads[slot]))
            assert [r.cl_offset for _, r in chain] == list(range(117 + s, -1, -3))
            assert all(r.slot_ms == slot for _, r in chain)
            assert [p for p, _ in chain] == sorted((p for p, _ in chain), reverse=True)
        # stop at a position inside the chain (exclusive)
        chain = list(log.iter_chain(heads[1000]))
        part = list(log.iter_chain(heads[1000], stop_pos=chain[3][0]))
        assert part == chain[:3]
        with pytest.raises(ChainBroken):
            list(log.iter_chain(heads[1000], stop_pos=chain[3][0] + RECORD_SIZE))


def test_walking_a_long_chain_back_reads_each_block_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read far behind the end reads one block ending at its record, not up to the end:
    walking a burst slot's chain backwards stays linear in time and bounded in memory."""
    n = 20_000  # 1.6 MB of records in one segment; two slots interleaved
    heads: dict[int, int] = {}
    with TimerLog.open(tmp_path, segment_bytes=4 * 1024 * 1024) as log:
        for i in range(n):
            slot = 1000 + 100 * (i % 2)
            heads[slot] = log.append(rec(slot, i, prev=heads.get(slot, NO_POS)))
        reads: list[int] = []
        real_pread = os.pread

        def counting_pread(fd: int, size: int, offset: int) -> bytes:
            data = real_pread(fd, size, offset)
            reads.append(len(data))
            return data

        monkeypatch.setattr(os, "pread", counting_pread)
        assert sum(1 for _ in log.iter_chain(heads[1000])) == n // 2
    assert max(reads) <= 64 * 1024
    assert sum(reads) <= 2 * n * RECORD_SIZE


def test_chain_pointing_outside_the_log_is_broken(tmp_path: Path) -> None:
    with TimerLog.open(tmp_path, segment_bytes=SEG) as log:
        p = log.append(rec(1000, 1, prev=800))
        log.append(rec(1000, 2))
        with pytest.raises(ChainBroken):
            list(log.iter_chain(p))  # 800 holds no record


def _write_raw(path: Path, data: bytes, offset: int) -> None:
    fd = os.open(path, os.O_RDWR)
    try:
        os.pwrite(fd, data, offset)
    finally:
        os.close(fd)


def test_partial_record_at_the_tail_is_cut_on_open(tmp_path: Path) -> None:
    with TimerLog.open(tmp_path, segment_bytes=SEG) as log:
        for i in range(3):
            log.append(rec(1000, i))
        log.flush()
    seg = tmp_path / f"{0:020d}"
    with seg.open("ab") as f:
        f.write(encode_record(rec(1000, 3))[:37])  # a torn append
    with TimerLog.open(tmp_path, segment_bytes=SEG) as log:
        assert log.end_pos == 240
        assert log.open_report.truncated_bytes == 37
        assert log.append(rec(1000, 9)) == 240
    assert seg.stat().st_size == 320


@pytest.mark.parametrize("damage", ["zeros", "flip"])
def test_damaged_tail_record_is_cut_on_open(tmp_path: Path, damage: str) -> None:
    with TimerLog.open(tmp_path, segment_bytes=SEG) as log:
        for i in range(5):
            log.append(rec(1000, i))
    seg = tmp_path / f"{0:020d}"
    if damage == "zeros":
        _write_raw(seg, bytes(RECORD_SIZE), 3 * RECORD_SIZE)
    else:
        _write_raw(seg, b"\x99", 3 * RECORD_SIZE + 30)
    with TimerLog.open(tmp_path, segment_bytes=SEG, verify_from_pos=0) as log:
        assert log.end_pos == 3 * RECORD_SIZE
        assert log.open_report.truncated_bytes == 2 * RECORD_SIZE
        assert log.open_report.verified_records == 3
        assert log.open_report.reason is not None
        assert [r.cl_offset for _, r in log.scan(0)] == [0, 1, 2]


def test_torn_tail_across_segments_drops_later_segments(tmp_path: Path) -> None:
    with TimerLog.open(tmp_path, segment_bytes=SEG) as log:
        for i in range(PER_SEG + 5):
            log.append(rec(1000, i))
    _write_raw(tmp_path / f"{0:020d}", bytes(8), 50 * RECORD_SIZE)  # last record of segment 0
    with TimerLog.open(tmp_path, segment_bytes=SEG, verify_from_pos=40 * RECORD_SIZE) as log:
        assert log.end_pos == 50 * RECORD_SIZE
        assert log.open_report.verified_records == 10
    assert not (tmp_path / f"{SEG:020d}").exists()


def test_damage_before_the_verified_range_is_raised_on_read(tmp_path: Path) -> None:
    with TimerLog.open(tmp_path, segment_bytes=SEG) as log:
        for i in range(4):
            log.append(rec(1000, i))
    _write_raw(tmp_path / f"{0:020d}", b"\x01", RECORD_SIZE + 20)
    with TimerLog.open(tmp_path, segment_bytes=SEG, verify_from_pos=2 * RECORD_SIZE) as log:
        assert log.end_pos == 4 * RECORD_SIZE
        with pytest.raises(ChecksumMismatch):
            log.read(RECORD_SIZE)


def test_reopen_with_another_segment_size_is_refused(tmp_path: Path) -> None:
    with TimerLog.open(tmp_path, segment_bytes=SEG) as log:
        for i in range(PER_SEG + 1):
            log.append(rec(1000, i))
    with pytest.raises(TimerConfigMismatch) as info:
        TimerLog.open(tmp_path, segment_bytes=2 * SEG)
    assert info.value.field == "timer_log_segment_bytes"


def test_truncate_and_drop_old_segments(tmp_path: Path) -> None:
    with TimerLog.open(tmp_path, segment_bytes=SEG) as log:
        for i in range(3 * PER_SEG):
            log.append(rec(1000, i))
        assert log.drop_segments_before(SEG + 1) == 1
        assert log.start_pos == SEG
        with pytest.raises(TimerStateError):
            log.read(0)
        log.truncate(SEG + 2 * RECORD_SIZE)
        assert log.end_pos == SEG + 2 * RECORD_SIZE
        assert log.append(rec(1000, 7)) == SEG + 2 * RECORD_SIZE
        assert log.drop_segments_before(10 * SEG) == 0  # never the last segment
        log.flush()
        assert log.flushed_pos == log.end_pos
    with TimerLog.open(tmp_path, segment_bytes=SEG) as log:
        assert (log.start_pos, log.end_pos) == (SEG, SEG + 3 * RECORD_SIZE)


def test_closed_log_refuses_use(tmp_path: Path) -> None:
    log = TimerLog.open(tmp_path, segment_bytes=SEG)
    log.close()
    with pytest.raises(TimerStateError):
        log.append(rec(1000, 1))
