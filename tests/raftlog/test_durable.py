"""The one module that makes a node's file changes durable (``chronomq.raftlog.durable``):
what each writer syncs, in which order, and that a failed fsync stops the node with a
message naming the file (exit status 70), while a failed write only raises."""

from __future__ import annotations

import errno
import logging
import os
import stat
from pathlib import Path

import pytest

from chronomq.raftlog import durable

from ._fsync import Faults, FsyncSpy


@pytest.fixture
def faults(monkeypatch: pytest.MonkeyPatch) -> Faults:
    """The default fault handler, recording instead of exiting."""
    recorder = Faults()
    monkeypatch.setattr(durable, "fail_stop", recorder)
    return recorder


# ---------------------------------------------------------------------- whole files


def test_write_atomically_syncs_the_file_then_its_directory(tmp_path: Path, spy: FsyncSpy) -> None:
    path = tmp_path / "state"
    path.write_bytes(b"old")
    durable.write_atomically(path, b"new bytes")
    assert path.read_bytes() == b"new bytes"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state"]  # no temp file left
    # The temp file's bytes before the rename, the directory after it.
    assert spy.calls == [("fsync", str(tmp_path / "state.tmp")), ("fsync", str(tmp_path))]


def test_write_atomically_keeps_the_callers_temp_name_and_mode(
    tmp_path: Path, spy: FsyncSpy
) -> None:
    path = tmp_path / "removed.json"
    old_umask = os.umask(0)
    try:
        durable.write_atomically(path, b"{}", tmp=tmp_path / "removed.tmp", mode=0o640)
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    assert spy.paths() == [str(tmp_path / "removed.tmp"), str(tmp_path)]


def test_an_exception_inside_atomic_file_leaves_the_old_file(tmp_path: Path) -> None:
    path = tmp_path / "wheel"
    path.write_bytes(b"old")
    with pytest.raises(RuntimeError), durable.atomic_file(path) as fd:
        os.write(fd, b"half")
        raise RuntimeError("the writer failed")
    assert path.read_bytes() == b"old"


def test_atomic_file_hands_the_descriptor_to_the_writer(tmp_path: Path, spy: FsyncSpy) -> None:
    path = tmp_path / "sparse"
    with durable.atomic_file(path, mode=0o644) as fd:
        durable.pwrite_all(fd, b"HEAD", 0, path)
        os.ftruncate(fd, 4096)
    data = path.read_bytes()
    assert data[:4] == b"HEAD" and len(data) == 4096 and data[4:] == bytes(4092)
    assert spy.paths() == [str(tmp_path / "sparse.tmp"), str(tmp_path)]


# ---------------------------------------------------------------------- names


def test_replace_and_unlink_sync_the_directory(tmp_path: Path, spy: FsyncSpy) -> None:
    (tmp_path / "a").write_bytes(b"x")
    durable.replace(tmp_path / "a", tmp_path / "b")
    assert spy.paths() == [str(tmp_path)]
    durable.unlink(tmp_path / "b")
    assert not (tmp_path / "b").exists()
    assert spy.paths() == [str(tmp_path)] * 2
    durable.unlink(tmp_path / "b", missing_ok=True)  # still synced: an earlier unlink may not be
    assert spy.paths() == [str(tmp_path)] * 3
    with pytest.raises(FileNotFoundError):
        durable.unlink(tmp_path / "b")


def test_sync_file_and_fsync_dir(tmp_path: Path, spy: FsyncSpy) -> None:
    (tmp_path / "f").write_bytes(b"x")
    durable.sync_file(tmp_path / "f")
    durable.fsync_dir(tmp_path)
    assert spy.paths() == [str(tmp_path / "f"), str(tmp_path)]


