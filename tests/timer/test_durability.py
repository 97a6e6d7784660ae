"""The timer's files follow the node's one durability rule (``chronomq.raftlog.durable``): a
failed fsync of the TimerLog, the wheel, the checkpoint or their directory stops the node
with a message naming the file. The directory syncs used to swallow a failure."""

from __future__ import annotations

from pathlib import Path

import pytest

from chronomq.raftlog import durable
from chronomq.timer.checkpoint import WHEEL_FILE, Checkpoint, load_checkpoint, save_checkpoint
from chronomq.timer.config import TimerConfig
from chronomq.timer.cursor import ReadCursor
from chronomq.timer.files import DIRTY_MARKER, TimerFiles
from chronomq.timer.timerlog import NO_POS, RecordFlags, TimerLog, TimerRecord
from chronomq.timer.wheel import TimerWheel
from tests.raftlog._fsync import Faults, FsyncSpy
from tests.timer.helpers import GEOMETRY

SEG = 4096


@pytest.fixture
def spy(monkeypatch: pytest.MonkeyPatch) -> FsyncSpy:
    return FsyncSpy(monkeypatch)


@pytest.fixture
def faults(monkeypatch: pytest.MonkeyPatch) -> Faults:
    """The node's fault handler, recording instead of exiting."""
    recorder = Faults()
    monkeypatch.setattr(durable, "fail_stop", recorder)
    return recorder


def _record(slot_ms: int) -> TimerRecord:
    return TimerRecord(
        prev_pos=NO_POS,
        flags=RecordFlags.NONE,
        write_ms=1,
        deliver_ms=slot_ms,
        slot_ms=slot_ms,
        cl_offset=0,
        cl_size=10,
    )


def test_a_failed_directory_sync_of_the_timerlog_stops_the_node(
    tmp_path: Path, spy: FsyncSpy, faults: Faults
) -> None:
    directory = tmp_path / "timerlog"
    with TimerLog.open(directory, segment_bytes=SEG) as log:
        log.append(_record(1000))
        spy.fail = lambda path: path == str(directory)
        with pytest.raises(durable.StorageFault):
            log.flush()
        assert log.flushed_pos == 0  # not taken for durable
    assert len(faults.messages) == 1
    assert faults.messages[0].startswith(f"fsync of {directory} failed (Input/output error)")


def test_a_failed_segment_sync_names_the_segment(
    tmp_path: Path, spy: FsyncSpy, faults: Faults
) -> None:
    with TimerLog.open(tmp_path, segment_bytes=SEG) as log:
        log.append(_record(1000))
        spy.fail = lambda path: path.endswith("00000000000000000000")
        with pytest.raises(durable.StorageFault):
            log.flush()
    assert faults.messages[0].startswith(f"fsync of {tmp_path / ('0' * 20)} failed")


def test_a_failed_sync_of_the_wheel_stops_the_node(
    tmp_path: Path, spy: FsyncSpy, faults: Faults
) -> None:
    path = tmp_path / "wheel"
    spy.fail = lambda p: p == str(tmp_path)  # the directory, after the new file's rename
    with pytest.raises(durable.StorageFault):
        TimerWheel.open(path, GEOMETRY)
    assert faults.messages[-1].startswith(f"fsync of {tmp_path} failed")
    spy.fail = lambda p: False
    with TimerWheel.open(path, GEOMETRY) as wheel:
        wheel.put(1_700_000_000_000, 0)
        spy.fail = lambda p: p == str(path)
        with pytest.raises(durable.StorageFault):
            wheel.flush()
    assert faults.messages[-1].startswith(f"fsync of {path} failed")


def test_a_failed_sync_of_the_checkpoint_keeps_the_old_one(
    tmp_path: Path, spy: FsyncSpy, faults: Faults
) -> None:
    path = tmp_path / "checkpoint"
    old = Checkpoint(100, 1, 2, 0, ReadCursor.at(1_700_000_000_000), 0)
    save_checkpoint(path, old)
    spy.fail = lambda p: True
    with pytest.raises(durable.StorageFault):
        save_checkpoint(path, Checkpoint(100, 9, 9, 0, ReadCursor.at(1_700_000_000_000), 0))
    assert faults.messages[0].startswith(f"fsync of {tmp_path / 'checkpoint.tmp'} failed")
    assert load_checkpoint(path) == old


def test_the_dirty_marker_is_durable_before_the_wheel_is_written(
    tmp_path: Path, spy: FsyncSpy
) -> None:
    """A power cut while the wheel is written may keep some slots: the marker that tells the
    next start to rebuild the wheel must be there too, its name synced first."""
    root = tmp_path / "timer"
    config = TimerConfig(
        timer_precision_ms=GEOMETRY.precision_ms,
        timer_wheel_slots=GEOMETRY.slot_count,
        timer_roll_window_slots=GEOMETRY.roll_window_slots,
        timer_log_segment_bytes=SEG,
        timer_dequeue_scan_slots_max=64,
    )
    files = TimerFiles(root, config)
    try:
        pos = files.log.append(_record(1_700_000_000_000))
        files.wheel.put(1_700_000_000_000, pos)
        spy.calls.clear()
        files.persist(
            applied_index=1,
            enqueue_offset=1,
            cursor=ReadCursor.at(1_700_000_000_000),
            last_delivered_ms=0,
        )
    finally:
        files.close()
    synced = spy.paths()
    marker, wheel = str(root / DIRTY_MARKER), str(root / WHEEL_FILE)
    assert synced.index(marker) < synced.index(str(root)) < synced.index(wheel)
    assert not (root / DIRTY_MARKER).exists()
