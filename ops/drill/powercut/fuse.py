"""The power-cut filesystem process: a :class:`~chronomq.ops.drill.powercut.disk.Disk` served over FUSE.

``python -m ops.drill.powercut MOUNTPOINT --state DIR --control SOCKET`` mounts ``DIR/tree`` at
``MOUNTPOINT`` (libfuse 3 through ``mfusepy``) and answers on the unix socket ``SOCKET``, one
JSON object per line each way: ``{"op": "cut"}`` (lose power now; the answer is the cut's
report), ``{"op": "status"}``, ``{"op": "sync"}`` (everything durable as it stands),
``{"op": "ping"}``. Unmounting (``fusermount3 -u``, or SIGTERM/SIGINT) ends it.

The kernel must not remember what the disk forgets: entries and attributes are not cached
(timeouts 0), nor are pages across opens (no ``kernel_cache``; an ``open`` drops the file's
cached pages), and pages go through the page cache (no ``direct_io``) so that ``mmap`` works;
a dirty mapped page reaches the disk as a write when the kernel writes it back, on ``msync``
(which then sends an fsync) or when the last process holding the file exits. An unlinked file
that is still open is removed at once (``hard_remove``) rather than renamed to a hidden name.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import logging
import os
import socket
import sys
import threading
from pathlib import Path
from typing import Any

import mfusepy

from chronomq.ops.drill.powercut.disk import Disk

_STAT_FIELDS = (
    "st_mode",
    "st_ino",
    "st_nlink",
    "st_uid",
    "st_gid",
    "st_size",
    "st_blocks",
    "st_blksize",
    "st_rdev",
)


def _stat_dict(st: os.stat_result) -> dict[str, Any]:
    out: dict[str, Any] = {k: getattr(st, k) for k in _STAT_FIELDS}
    out["st_atime"] = st.st_atime_ns
    out["st_mtime"] = st.st_mtime_ns
    out["st_ctime"] = st.st_ctime_ns
    return out


class PowerCutOperations(mfusepy.Operations):
    """The FUSE operations: each one a call into the :class:`Disk`."""

    use_ns = True

    def __init__(self, disk: Disk) -> None:
        self.disk = disk

    def init_with_config(self, conn: Any, config: Any) -> None:
        if config is None:
            return
        config.entry_timeout = 0.0
        config.negative_timeout = 0.0
        config.attr_timeout = 0.0
        config.hard_remove = 1
        config.use_ino = 1
        config.direct_io = 0
        config.kernel_cache = 0
        config.auto_cache = 0

    def getattr(self, path: str | None, fh: int | None = None) -> dict[str, Any]:
        return _stat_dict(self.disk.getattr(path, fh))

    def readdir(self, path: str, fh: int) -> list[tuple[str, dict[str, int], int]]:
        here = self.disk.getattr(path)
        dots = [(".", {"st_ino": here.st_ino, "st_mode": here.st_mode}, 0)]
        dots.append(("..", {"st_ino": 1, "st_mode": here.st_mode}, 0))
        return dots + [
            (name, {"st_ino": ino, "st_mode": mode}, 0)
            for name, ino, mode in self.disk.readdir(path)
        ]

    def readlink(self, path: str) -> str:
        return self.disk.readlink(path)

    def statfs(self, path: str) -> dict[str, int]:
        sv = self.disk.statfs()
        return {
            k: getattr(sv, k)
            for k in (
                "f_bsize",
                "f_frsize",
                "f_blocks",
                "f_bfree",
                "f_bavail",
                "f_files",
                "f_ffree",
                "f_favail",
                "f_namemax",
            )
        }

    def access(self, path: str, amode: int) -> int:
        if not os.access(self.disk.real(path), amode, follow_symlinks=False):
            raise mfusepy.FuseOSError(errno.EACCES)
        return 0

    def open(self, path: str, flags: int) -> int:
        return self.disk.open(path, flags)

    def create(self, path: str, mode: int, flags: int = os.O_WRONLY) -> int:
        return self.disk.create(path, mode, flags)

    def read(self, path: str | None, size: int, offset: int, fh: int) -> bytes:
        return self.disk.read(fh, size, offset)

    def write(self, path: str | None, data: bytes, offset: int, fh: int) -> int:
        return self.disk.write(fh, data, offset)

    def truncate(self, path: str | None, length: int, fh: int | None = None) -> int:
        self.disk.truncate(path, length, fh)
        return 0

    def fallocate(self, path: str | None, mode: int, offset: int, size: int, fh: int) -> int:
        self.disk.fallocate(fh, mode, offset, size)
        return 0

    def flush(self, path: str | None, fh: int) -> int:
        return 0

    def release(self, path: str | None, fh: int) -> int:
        self.disk.release(fh)
        return 0

    def fsync(self, path: str | None, datasync: int, fh: int) -> int:
        self.disk.fsync(fh)
        return 0

    def opendir(self, path: str) -> int:
        return 0

    def releasedir(self, path: str | None, fh: int) -> int:
        return 0

    def fsyncdir(self, path: str | None, datasync: int, fh: int) -> int:
        if path is None:
            raise mfusepy.FuseOSError(errno.EIO)
        self.disk.fsyncdir(path)
        return 0

    def mkdir(self, path: str, mode: int) -> int:
        self.disk.mkdir(path, mode)
        return 0

    def rmdir(self, path: str) -> int:
        self.disk.rmdir(path)
        return 0

    def unlink(self, path: str) -> int:
        self.disk.unlink(path)
        return 0

    def symlink(self, target: str, source: str) -> int:
        self.disk.symlink(target, source)
        return 0

    def link(self, target: str, source: str) -> int:
        self.disk.link(target, source)
        return 0

    def rename(self, old: str, new: str, flags: int = 0) -> int:
        self.disk.rename(old, new, flags)
        return 0

    def chmod(self, path: str, mode: int) -> int:
        self.disk.chmod(path, mode)
        return 0

    def chown(self, path: str, uid: int, gid: int) -> int:
        self.disk.chown(path, uid, gid)
        return 0

    def utimens(self, path: str, times: tuple[int, int] | None = None) -> int:
        self.disk.utimens(path, times)
        return 0


class _Fuse(mfusepy.FUSE):
    """mfusepy's FUSE, passing what it drops on libfuse 3: a truncate's file handle (so an
    open file that was unlinked can still be truncated) and a rename's flags."""

    def truncate_fuse_3(self, path: bytes | None, length: int, fip: Any) -> int:
        fh = fip.contents.fh if fip else None
        decoded = None if path is None else path.decode(self.encoding, self.errors)
        return int(self.operations.truncate(decoded, length, fh))

    def rename_fuse_3(self, old: bytes, new: bytes, flags: int) -> int:
        return int(
            self.operations.rename(
                old.decode(self.encoding, self.errors),
                new.decode(self.encoding, self.errors),
                flags,
            )
        )


