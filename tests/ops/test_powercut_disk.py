"""The power-cut model without FUSE: what a cut forgets and what it keeps.

Each test drives :class:`Disk` the way the FUSE layer does (paths inside the disk, file
handles) and then looks at the backing directory after a cut, as the next boot would see it.
The same cases through a real mount are in ``test_powercut_fuse.py``.
"""

from __future__ import annotations

import errno
import os
import random
from pathlib import Path

import pytest

from chronomq.ops.drill.powercut.disk import BLOCK_BYTES, RENAME_NOREPLACE, Disk


def _new(disk: Disk, path: str, data: bytes = b"", *, sync: bool = False) -> int:
    fh = disk.create(path, 0o644, os.O_WRONLY)
    if data:
        disk.write(fh, data, 0)
    if sync:
        disk.fsync(fh)
    return fh


def _read(disk: Disk, path: str) -> bytes:
    return (disk.tree / path.lstrip("/")).read_bytes()


def _names(disk: Disk, path: str = "/") -> list[str]:
    return sorted(name for name, _, _ in disk.readdir(path))


@pytest.fixture
def disk(tmp_path: Path) -> Disk:
    return Disk(tmp_path / "state")


def test_what_was_there_at_start_is_durable(tmp_path: Path) -> None:
    (tmp_path / "state" / "tree" / "d").mkdir(parents=True)
    (tmp_path / "state" / "tree" / "d" / "f").write_bytes(b"old")
    disk = Disk(tmp_path / "state")
    report = disk.cut()
    assert _read(disk, "/d/f") == b"old"
    assert report.entries_lost == report.entries_back == report.files_reverted == 0


def test_write_and_fsync_kept_write_without_fsync_lost(disk: Disk) -> None:
    fh = _new(disk, "/f", b"synced", sync=True)
    disk.fsyncdir("/")
    disk.write(fh, b"-and-not", 6)
    disk.write(fh, b"S", 0)  # an overwrite inside the synced part
    disk.release(fh)
    assert _read(disk, "/f") == b"Synced-and-not"
    report = disk.cut()
    assert _read(disk, "/f") == b"synced"
    assert report.files_reverted == 1
    assert report.entries_lost == 0


def test_create_without_directory_fsync_is_lost_even_if_the_file_was_fsynced(disk: Disk) -> None:
    disk.release(_new(disk, "/kept", b"a", sync=True))
    disk.fsyncdir("/")
    disk.release(_new(disk, "/gone", b"b", sync=True))
    report = disk.cut()
    assert _names(disk) == ["kept"]
    assert report.entries_lost == 1
    assert list(report.lost) == ["gone"]


def test_directory_fsync_without_file_fsync_keeps_an_empty_file(disk: Disk) -> None:
    disk.release(_new(disk, "/f", b"data"))
    disk.fsyncdir("/")
    disk.cut()
    assert _read(disk, "/f") == b""


def test_rename_without_directory_fsync_reverts(disk: Disk) -> None:
    disk.release(_new(disk, "/old", b"v1", sync=True))
    disk.fsyncdir("/")
    # The atomic-replace idiom, without the directory fsync at the end.
    disk.release(_new(disk, "/tmp", b"v2", sync=True))
    disk.rename("/tmp", "/old")
    assert _read(disk, "/old") == b"v2"
    report = disk.cut()
    assert _names(disk) == ["old"]
    assert _read(disk, "/old") == b"v1"
    assert report.entries_back == 1  # "old" holds its former file again


def test_rename_with_directory_fsync_is_kept(disk: Disk) -> None:
    disk.release(_new(disk, "/old", b"v1", sync=True))
    disk.fsyncdir("/")
    disk.release(_new(disk, "/tmp", b"v2", sync=True))
    disk.rename("/tmp", "/old")
    disk.fsyncdir("/")
    disk.cut()
    assert _names(disk) == ["old"]
    assert _read(disk, "/old") == b"v2"


