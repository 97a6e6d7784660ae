from __future__ import annotations

import zlib
from pathlib import Path

import pytest

from chronomq.timer.checkpoint import (
    CHECKPOINT_FILE,
    TIMERLOG_DIR,
    WHEEL_FILE,
    Checkpoint,
    decode_checkpoint,
    encode_checkpoint,
    load_checkpoint,
    persist,
    rebuild_wheel,
    recover,
    save_checkpoint,
)
from chronomq.timer.config import TimerConfig
from chronomq.timer.cursor import ReadCursor
from chronomq.timer.errors import BadMagic, ChecksumMismatch, TimerConfigMismatch
from chronomq.timer.timerlog import NO_POS, RECORD_SIZE
from chronomq.timer.wheel import TimerWheel
from tests.timer.helpers import GEOMETRY, T0, Harness

CP = Checkpoint(
    precision_ms=100,
    applied_index=42,
    enqueue_offset=1000,
    timerlog_flush_pos=8000,
    cursor=ReadCursor(1_700_000_060_000, 7920, 160, 4000),
    last_delivered_ms=1_700_000_059_999,
)
GOLDEN_BODY = (
    b"CQCP"
    + (1).to_bytes(2, "big")  # version
    + bytes(2)  # reserved
    + (42).to_bytes(8, "big")  # applied index
    + (1000).to_bytes(8, "big")  # enqueue offset
    + (8000).to_bytes(8, "big")  # TimerLog flush position
    + (1_700_000_060_000).to_bytes(8, "big")  # cursor slot
    + (7920).to_bytes(8, "big")  # cursor head
    + (160).to_bytes(8, "big")  # cursor stop
    + (4000).to_bytes(8, "big")  # cursor next
    + (1_700_000_059_999).to_bytes(8, "big")  # last delivered
    + (100).to_bytes(4, "big")  # precision
)
GOLDEN = GOLDEN_BODY + bytes.fromhex("db23ef7a")

CONFIG = TimerConfig(
    timer_precision_ms=GEOMETRY.precision_ms,
    timer_wheel_slots=GEOMETRY.slot_count,
    timer_roll_window_slots=GEOMETRY.roll_window_slots,
    timer_log_segment_bytes=4096,
    timer_dequeue_scan_slots_max=64,
)


def test_checkpoint_golden_bytes_both_ways() -> None:
    assert zlib.crc32(GOLDEN_BODY) == 0xDB23EF7A
    assert encode_checkpoint(CP) == GOLDEN
    assert decode_checkpoint(GOLDEN) == CP


@pytest.mark.parametrize("offset", [8, 30, 50, 75, 77])
def test_corrupted_checkpoint_is_a_checksum_error(offset: int) -> None:
    data = bytearray(GOLDEN)
    data[offset] ^= 0x04
    with pytest.raises(ChecksumMismatch):
        decode_checkpoint(bytes(data))
    with pytest.raises(BadMagic):
        decode_checkpoint(b"CQXX" + GOLDEN[4:])


def test_save_and_load_round_trip_atomically(tmp_path: Path) -> None:
    path = tmp_path / CHECKPOINT_FILE
    assert load_checkpoint(path) is None
    save_checkpoint(path, CP)
    assert load_checkpoint(path) == CP
    later = Checkpoint(100, 43, 1001, 8080, ReadCursor.at(1_700_000_060_100))
    save_checkpoint(path, later)
    assert load_checkpoint(path) == later
    assert sorted(p.name for p in tmp_path.iterdir()) == [CHECKPOINT_FILE]  # no temp file left


def _fill(h: Harness, n: int, first: int = 0) -> None:
    for i in range(first, first + n):
        h.produce(f"m{i}", T0 + 100 * (i % 7) + 150, T0)
        if i % 5 == 0:
            h.cancel(f"m{i}", T0 + 1)


def _slots(wheel: TimerWheel) -> list[object]:
    return [wheel.raw(i) for i in range(GEOMETRY.slot_count)]


def test_rebuild_from_scratch_gives_the_same_wheel(tmp_path: Path) -> None:
    h = Harness(tmp_path / "a")
    _fill(h, 60)
    fresh = TimerWheel.open(tmp_path / "fresh", GEOMETRY)
    report = rebuild_wheel(fresh, h.log, 0)
    assert report.scanned == report.linked == 72  # 60 messages, 12 cancels
    assert report.chain_mismatches == report.stale == report.already_linked == 0
    assert _slots(fresh) == _slots(h.wheel)
    again = rebuild_wheel(fresh, h.log, 0)  # idempotent
    assert (again.linked, again.already_linked) == (0, 72)
    fresh.close()
    h.close()


