from __future__ import annotations

import os
import zlib
from pathlib import Path

import pytest

from chronomq.timer.errors import BadMagic, ChecksumMismatch, TimerConfigMismatch, TimerStateError
from chronomq.timer.slots import SlotGeometry
from chronomq.timer.timerlog import NO_POS
from chronomq.timer.wheel import (
    HEADER_SIZE,
    SLOT_SIZE,
    Slot,
    TimerWheel,
    decode_header,
    decode_slot,
    encode_header,
    encode_slot,
)

G = SlotGeometry(precision_ms=100, slot_count=64, roll_window_slots=32)
T = 1_700_000_060_000  # a slot time

# magic "CQSL" | count 7 | slot_ms | first 160 | last 4000 | tomb_last 480 | tomb_count 2 |
# 16 reserved zero bytes | crc32
GOLDEN_SLOT_BODY = (
    b"CQSL"
    + (7).to_bytes(4, "big")
    + T.to_bytes(8, "big")
    + (160).to_bytes(8, "big")
    + (4000).to_bytes(8, "big")
    + (480).to_bytes(8, "big")
    + (2).to_bytes(4, "big")
    + bytes(16)
)
GOLDEN_SLOT = GOLDEN_SLOT_BODY + bytes.fromhex("777bd9da")
GOLDEN_HEADER = bytes.fromhex("43515457000100400000006400000040" + "00" * 44 + "35e3d226")


def test_slot_golden_bytes_both_ways() -> None:
    slot = Slot(T, first_pos=160, last_pos=4000, count=7, tomb_last_pos=480, tomb_count=2)
    assert zlib.crc32(GOLDEN_SLOT_BODY) == 0x777BD9DA
    assert len(GOLDEN_SLOT) == SLOT_SIZE == 64
    assert encode_slot(slot) == GOLDEN_SLOT
    assert decode_slot(GOLDEN_SLOT) == slot


def test_header_golden_bytes_both_ways() -> None:
    assert encode_header(G) == GOLDEN_HEADER
    assert decode_header(GOLDEN_HEADER) == (100, 64)


def test_never_written_slot_decodes_as_none() -> None:
    assert decode_slot(bytes(SLOT_SIZE)) is None


@pytest.mark.parametrize("offset", [4, 8, 20, 40, 61])
def test_corrupted_slot_is_a_checksum_error(offset: int) -> None:
    data = bytearray(GOLDEN_SLOT)
    data[offset] ^= 0x01
    with pytest.raises(ChecksumMismatch):
        decode_slot(bytes(data))


def test_slot_with_bad_magic() -> None:
    with pytest.raises(BadMagic):
        decode_slot(b"XXXX" + GOLDEN_SLOT[4:])


def test_put_links_first_last_and_count(tmp_path: Path) -> None:
    with TimerWheel.open(tmp_path / "w", G) as wheel:
        assert wheel.get(T + 50) == Slot(T)
        assert wheel.put(T + 10, 0) == Slot(T, 0, 0, 1)
        assert wheel.put(T + 99, 80) == Slot(T, 0, 80, 2)
        slot = wheel.put(T, 160, tombstone=True)
        assert slot == Slot(T, 0, 80, 2, tomb_last_pos=160, tomb_count=1)
        assert wheel.get(T + 42) == slot
        assert wheel.get(T + 100) == Slot(T + 100)
        with pytest.raises(TimerStateError):
            wheel.put(T, 80)  # positions only grow along a chain


def test_stale_lap_reads_as_empty_and_is_taken_over(tmp_path: Path) -> None:
    with TimerWheel.open(tmp_path / "w", G) as wheel:
        wheel.put(T, 0)
        next_lap = T + G.window_ms
        assert G.index(next_lap) == G.index(T)
        assert wheel.get(next_lap) == Slot(next_lap, NO_POS, NO_POS, 0)
        assert wheel.raw(G.index(T)) == Slot(T, 0, 0, 1)
        assert wheel.put(next_lap, 800) == Slot(next_lap, 800, 800, 1)
        assert wheel.get(T) == Slot(T)  # the old lap is gone
        with pytest.raises(TimerStateError):
            wheel.put(T, 900)  # an older lap may not come back


def test_reset_empties_only_the_given_lap(tmp_path: Path) -> None:
    with TimerWheel.open(tmp_path / "w", G) as wheel:
        wheel.put(T, 0)
        wheel.reset(T + G.window_ms)
        assert wheel.get(T).count == 1
        wheel.reset(T)
        assert wheel.get(T) == Slot(T)
        assert wheel.raw(G.index(T)) is None


def test_flush_persists_and_unflushed_changes_are_dropped(tmp_path: Path) -> None:
    path = tmp_path / "w"
    wheel = TimerWheel.open(path, G)
    wheel.put(T, 0)
    wheel.put(T + 100, 80)
    assert wheel.dirty_slots == 2
    assert wheel.flush(durable_log_end=160) == 2
    assert wheel.dirty_slots == 0
    wheel.put(T + 200, 160)
    wheel.close()
    assert path.stat().st_size == HEADER_SIZE + 64 * SLOT_SIZE
    with TimerWheel.open(path, G) as again:
        assert again.get(T) == Slot(T, 0, 0, 1)
        assert again.get(T + 100) == Slot(T + 100, 80, 80, 1)
        assert again.get(T + 200) == Slot(T + 200)


def test_flush_refuses_to_lead_the_timerlog(tmp_path: Path) -> None:
    with TimerWheel.open(tmp_path / "w", G) as wheel:
        wheel.put(T, 80)
        with pytest.raises(TimerStateError, match="flush the TimerLog first"):
            wheel.flush(durable_log_end=80)
        assert wheel.flush(durable_log_end=160) == 1


def test_reopen_with_other_precision_or_slot_count_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "w"
    TimerWheel.open(path, G).close()
    with pytest.raises(TimerConfigMismatch) as info:
        TimerWheel.open(path, SlotGeometry(precision_ms=10, slot_count=64, roll_window_slots=32))
    assert info.value.field == "timer_precision_ms"
    assert "timer_precision_ms=100" in str(info.value)
    with pytest.raises(TimerConfigMismatch) as info:
        TimerWheel.open(path, SlotGeometry(precision_ms=100, slot_count=128, roll_window_slots=32))
    assert info.value.field == "timer_wheel_slots"


def test_damaged_slot_on_disk_is_reported(tmp_path: Path) -> None:
    path = tmp_path / "w"
    with TimerWheel.open(path, G) as wheel:
        wheel.put(T, 0)
        wheel.flush()
    offset = HEADER_SIZE + G.index(T) * SLOT_SIZE + 12
    fd = os.open(path, os.O_RDWR)
    os.pwrite(fd, b"\xff", offset)
    os.close(fd)
    with TimerWheel.open(path, G) as wheel, pytest.raises(ChecksumMismatch) as info:
        wheel.get(T)
    assert info.value.path == path


def test_closed_wheel_refuses_use(tmp_path: Path) -> None:
    wheel = TimerWheel.open(tmp_path / "w", G)
    wheel.close()
    with pytest.raises(TimerStateError):
        wheel.get(T)
