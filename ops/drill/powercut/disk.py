"""The disk a power cut acts on: a directory passed through, remembering what was not synced.

Every operation goes straight to a backing directory (``STATE/tree``), so reads see what was
written, as on a running machine. Alongside, :class:`Disk` keeps what a real disk has not
promised to keep, and :meth:`Disk.cut` throws exactly that away:

- **File data.** The first time a block (4 KiB) of a file's durable content is about to be
  overwritten or truncated away after the file's last ``fsync``/``fdatasync``, its durable
  bytes are copied aside, with the file's durable size. A cut truncates the file back to that
  size and writes the saved blocks back. Appends beyond the durable size cost nothing to
  record. A write through a handle opened ``O_SYNC``/``O_DSYNC`` is durable at once. ``msync``
  of a mapping reaches here as the kernel's writes of the dirty pages, then an fsync.
- **Directory entries.** The first change to a directory (create, mkdir, symlink, unlink,
  rmdir, rename in or out) after its last fsync snapshots its entries (name -> inode). A cut
  puts every directory back to its snapshot, from the root down: a file created without an
  fsync of its directory is gone, even if the file itself was fsynced (POSIX allows that;
  ext4 would often keep it), a rename reverts, an unlinked file comes back. A file whose
  durable entry is unlinked or renamed over is kept aside (``STATE/attic``) until then.

Not modelled: permissions and times (passed through, never reverted), hard links (refused),
``RENAME_EXCHANGE`` (refused), torn writes inside a block (a cut keeps all or nothing of a
write: the strict model, where unsynced means lost). Inodes are the backing filesystem's, which
renames keep.

Nothing here knows about FUSE: :mod:`chronomq.ops.drill.powercut.fuse` is the thin layer that calls in,
and the unit tests drive this class directly too.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
import threading
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BLOCK_BYTES = 4096
RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2
_SAMPLE = 20
"""How many paths a cut report lists (counts are always whole)."""


def _err(code: int, path: str | os.PathLike[str] = "") -> OSError:
    return OSError(code, os.strerror(code), str(path))


@dataclass(frozen=True, slots=True)
class Entry:
    """A directory entry as a cut restores it: which inode, of which kind (``S_IFMT``)."""

    ino: int
    kind: int


@dataclass(slots=True)
class _FileUndo:
    """A file's durable state: its size at its last sync, and the blocks changed since."""

    durable_size: int
    blocks: dict[int, bytes] = field(default_factory=dict)


@dataclass(slots=True)
class _Handle:
    fd: int
    ino: int
    sync_writes: bool


@dataclass(frozen=True, slots=True)
class CutReport:
    files_reverted: int
    """Files placed back whose data or size had changed since their last sync."""
    bytes_reverted: int
    """Unsynced bytes dropped: saved blocks written back plus the size cut off."""
    entries_lost: int
    """Paths that held something before the cut and hold nothing (or another file) after."""
    entries_back: int
    """Paths that hold a file again (unlinked or renamed away without a directory sync)."""
    handles_closed: int
    lost: tuple[str, ...] = ()
    back: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        return {
            "files_reverted": self.files_reverted,
            "bytes_reverted": self.bytes_reverted,
            "entries_lost": self.entries_lost,
            "entries_back": self.entries_back,
            "handles_closed": self.handles_closed,
            "lost": list(self.lost),
            "back": list(self.back),
        }