def test_unlink_without_directory_fsync_comes_back_with_its_synced_data(disk: Disk) -> None:
    fh = _new(disk, "/f", b"synced", sync=True)
    disk.fsyncdir("/")
    disk.write(fh, b"XX", 0)  # unsynced, then the file goes
    disk.release(fh)
    disk.unlink("/f")
    assert _names(disk) == []
    disk.cut()
    assert _read(disk, "/f") == b"synced"
    # A second cut has nothing left to undo.
    assert disk.cut().entries_back == 0


def test_unlink_with_directory_fsync_is_final_and_frees_the_file(disk: Disk) -> None:
    disk.release(_new(disk, "/f", b"x", sync=True))
    disk.fsyncdir("/")
    disk.unlink("/f")
    assert disk.status()["kept_aside"] == 1
    disk.fsyncdir("/")
    assert disk.status()["kept_aside"] == 0
    disk.cut()
    assert _names(disk) == []


def test_truncate_is_undone_down_and_up(disk: Disk) -> None:
    data = bytes(random.Random(1).randbytes(3 * BLOCK_BYTES + 100))
    fh = _new(disk, "/f", data, sync=True)
    disk.fsyncdir("/")
    disk.truncate("/f", 10, fh)
    disk.write(fh, b"new tail", 5000)  # a hole, then bytes, where synced bytes were
    disk.truncate(None, 2 * len(data), fh)
    disk.release(fh)
    disk.cut()
    assert _read(disk, "/f") == data


def test_open_with_o_trunc_is_undone(disk: Disk) -> None:
    disk.release(_new(disk, "/f", b"synced", sync=True))
    disk.fsyncdir("/")
    fh = disk.open("/f", os.O_WRONLY | os.O_TRUNC)
    disk.write(fh, b"x", 0)
    disk.release(fh)
    disk.cut()
    assert _read(disk, "/f") == b"synced"


def test_extension_is_dropped_and_only_touched_blocks_are_saved(disk: Disk) -> None:
    fh = _new(disk, "/log", b"a" * (10 * BLOCK_BYTES), sync=True)
    disk.fsyncdir("/")
    for i in range(50):  # appends cost no copy
        disk.write(fh, b"b" * 1000, 10 * BLOCK_BYTES + i * 1000)
    assert disk._files[disk._handles[fh].ino].blocks == {}
    disk.write(fh, b"c", 3 * BLOCK_BYTES + 5)
    assert set(disk._files[disk._handles[fh].ino].blocks) == {3}
    disk.fsync(fh)
    disk.write(fh, b"d" * 100, 0)
    report = disk.cut()
    expected = bytearray(b"a" * (10 * BLOCK_BYTES))
    expected[3 * BLOCK_BYTES + 5] = ord("c")
    expected += b"b" * 50_000
    assert _read(disk, "/log") == bytes(expected)
    assert report.handles_closed == 1


def test_o_sync_writes_are_durable(disk: Disk) -> None:
    disk.release(_new(disk, "/f", b"", sync=True))
    disk.fsyncdir("/")
    fh = disk.open("/f", os.O_WRONLY | os.O_DSYNC)
    disk.write(fh, b"each write synced", 0)
    disk.cut()
    assert _read(disk, "/f") == b"each write synced"


def test_new_directory_needs_its_parent_synced_and_its_own_entries_synced(disk: Disk) -> None:
    disk.mkdir("/a", 0o755)
    disk.release(_new(disk, "/a/f", b"1", sync=True))
    disk.fsyncdir("/a")  # a's entries are durable, but a itself is not in /
    disk.cut()
    assert _names(disk) == []

    disk.mkdir("/a", 0o755)
    disk.fsyncdir("/")
    disk.release(_new(disk, "/a/f", b"1", sync=True))
    disk.cut()
    assert _names(disk) == ["a"]
    assert _names(disk, "/a") == []

    disk.release(_new(disk, "/a/f", b"1", sync=True))
    disk.fsyncdir("/a")
    disk.cut()
    assert _read(disk, "/a/f") == b"1"


