"""The power-cut filesystem through a real FUSE mount: ordinary syscalls, mmap, a killed writer.

Needs root, /dev/fuse, libfuse 3 and mfusepy (``.ci/run`` installs fuse3 on CI); without them
every test here skips and says which is missing. Every mount is unmounted in a ``finally``.
"""

from __future__ import annotations

import mmap
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from chronomq.ops.drill.powercut.mount import PowerCutMount, available, is_mounted

_OK, _WHY = available()
pytestmark = pytest.mark.skipif(not _OK, reason=_WHY)


@pytest.fixture
def pc(tmp_path: Path) -> Iterator[PowerCutMount]:
    mount = PowerCutMount(tmp_path / "mnt", tmp_path / "state")
    try:
        mount.start()
        yield mount
    finally:
        mount.stop()
    assert not is_mounted(tmp_path / "mnt")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write(path: Path, data: bytes, *, sync: bool) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        if sync:
            os.fsync(f.fileno())


def test_syscalls_reach_the_model(pc: PowerCutMount) -> None:
    m = pc.mountpoint
    (m / "d").mkdir()
    _write(m / "d" / "kept", b"synced", sync=True)
    _write(m / "d" / "unsynced", b"page cache only", sync=False)
    _fsync_dir(m / "d")
    _fsync_dir(m)
    _write(m / "d" / "new", b"synced, directory not", sync=True)
    with open(m / "d" / "kept", "ab") as f:
        f.write(b" and more")
    os.rename(m / "d" / "unsynced", m / "d" / "renamed")
    assert sorted(os.listdir(m / "d")) == ["kept", "new", "renamed"]

    report = pc.cut()

    assert sorted(os.listdir(m / "d")) == ["kept", "unsynced"]
    assert (m / "d" / "kept").read_bytes() == b"synced"
    assert (m / "d" / "unsynced").read_bytes() == b""  # its entry was synced, its data not
    assert report["entries_lost"] == 2 and report["entries_back"] == 1
    assert pc.status()["cuts"] == 1


def test_truncate_and_ftruncate(pc: PowerCutMount) -> None:
    m = pc.mountpoint
    _write(m / "f", b"0123456789" * 1000, sync=True)
    _fsync_dir(m)
    os.truncate(m / "f", 5)
    with open(m / "f", "r+b") as f:
        f.truncate(20_000)
    assert os.path.getsize(m / "f") == 20_000
    pc.cut()
    assert (m / "f").read_bytes() == b"0123456789" * 1000


def test_mmap_with_msync_kept_without_msync_lost(pc: PowerCutMount) -> None:
    m = pc.mountpoint
    _write(m / "j", bytes(4 * mmap.PAGESIZE), sync=True)
    _fsync_dir(m)
    fd = os.open(m / "j", os.O_RDWR)
    try:
        view = mmap.mmap(fd, 4 * mmap.PAGESIZE)
        view[0:6] = b"synced"
        view.flush()  # msync(MS_SYNC): the dirty page is written, then fsynced
        view[mmap.PAGESIZE : mmap.PAGESIZE + 5] = b"later"
        view.flush(mmap.PAGESIZE, mmap.PAGESIZE)
        view[2 * mmap.PAGESIZE : 2 * mmap.PAGESIZE + 4] = b"lost"
        view.close()
    finally:
        os.close(fd)
    data = (m / "j").read_bytes()
    assert data[2 * mmap.PAGESIZE : 2 * mmap.PAGESIZE + 4] == b"lost"  # written back on close
    pc.cut()
    data = (m / "j").read_bytes()
    assert data[0:6] == b"synced"
    assert data[mmap.PAGESIZE : mmap.PAGESIZE + 5] == b"later"
    assert data[2 * mmap.PAGESIZE : 2 * mmap.PAGESIZE + 4] == bytes(4)


def test_a_killed_writer_keeps_the_page_cache_until_the_cut(pc: PowerCutMount) -> None:
    """SIGKILL alone loses nothing (the kernel writes a dead process's dirty mapped pages
    back); the cut that follows loses what was never msynced or fsynced."""
    m = pc.mountpoint
    _write(m / "journal", bytes(2 * mmap.PAGESIZE), sync=True)
    _write(m / "log", b"", sync=True)
    _fsync_dir(m)
    ready = m.parent / "ready"
    writer = textwrap.dedent(
        f"""
        import mmap, os, time
        fd = os.open({str(m / "journal")!r}, os.O_RDWR)
        view = mmap.mmap(fd, 2 * mmap.PAGESIZE)
        view[0:4] = b"sync"
        view.flush()
        view[mmap.PAGESIZE : mmap.PAGESIZE + 6] = b"nosync"
        log = os.open({str(m / "log")!r}, os.O_WRONLY | os.O_APPEND)
        os.write(log, b"fsynced;")
        os.fsync(log)
        os.write(log, b"page cache only")
        open({str(ready)!r}, "w").close()
        time.sleep(60)
        """
    )
    p = subprocess.Popen([sys.executable, "-c", writer])
    try:
        deadline = time.monotonic() + 20
        while not ready.exists():
            assert p.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=10)
    journal = (m / "journal").read_bytes()
    assert journal[mmap.PAGESIZE : mmap.PAGESIZE + 6] == b"nosync"
    assert (m / "log").read_bytes() == b"fsynced;page cache only"
    report = pc.cut()
    journal = (m / "journal").read_bytes()
    assert journal[0:4] == b"sync"
    assert journal[mmap.PAGESIZE : mmap.PAGESIZE + 6] == bytes(6)
    assert (m / "log").read_bytes() == b"fsynced;"
    assert report["files_reverted"] == 2


def test_files_open_across_a_cut_fail_with_eio(pc: PowerCutMount) -> None:
    m = pc.mountpoint
    _write(m / "f", b"x", sync=True)
    _fsync_dir(m)
    fd = os.open(m / "f", os.O_WRONLY)
    try:
        pc.cut()
        with pytest.raises(OSError):
            os.write(fd, b"y")
    finally:
        os.close(fd)
    assert (m / "f").read_bytes() == b"x"


def test_stop_unmounts_even_after_the_filesystem_died(tmp_path: Path) -> None:
    mount = PowerCutMount(tmp_path / "mnt", tmp_path / "state")
    try:
        mount.start()
        assert mount._proc is not None
        os.kill(mount._proc.pid, signal.SIGKILL)
        mount._proc.wait(timeout=10)
    finally:
        mount.stop()
    assert not is_mounted(tmp_path / "mnt")