class Disk:
    """Pass-through file operations on ``state_dir/tree`` that a :meth:`cut` can take back.

    Paths are absolute within the disk (``/a/b``), as FUSE gives them. Errors are ``OSError``
    with the errno the caller should see. Thread-safe: one lock orders every change with its
    bookkeeping and with a cut.
    """

    def __init__(self, state_dir: str | os.PathLike[str]) -> None:
        state = Path(state_dir)
        self.tree = state / "tree"
        self.attic = state / "attic"
        self._stage = state / "stage"
        self.tree.mkdir(parents=True, exist_ok=True)
        # What the backing directory holds when we start is durable; anything kept aside by
        # an earlier run is unreachable.
        for d in (self.attic, self._stage):
            shutil.rmtree(d, ignore_errors=True)
        self.attic.mkdir()
        self._lock = threading.RLock()
        self._files: dict[int, _FileUndo] = {}
        self._dirs: dict[int, dict[str, Entry]] = {}
        self._refs: Counter[int] = Counter()
        """How many directory snapshots name each inode: those must survive an unlink."""
        self._handles: dict[int, _Handle] = {}
        self._next_fh = 1
        self.cuts = 0
        self.fsyncs = 0
        self.dir_fsyncs = 0

    # ------------------------------------------------------------------ paths and handles

    def real(self, path: str) -> Path:
        rel = path.lstrip("/")
        if any(part in ("..",) for part in rel.split("/")):
            raise _err(errno.EINVAL, path)
        return self.tree / rel if rel else self.tree

    def _handle(self, fh: int) -> _Handle:
        h = self._handles.get(fh)
        if h is None:
            # Opened before a cut: the machine that opened it has rebooted.
            raise _err(errno.EIO)
        return h

    def _new_handle(self, fd: int, ino: int, flags: int) -> int:
        fh = self._next_fh
        self._next_fh += 1
        self._handles[fh] = _Handle(fd, ino, bool(flags & (os.O_SYNC | os.O_DSYNC)))
        return fh

    # ------------------------------------------------------------------ bookkeeping

    def _undo(self, ino: int, fd: int) -> _FileUndo:
        undo = self._files.get(ino)
        if undo is None:
            undo = self._files[ino] = _FileUndo(os.fstat(fd).st_size)
        return undo

    def _save_range(self, ino: int, fd: int, start: int, end: int) -> None:
        """Copy aside the durable bytes of ``[start, end)`` not copied since the last sync."""
        undo = self._undo(ino, fd)
        end = min(end, undo.durable_size)
        if start >= end:
            return
        for b in range(start // BLOCK_BYTES, (end - 1) // BLOCK_BYTES + 1):
            if b not in undo.blocks:
                at = b * BLOCK_BYTES
                undo.blocks[b] = os.pread(fd, min(BLOCK_BYTES, undo.durable_size - at), at)

    def _entries(self, directory: Path) -> dict[str, Entry]:
        out = {}
        with os.scandir(directory) as it:
            for e in it:
                st = e.stat(follow_symlinks=False)
                out[e.name] = Entry(st.st_ino, stat.S_IFMT(st.st_mode))
        return out

    def _dir_changing(self, directory: Path) -> None:
        ino = os.lstat(directory).st_ino
        if ino not in self._dirs:
            snap = self._entries(directory)
            self._dirs[ino] = snap
            self._refs.update(e.ino for e in snap.values())

    def _drop_snapshot(self, ino: int) -> None:
        snap = self._dirs.pop(ino, None)
        if snap is None:
            return
        self._refs.subtract(e.ino for e in snap.values())
        for e in snap.values():
            if self._refs[e.ino] <= 0:
                del self._refs[e.ino]
                self._bury(e.ino)

    def _bury(self, ino: int) -> None:
        """Delete an inode kept aside that no snapshot names any more."""
        kept = self.attic / str(ino)
        if not os.path.lexists(kept):
            return
        if kept.is_dir() and not kept.is_symlink():
            self._drop_snapshot(ino)
            shutil.rmtree(kept, ignore_errors=True)
        else:
            kept.unlink()
        self._files.pop(ino, None)

    def _remove(self, real: Path, st: os.stat_result) -> None:
        """Remove ``real`` (its parent's snapshot taken): aside if a snapshot names it."""
        if self._refs[st.st_ino] > 0:
            os.rename(real, self.attic / str(st.st_ino))
            return
        if stat.S_ISDIR(st.st_mode):
            os.rmdir(real)
            self._drop_snapshot(st.st_ino)
        else:
            os.unlink(real)
        self._files.pop(st.st_ino, None)

    def _born(self, real: Path) -> int:
        """A new inode at ``real``: nothing of it is durable yet."""
        st = os.lstat(real)
        self._files.pop(st.st_ino, None)
        self._drop_snapshot(st.st_ino)
        if stat.S_ISDIR(st.st_mode):
            self._dirs[st.st_ino] = {}
        elif stat.S_ISREG(st.st_mode):
            self._files[st.st_ino] = _FileUndo(0)
        return st.st_ino

    # ------------------------------------------------------------------ reads

    def getattr(self, path: str | None, fh: int | None = None) -> os.stat_result:
        if fh is not None and fh in self._handles:
            return os.fstat(self._handles[fh].fd)
        if path is None:
            raise _err(errno.EIO)
        return os.lstat(self.real(path))

    def readdir(self, path: str) -> list[tuple[str, int, int]]:
        """``(name, inode, mode)`` of each entry (FUSE hides an entry whose inode is 0)."""
        real = self.real(path)
        out = []
        with os.scandir(real) as it:
            for e in it:
                st = e.stat(follow_symlinks=False)
                out.append((e.name, st.st_ino, st.st_mode))
        return out

    def readlink(self, path: str) -> str:
        return os.readlink(self.real(path))

    def read(self, fh: int, size: int, offset: int) -> bytes:
        return os.pread(self._handle(fh).fd, size, offset)

    def statfs(self) -> os.statvfs_result:
        return os.statvfs(self.tree)

    # ------------------------------------------------------------------ files

    def open(self, path: str, flags: int) -> int:
        real = self.real(path)
        with self._lock:
            # Always read-write (we run as root): saving a block before a write reads it.
            fd = os.open(real, os.O_RDWR | (flags & os.O_NOFOLLOW))
            try:
                ino = os.fstat(fd).st_ino
                if flags & os.O_TRUNC:
                    self._save_range(ino, fd, 0, os.fstat(fd).st_size)
                    os.ftruncate(fd, 0)
            except BaseException:
                os.close(fd)
                raise
            return self._new_handle(fd, ino, flags)

    def create(self, path: str, mode: int, flags: int) -> int:
        real = self.real(path)
        with self._lock:
            if os.path.lexists(real):
                if flags & os.O_EXCL:
                    raise _err(errno.EEXIST, path)
                return self.open(path, flags)
            self._dir_changing(real.parent)
            fd = os.open(real, os.O_RDWR | os.O_CREAT | os.O_EXCL, mode)
            ino = self._born(real)
            return self._new_handle(fd, ino, flags)

    def write(self, fh: int, data: bytes, offset: int) -> int:
        with self._lock:
            h = self._handle(fh)
            self._save_range(h.ino, h.fd, offset, offset + len(data))
            n = os.pwrite(h.fd, data, offset)
            if h.sync_writes:
                self._files.pop(h.ino, None)
            return n

    def truncate(self, path: str | None, length: int, fh: int | None = None) -> None:
        with self._lock:
            if fh is not None and fh in self._handles:
                h = self._handles[fh]
                self._save_range(h.ino, h.fd, length, os.fstat(h.fd).st_size)
                os.ftruncate(h.fd, length)
                return
            if path is None:
                raise _err(errno.EIO)
            fd = os.open(self.real(path), os.O_RDWR)
            try:
                self._save_range(os.fstat(fd).st_ino, fd, length, os.fstat(fd).st_size)
                os.ftruncate(fd, length)
            finally:
                os.close(fd)

    def fallocate(self, fh: int, mode: int, offset: int, length: int) -> None:
        with self._lock:
            h = self._handle(fh)
            if mode == 0:
                self._undo(h.ino, h.fd)  # the size it grows to is not durable
                os.posix_fallocate(h.fd, offset, length)
            elif mode != 1:  # FALLOC_FL_KEEP_SIZE alone changes nothing one can read
                raise _err(errno.EOPNOTSUPP)

    def fsync(self, fh: int) -> None:
        with self._lock:
            h = self._handle(fh)
            self._files.pop(h.ino, None)
            self.fsyncs += 1

    def release(self, fh: int) -> None:
        with self._lock:
            h = self._handles.pop(fh, None)
            if h is not None:
                os.close(h.fd)

    # ------------------------------------------------------------------ directories

    def fsyncdir(self, path: str) -> None:
        with self._lock:
            self._drop_snapshot(os.lstat(self.real(path)).st_ino)
            self.dir_fsyncs += 1

    def mkdir(self, path: str, mode: int) -> None:
        real = self.real(path)
        with self._lock:
            self._dir_changing(real.parent)
            os.mkdir(real, mode)
            self._born(real)

    def symlink(self, path: str, target: str) -> None:
        real = self.real(path)
        with self._lock:
            self._dir_changing(real.parent)
            os.symlink(target, real)
            self._born(real)

    def unlink(self, path: str) -> None:
        real = self.real(path)
        with self._lock:
            st = os.lstat(real)
            if stat.S_ISDIR(st.st_mode):
                raise _err(errno.EISDIR, path)
            self._dir_changing(real.parent)
            self._remove(real, st)

    def rmdir(self, path: str) -> None:
        real = self.real(path)
        with self._lock:
            st = os.lstat(real)
            if not stat.S_ISDIR(st.st_mode):
                raise _err(errno.ENOTDIR, path)
            if os.listdir(real):
                raise _err(errno.ENOTEMPTY, path)
            self._dir_changing(real.parent)
            self._remove(real, st)

    def rename(self, old: str, new: str, flags: int = 0) -> None:
        src, dst = self.real(old), self.real(new)
        with self._lock:
            if flags & RENAME_EXCHANGE:
                raise _err(errno.EINVAL, new)
            st = os.lstat(src)
            try:
                st_dst: os.stat_result | None = os.lstat(dst)
            except FileNotFoundError:
                st_dst = None
            if st_dst is not None:
                if flags & RENAME_NOREPLACE:
                    raise _err(errno.EEXIST, new)
                if st_dst.st_ino == st.st_ino:
                    return
                if stat.S_ISDIR(st_dst.st_mode) != stat.S_ISDIR(st.st_mode):
                    raise _err(errno.EISDIR if stat.S_ISDIR(st_dst.st_mode) else errno.ENOTDIR)
                if stat.S_ISDIR(st_dst.st_mode) and os.listdir(dst):
                    raise _err(errno.ENOTEMPTY, new)
            self._dir_changing(src.parent)
            self._dir_changing(dst.parent)
            if st_dst is not None:
                self._remove(dst, st_dst)
            os.rename(src, dst)

    def link(self, path: str, target: str) -> None:
        raise _err(errno.EPERM, path)

    def chmod(self, path: str, mode: int) -> None:
        os.chmod(self.real(path), mode)

    def chown(self, path: str, uid: int, gid: int) -> None:
        os.chown(self.real(path), uid, gid, follow_symlinks=False)

    def utimens(self, path: str, times_ns: tuple[int, int] | None) -> None:
        if times_ns is None:
            os.utime(self.real(path), follow_symlinks=False)
        else:
            os.utime(self.real(path), ns=times_ns, follow_symlinks=False)

    # ------------------------------------------------------------------ the cut

    def status(self) -> dict[str, int]:
        with self._lock:
            return {
                "unsynced_files": len(self._files),
                "unsynced_dirs": len(self._dirs),
                "kept_aside": len(os.listdir(self.attic)),
                "open_handles": len(self._handles),
                "fsyncs": self.fsyncs,
                "dir_fsyncs": self.dir_fsyncs,
                "cuts": self.cuts,
            }

    def sync_all(self) -> None:
        """Make everything durable as it stands (``sync(2)`` for the whole disk)."""
        with self._lock:
            for ino in list(self._dirs):
                self._drop_snapshot(ino)
            self._files.clear()

    def _locations(self) -> tuple[dict[int, Path], dict[str, int]]:
        """Where each inode is now (the tree and the attic), and the tree's paths."""
        where: dict[int, Path] = {}
        paths: dict[str, int] = {}
        for top, dirs, files in os.walk(self.tree):
            for name in dirs + files:
                p = Path(top) / name
                ino = os.lstat(p).st_ino
                where.setdefault(ino, p)
                paths[str(p.relative_to(self.tree))] = ino
        for name in os.listdir(self.attic):
            where.setdefault(int(name), self.attic / name)
        return where, paths

    def _durable_plan(self, where: dict[int, Path]) -> list[tuple[str, Entry]]:
        """The durable tree, parents before children: (relative path, entry)."""
        plan: list[tuple[str, Entry]] = []
        seen_dirs = {os.lstat(self.tree).st_ino}
        stack: list[tuple[int, str, Path]] = [(os.lstat(self.tree).st_ino, "", self.tree)]
        while stack:
            ino, rel, location = stack.pop()
            entries = self._dirs.get(ino)
            if entries is None:
                entries = self._entries(location)
            for name, e in sorted(entries.items()):
                if e.ino not in where:
                    continue  # cannot happen while every named inode is kept; be safe
                if e.kind == stat.S_IFDIR:
                    if e.ino in seen_dirs:
                        continue  # a directory renamed between two unsynced parents
                    seen_dirs.add(e.ino)
                    stack.append((e.ino, f"{rel}{name}/", where[e.ino]))
                plan.append((f"{rel}{name}", e))
        plan.sort(key=lambda item: item[0].count("/"))
        return plan

    def cut(self) -> CutReport:
        """Lose power: put back the durable state of every file and directory.

        Handles open before the cut answer EIO from now on (a write-back of pages a killed
        process dirtied must not land on the restored files)."""
        with self._lock:
            closed = len(self._handles)
            for h in self._handles.values():
                with contextlib.suppress(OSError):
                    os.close(h.fd)
            self._handles.clear()
            where, before = self._locations()
            plan = self._durable_plan(where)

            # Everything goes to a staging directory by inode, then back where it belongs.
            shutil.rmtree(self._stage, ignore_errors=True)
            self._stage.mkdir()
            for top, dirs, files in os.walk(self.tree, topdown=False):
                for name in files + dirs:
                    p = Path(top) / name
                    target = self._stage / str(os.lstat(p).st_ino)
                    if os.path.lexists(target):
                        os.unlink(p)  # a second name of one inode
                    else:
                        os.rename(p, target)
            for name in os.listdir(self.attic):
                os.rename(self.attic / name, self._stage / name)

            placed: dict[int, Path] = {}
            for rel, e in plan:
                dst = self.tree / rel
                if e.ino in placed:
                    os.link(placed[e.ino], dst)
                else:
                    os.rename(self._stage / str(e.ino), dst)
                    placed[e.ino] = dst

            reverted = 0
            dropped = 0
            for ino, undo in self._files.items():
                path = placed.get(ino)
                if path is None:
                    continue
                fd = os.open(path, os.O_RDWR)
                try:
                    size = os.fstat(fd).st_size
                    if size == undo.durable_size and not undo.blocks:
                        continue
                    reverted += 1
                    dropped += max(0, size - undo.durable_size)
                    os.ftruncate(fd, undo.durable_size)
                    for b, data in undo.blocks.items():
                        os.pwrite(fd, data, b * BLOCK_BYTES)
                        dropped += len(data)
                finally:
                    os.close(fd)

            shutil.rmtree(self._stage, ignore_errors=True)
            self._files.clear()
            self._dirs.clear()
            self._refs.clear()
            self.cuts += 1
            after = {rel: e.ino for rel, e in plan}
            lost = sorted(p for p, ino in before.items() if after.get(p) != ino)
            back = sorted(p for p, ino in after.items() if before.get(p) != ino)
            return CutReport(
                files_reverted=reverted,
                bytes_reverted=dropped,
                entries_lost=len(lost),
                entries_back=len(back),
                handles_closed=closed,
                lost=tuple(lost[:_SAMPLE]),
                back=tuple(back[:_SAMPLE]),
            )