# ---------------------------------------------------------------------- the rule


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(lambda p: durable.write_atomically(p / "f", b"x"), id="write_atomically"),
        pytest.param(lambda p: durable.fsync_dir(p), id="fsync_dir"),
        pytest.param(lambda p: durable.unlink(p / "f", missing_ok=True), id="unlink"),
        pytest.param(lambda p: durable.make_dirs(p / "new"), id="make_dirs"),
    ],
)
def test_a_failed_fsync_calls_the_fault_handler_naming_the_file(
    tmp_path: Path, spy: FsyncSpy, faults: Faults, change: object
) -> None:
    spy.fail = lambda path: True
    with pytest.raises(durable.StorageFault) as caught:
        change(tmp_path)  # type: ignore[operator]
    assert len(faults.messages) == 1
    message = faults.messages[0]
    assert message.startswith(f"fsync of {tmp_path}") and "(Input/output error)" in message
    assert str(caught.value) == message


def test_a_failed_fsync_of_a_descriptor_names_what_the_caller_says(
    tmp_path: Path, spy: FsyncSpy
) -> None:
    told = Faults()
    spy.fail = lambda path: True
    fd = os.open(tmp_path / "seg", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        with pytest.raises(durable.StorageFault):
            durable.fsync(fd, "the CommitLog in /d", on_fault=told)
        with pytest.raises(durable.StorageFault):
            durable.fdatasync(fd, tmp_path / "seg", on_fault=told)
    finally:
        os.close(fd)
    assert told.messages[0].startswith("fsync of the CommitLog in /d failed (Input/output error)")
    assert told.messages[1].startswith(f"fsync of {tmp_path / 'seg'} failed")


def test_the_default_handler_exits_with_status_70_naming_the_file(
    tmp_path: Path, spy: FsyncSpy, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    exits: list[int] = []

    def fake_exit(status: int) -> None:
        exits.append(status)
        raise SystemExit(status)

    monkeypatch.setattr(os, "_exit", fake_exit)
    monkeypatch.setattr(logging, "shutdown", lambda: None)
    spy.fail = lambda path: True
    with caplog.at_level(logging.CRITICAL, logger=durable.__name__), pytest.raises(SystemExit):
        durable.write_atomically(tmp_path / "checkpoint", b"x")
    assert exits == [durable.EXIT_STORE_FAULT] == [70]
    [record] = [r for r in caplog.records if r.levelno == logging.CRITICAL]
    assert f"fsync of {tmp_path / 'checkpoint.tmp'} failed" in record.getMessage()
    assert (tmp_path / "checkpoint").exists() is False  # never renamed into place


def test_a_failed_write_raises_naming_the_file_and_stops_nothing(
    tmp_path: Path, faults: Faults
) -> None:
    path = tmp_path / "log"
    path.write_bytes(b"")
    fd = os.open(path, os.O_RDONLY)  # pwrite fails with EBADF
    try:
        with pytest.raises(OSError) as caught:
            durable.pwrite_all(fd, b"record", 0, path)
    finally:
        os.close(fd)
    assert caught.value.errno == errno.EBADF and caught.value.filename == str(path)
    assert not isinstance(caught.value, durable.StorageFault)
    assert faults.messages == []


def test_a_write_that_makes_no_progress_is_a_full_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(os, "pwrite", lambda fd, data, at: 0)
    with pytest.raises(OSError) as caught:
        durable.pwrite_all(3, b"x", 0, tmp_path / "seg")
    assert caught.value.errno == errno.ENOSPC and caught.value.filename == str(tmp_path / "seg")


def test_short_writes_are_finished(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = os.pwrite
    monkeypatch.setattr(os, "pwrite", lambda fd, data, at: real(fd, bytes(data[:3]), at))
    path = tmp_path / "f"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        durable.pwrite_all(fd, b"0123456789", 2, path)
    finally:
        os.close(fd)
    assert path.read_bytes() == b"\0\0" + b"0123456789"


def test_a_latch_fails_every_later_sync(tmp_path: Path, spy: FsyncSpy) -> None:
    """fsyncgate: a disk that "recovers" may have dropped the pages of the failed sync."""
    told = Faults()
    latch = durable.FaultLatch(told)
    spy.fail = lambda path: True
    with pytest.raises(durable.StorageFault):
        durable.fsync_dir(tmp_path, on_fault=latch)
    spy.fail = lambda path: False
    with pytest.raises(durable.StorageFault):
        latch.check()
    assert latch.failed == told.messages[0] == told.messages[1]
    assert durable.FaultLatch().failed is None
    durable.FaultLatch().check()  # nothing failed: nothing raised