def _answer(disk: Disk, request: dict[str, Any]) -> dict[str, Any]:
    op = request.get("op")
    if op == "cut":
        return {"ok": True, "report": disk.cut().as_dict()}
    if op == "status":
        return {"ok": True, "status": disk.status()}
    if op == "sync":
        disk.sync_all()
        return {"ok": True}
    if op == "ping":
        return {"ok": True}
    return {"ok": False, "error": f"unknown op {op!r}"}


def _serve_control(disk: Disk, server: socket.socket) -> None:
    while True:
        try:
            conn, _ = server.accept()
        except OSError:
            return  # closed: unmounting
        with conn, conn.makefile("rwb") as f:
            for line in f:
                try:
                    answer = _answer(disk, json.loads(line))
                except Exception as exc:  # report it to the caller, keep serving
                    answer = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
                f.write(json.dumps(answer).encode() + b"\n")
                f.flush()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ops.drill.powercut", description=__doc__)
    p.add_argument("mountpoint")
    p.add_argument("--state", required=True, help="backing directory (tree/ and attic/)")
    p.add_argument("--control", required=True, help="unix socket to listen on")
    p.add_argument("--debug", action="store_true")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.debug else logging.WARNING)
    disk = Disk(args.state)
    control = Path(args.control)
    with contextlib.suppress(FileNotFoundError):
        control.unlink()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o077)
    try:
        server.bind(str(control))
    finally:
        os.umask(old_umask)
    server.listen(4)
    threading.Thread(target=_serve_control, args=(disk, server), daemon=True).start()
    try:
        _Fuse(
            PowerCutOperations(disk),
            args.mountpoint,
            foreground=True,
            fsname="powercut",
            subtype="powercut",
        )
    finally:
        server.close()
        with contextlib.suppress(FileNotFoundError):
            control.unlink()
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
