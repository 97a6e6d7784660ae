"""TimerLog reclaim: which records an apply may still read (the leader's scan), chains read
down to the replicated reclaim position, and each node deleting whole segments one checkpoint
later (:mod:`chronomq.timer.reclaim`, :mod:`chronomq.timer.files`)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from chronomq.timer.chains import find_message, tombstone_keys
from chronomq.timer.config import TimerConfig
from chronomq.timer.cursor import ReadCursor
from chronomq.timer.files import TimerFiles
from chronomq.timer.reclaim import ReclaimScanner, reclaim_position
from chronomq.timer.slots import SlotGeometry
from chronomq.timer.timerlog import (
    NO_POS,
    RECORD_SIZE,
    RecordFlags,
    TimerLog,
    TimerRecord,
    encode_record,
)
from chronomq.timer.wheel import Slot

SEG = 8 * RECORD_SIZE  # 8 records a segment
T0 = 1_700_000_000_000
GEOMETRY = SlotGeometry(precision_ms=100, slot_count=4096, roll_window_slots=1024)


def rec(slot_ms: int, *, tomb: bool = False, prev: int = NO_POS, key: int = 0) -> TimerRecord:
    return TimerRecord(
        prev_pos=prev,
        flags=RecordFlags.TOMBSTONE if tomb else RecordFlags.NONE,
        write_ms=1,
        deliver_ms=slot_ms,
        slot_ms=slot_ms,
        cl_offset=0,
        cl_size=10,
        key_hash=key,
    )


def test_the_first_needed_record_is_the_first_of_an_unread_slot(tmp_path: Path) -> None:
    log = TimerLog.open(tmp_path, segment_bytes=SEG)
    # Slots 0..29 (x100 ms), one record each, in enqueue order; then slot 5 again (late).
    positions = [log.append(rec(T0 + 100 * k)) for k in range(30)]
    scanner = ReclaimScanner()
    pos, done = scanner.first_needed(log, T0 + 100 * 20, T0 + 100 * 20)
    assert done and pos == positions[20]
    assert reclaim_position(pos, SEG) == 2 * SEG  # records 16..23: segment 2
    # A record of a slot still unread keeps its segment, wherever it lies.
    scanner = ReclaimScanner()
    pos, _ = scanner.first_needed(log, T0 + 100 * 3, T0)
    assert pos == positions[3] and reclaim_position(pos, SEG) == 0
    # Nothing needed: the position is the end (its segment's start is the reclaim position).
    scanner = ReclaimScanner()
    pos, done = scanner.first_needed(log, T0 + 100 * 31, T0 + 100 * 31)
    assert done and pos == log.end_pos
    log.close()


def test_a_cancel_of_a_read_slot_is_needed_while_an_older_message_may_wait(
    tmp_path: Path,
) -> None:
    """A message stored before its slot was read and not yet in the wheel is delivered at
    once unless its slot's cancel chain holds its cancel: such cancels stay needed."""
    log = TimerLog.open(tmp_path, segment_bytes=SEG)
    for k in range(10):
        log.append(rec(T0 + 100 * k))
    tomb = log.append(rec(T0 + 100 * 2, tomb=True, key=7))
    for k in range(10, 20):
        log.append(rec(T0 + 100 * k))
    cursor = T0 + 100 * 15
    scanner = ReclaimScanner()
    # The cursor passed slot 2 when the CommitLog ended at 1000; a message at 900 still waits.
    before = scanner.cancels_read_before(T0 + 100 * 3, 1_000, 900)
    assert before is None
    assert scanner.first_needed(log, cursor, before) == (tomb, True)
    # Once the first waiting message lies past that CommitLog end, the cancel is not needed.
    scanner = ReclaimScanner()
    scanner.cancels_read_before(T0 + 100 * 3, 1_000, 900)
    before = scanner.cancels_read_before(T0 + 100 * 15, 2_000, 1_500)
    assert before == T0 + 100 * 3
    pos, _ = scanner.first_needed(log, cursor, before)
    assert pos > tomb
    # Nothing waits at all: no read slot's cancel is needed.
    assert ReclaimScanner().cancels_read_before(cursor, 3_000, None) == cursor
    log.close()


def test_chains_are_read_down_to_the_reclaim_position(tmp_path: Path) -> None:
    log = TimerLog.open(tmp_path, segment_bytes=SEG)
    slot_ms = T0
    t1 = log.append(rec(slot_ms, tomb=True, key=1))
    for k in range(10):
        log.append(rec(T0 + 100 * (k + 1)))
    t2 = log.append(rec(slot_ms, tomb=True, key=2, prev=t1))
    m = log.append(rec(slot_ms, key=3))
    slot = Slot(slot_ms, first_pos=m, last_pos=m, count=1, tomb_last_pos=t2, tomb_count=2)
    assert tombstone_keys(log, slot) == {1, 2}
    assert tombstone_keys(log, slot, SEG) == {2}  # the cancel before the position is not read
    log.drop_segments_before(SEG)
    assert tombstone_keys(log, slot, SEG) == {2}  # and need not be on disk
    assert find_message(log, slot, 3, SEG) == m
    log.close()


def config() -> TimerConfig:
    return TimerConfig(
        timer_precision_ms=GEOMETRY.precision_ms,
        timer_wheel_slots=GEOMETRY.slot_count,
        timer_roll_window_slots=GEOMETRY.roll_window_slots,
        timer_log_segment_bytes=SEG,
    )


def persist(files: TimerFiles, reclaim_pos: int) -> None:
    files.persist(
        applied_index=1,
        enqueue_offset=0,
        cursor=ReadCursor.at(T0),
        last_delivered_ms=0,
        reclaim_pos=reclaim_pos,
    )


def test_segments_go_one_checkpoint_after_the_reclaim_position_allows_them(
    tmp_path: Path,
) -> None:
    """A restart begins no earlier than the previous checkpoint's snapshot: a checkpoint
    deletes what the one before it allowed, below its reclaim position and flushed end."""
    files = TimerFiles(tmp_path, config())
    for k in range(40):  # 5 segments
        files.log.append(rec(T0 + 100 * k))
    persist(files, 3 * SEG)
    assert files.log.start_pos == 0 and files.reclaimed_segments == 0
    persist(files, 4 * SEG)
    assert files.log.start_pos == 3 * SEG and files.reclaimed_segments == 3
    persist(files, 4 * SEG)
    assert files.log.start_pos == 4 * SEG
    end = files.log.end_pos
    files.close()
    # Reopened: the TimerLog starts where it was reclaimed, and the wheel is rebuilt from there.
    files = TimerFiles(tmp_path, config())
    assert (files.log.start_pos, files.log.end_pos) == (4 * SEG, end)
    # A snapshot that needs the TimerLog to end before its start: it starts again at the
    # reclaim position's segment and is completed (here from a peer).
    sent: list[int] = []

    def fetch(start: int, stop: int, sink: Callable[[bytes], None]) -> None:
        sent.append(start)
        first, last = start // RECORD_SIZE, stop // RECORD_SIZE
        sink(b"".join(encode_record(rec(T0 + 100 * k)) for k in range(first, last)))

    report = files.align(2 * SEG + 3 * RECORD_SIZE, fetch, None, reclaim_pos=2 * SEG)
    assert sent == [2 * SEG] and report.rebuilt
    assert (files.log.start_pos, files.log.end_pos) == (2 * SEG, 2 * SEG + 3 * RECORD_SIZE)
    files.close()