def test_recovery_after_a_crash_rebuilds_what_was_not_checkpointed(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    _fill(h, 30)
    cp = persist(
        tmp_path / CHECKPOINT_FILE,
        h.log,
        h.wheel,
        applied_index=7,
        enqueue_offset=30,
        cursor=h.cursor,
    )
    assert cp.timerlog_flush_pos == h.log.end_pos == 36 * RECORD_SIZE
    _fill(h, 20, first=30)
    expected = _slots(h.wheel)
    h.log.append(h.log.read(0))  # the last record...
    end = h.log.end_pos
    h.log.close()
    h.wheel.close()  # ...the crash: wheel changes since the checkpoint are lost
    base = (end - 1) // 4096 * 4096
    with (tmp_path / TIMERLOG_DIR / f"{base:020d}").open("r+b") as f:
        f.truncate(end - base - 30)  # ...and its write was torn

    rec = recover(tmp_path, CONFIG)
    try:
        assert rec.checkpoint == cp
        assert rec.log_report.truncated_bytes == RECORD_SIZE - 30
        assert rec.log.end_pos == end - RECORD_SIZE
        assert rec.rebuild.from_pos == cp.timerlog_flush_pos
        assert rec.rebuild.linked == 24  # 20 messages and 4 cancels after the checkpoint
        assert rec.rebuild.chain_mismatches == 0
        assert not rec.wheel_recreated
        assert _slots(rec.wheel) == expected
    finally:
        rec.log.close()
        rec.wheel.close()


def test_recovery_after_a_clean_stop_links_nothing(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    _fill(h, 10)
    persist(
        tmp_path / CHECKPOINT_FILE,
        h.log,
        h.wheel,
        applied_index=1,
        enqueue_offset=10,
        cursor=h.cursor,
    )
    expected = _slots(h.wheel)
    h.close()
    rec = recover(tmp_path, CONFIG)
    assert (rec.rebuild.scanned, rec.log_report.truncated_bytes) == (0, 0)
    assert _slots(rec.wheel) == expected
    rec.log.close()
    rec.wheel.close()


def test_damaged_wheel_is_set_aside_and_rebuilt(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    _fill(h, 10)
    persist(
        tmp_path / CHECKPOINT_FILE,
        h.log,
        h.wheel,
        applied_index=1,
        enqueue_offset=10,
        cursor=h.cursor,
    )
    expected = _slots(h.wheel)
    h.close()
    with (tmp_path / WHEEL_FILE).open("r+b") as f:
        f.write(b"JUNK")
    rec = recover(tmp_path, CONFIG)
    assert rec.wheel_recreated
    assert rec.rebuild.linked == 12
    assert _slots(rec.wheel) == expected
    assert (tmp_path / (WHEEL_FILE + ".corrupt")).exists()
    rec.log.close()
    rec.wheel.close()


def test_recovered_timer_delivers_exactly_what_remained(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    _fill(h, 30)
    h.run_until(T0 + 350)
    before = set(h.delivered_keys())
    persist(
        tmp_path / CHECKPOINT_FILE,
        h.log,
        h.wheel,
        applied_index=2,
        enqueue_offset=30,
        cursor=h.cursor,
    )
    h.close()
    rec = recover(tmp_path, CONFIG)
    assert rec.checkpoint is not None
    h2 = Harness(tmp_path / "unused")
    h2.log.close()
    h2.wheel.close()
    h2.log, h2.wheel, h2.cursor = rec.log, rec.wheel, rec.checkpoint.cursor
    h2.keys, h2.deliver_at = h.keys, h.deliver_at
    h2.run_until(T0 + 2_000)
    after = set(h2.delivered_keys())
    cancelled = {f"m{i}" for i in range(0, 30, 5)}
    assert before.isdisjoint(after)
    assert before | after == {f"m{i}" for i in range(30)} - cancelled
    h2.close()


def test_recovery_refuses_another_precision(tmp_path: Path) -> None:
    save_checkpoint(tmp_path / CHECKPOINT_FILE, CP)
    other = TimerConfig(timer_precision_ms=10, timer_wheel_slots=64, timer_roll_window_slots=32,
                        timer_dequeue_scan_slots_max=64)  # fmt: skip
    with pytest.raises(TimerConfigMismatch) as info:
        recover(tmp_path, other)
    assert info.value.field == "timer_precision_ms"


def test_fresh_directory_recovers_empty(tmp_path: Path) -> None:
    rec = recover(tmp_path / "new", CONFIG)
    assert rec.checkpoint is None
    assert (rec.log.start_pos, rec.log.end_pos, rec.rebuild.scanned) == (0, 0, 0)
    assert rec.wheel.get(T0).last_pos == NO_POS
    rec.log.close()
    rec.wheel.close()