def test_directory_moves_and_rmdir_revert(disk: Disk) -> None:
    disk.mkdir("/a", 0o755)
    disk.mkdir("/b", 0o755)
    disk.release(_new(disk, "/a/f", b"1", sync=True))
    disk.fsyncdir("/a")
    disk.fsyncdir("/")
    disk.unlink("/a/f")
    disk.rmdir("/a")
    disk.rename("/b", "/c")
    assert _names(disk) == ["c"]
    disk.cut()
    assert _names(disk) == ["a", "b"]
    assert _read(disk, "/a/f") == b"1"


def test_a_file_renamed_across_directories_needs_both_synced(disk: Disk) -> None:
    disk.mkdir("/a", 0o755)
    disk.mkdir("/b", 0o755)
    disk.release(_new(disk, "/a/f", b"1", sync=True))
    disk.fsyncdir("/a")
    disk.fsyncdir("/")
    disk.rename("/a/f", "/b/f")
    disk.fsyncdir("/b")  # the new entry is durable; the old one was not removed durably
    disk.cut()
    assert _read(disk, "/a/f") == b"1"
    assert _read(disk, "/b/f") == b"1"  # both names: what fsck would find, and POSIX allows


def test_handles_opened_before_a_cut_fail(disk: Disk) -> None:
    fh = _new(disk, "/f", b"x", sync=True)
    disk.fsyncdir("/")
    disk.cut()
    with pytest.raises(OSError) as err:
        disk.write(fh, b"late write-back", 0)
    assert err.value.errno == errno.EIO
    assert _read(disk, "/f") == b"x"


def test_rename_noreplace_and_refused_operations(disk: Disk) -> None:
    disk.release(_new(disk, "/a"))
    disk.release(_new(disk, "/b"))
    with pytest.raises(OSError) as err:
        disk.rename("/a", "/b", RENAME_NOREPLACE)
    assert err.value.errno == errno.EEXIST
    with pytest.raises(OSError):
        disk.link("/c", "/a")


def test_sync_all_makes_everything_durable(disk: Disk) -> None:
    disk.mkdir("/d", 0o755)
    disk.release(_new(disk, "/d/f", b"data"))
    disk.sync_all()
    disk.cut()
    assert _read(disk, "/d/f") == b"data"


def test_random_operations_match_a_reference_model(disk: Disk) -> None:
    """Random writes, truncates and syncs on three files against a byte-level reference."""
    seed = random.randrange(10**6)
    rng = random.Random(seed)
    names = ["/x", "/y", "/z"]
    handles = {n: _new(disk, n, sync=True) for n in names}
    disk.fsyncdir("/")
    live = {n: bytearray() for n in names}
    durable = {n: b"" for n in names}
    for _ in range(400):
        n = rng.choice(names)
        fh = handles[n]
        op = rng.random()
        if op < 0.6:
            off = rng.randrange(0, len(live[n]) + 3 * BLOCK_BYTES)
            data = rng.randbytes(rng.randrange(1, 2 * BLOCK_BYTES))
            disk.write(fh, data, off)
            if off > len(live[n]):
                live[n] += bytes(off - len(live[n]))
            live[n][off : off + len(data)] = data
        elif op < 0.75:
            size = rng.randrange(0, len(live[n]) + BLOCK_BYTES)
            disk.truncate(None, size, fh)
            live[n] = live[n][:size] + bytes(max(0, size - len(live[n])))
        elif op < 0.9:
            disk.fsync(fh)
            durable[n] = bytes(live[n])
        else:
            disk.cut()
            handles = {m: disk.open(m, os.O_RDWR) for m in names}
            live = {m: bytearray(durable[m]) for m in names}
        for m in names:
            assert _read(disk, m) == live[m], f"seed {seed}"
    disk.cut()
    for m in names:
        assert _read(disk, m) == durable[m], f"seed {seed}"
