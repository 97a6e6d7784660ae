"""Every durable change to a node's files, and the one rule for a failed ``fsync``.

A file's new bytes are durable after ``fsync`` of the file; its name (a create, a rename, an
unlink) only after ``fsync`` of the directory that holds it. This module does both, for every
package of the node: the Raft journal, the CommitLog, the ConsumeQueues, snapshots and the
removal notice (``raftlog``), the TimerLog, the wheel and the timer checkpoint (``timer``).
It lives in ``raftlog``, the lowest package, so that every other one may import it (see
``tests/test_layering.py``); it imports nothing of ours.

The rule:

* **A failed fsync stops the node** (:func:`fault`): Linux may drop the dirty pages it could
  not write and report success to the next ``fsync`` of the same file (PostgreSQL's
  "fsyncgate"), so carrying on, or retrying, would acknowledge data that is not on disk. The
  message names the file; the node exits with :data:`EXIT_STORE_FAULT` (70) at once, without
  cleanup that could write or sync more. Where the fault handler returns (a test's),
  :class:`StorageFault` is raised, so nothing goes on as if the data were durable.
* **A failed write, rename or unlink raises** ``OSError`` naming the file. Nothing was
  acknowledged, and an atomic replace leaves the old file whole, so the caller decides: a
  failed write in apply or in the Raft tick stops the node with the same status
  (``raftlog/machine.py``), a retention pass or a snapshot tries again later. A disk that
  fills up must not stop every replica in the same second.
* Objects that sync a set of files again and again (the journal, the CommitLog) hold a
  :class:`FaultLatch`: after one failed sync every later one fails too.

Writers:

* whole files: :func:`write_atomically` (temp file, fsync, rename, directory fsync), or
  :func:`atomic_file` when the caller writes through the descriptor;
* a file written by someone else (pysyncobj's snapshot): :func:`sync_file`, then
  :func:`replace`;
* logs: :func:`pwrite_all` appends, :func:`fsync` / :func:`fdatasync` make them durable;
* names: :func:`make_dirs`, :func:`replace`, :func:`unlink`, :func:`fsync_dir`.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NoReturn

log = logging.getLogger(__name__)

#: The exit status of a node stopped by a fault of its own storage.
EXIT_STORE_FAULT = 70

#: What a failed ``fsync`` calls with its message: never returns in a node.
FaultHandler = Callable[[str], None]

Where = str | os.PathLike[str]


class StorageFault(OSError):
    """An fsync failed: raised where the fault handler returns (tests), so nothing goes on
    as if the data were durable."""


def fail_stop(message: str) -> None:
    """Log ``message`` and exit at once (no cleanup that could write or sync more)."""
    log.critical("%s: this node stops so that it never acknowledges what its disk lost", message)
    logging.shutdown()
    os._exit(EXIT_STORE_FAULT)


def fsync_failed(what: Where, exc: OSError) -> str:
    """The message of a failed fsync of ``what``."""
    return (
        f"fsync of {os.fspath(what)} failed ({exc.strerror or exc}): the kernel may have "
        "dropped the unwritten data, and a later fsync could report success without it. Check "
        "the disk, then start the node again: it recovers from what its disk holds and its peers"
    )


def fault(what: Where, exc: OSError, on_fault: FaultHandler | None = None) -> NoReturn:
    """Report the failed fsync of ``what`` to ``on_fault`` (by default :func:`fail_stop`),
    then raise :class:`StorageFault` should it return."""
    message = fsync_failed(what, exc)
    (on_fault or fail_stop)(message)
    raise StorageFault(message) from exc


class FaultLatch:
    """The first failed fsync of a set of files, remembered: a fault handler that records
    it, and :meth:`check`, which fails every later sync of the set."""

    def __init__(self, on_fault: FaultHandler | None = None) -> None:
        self._on_fault = on_fault
        #: The message of the first failed fsync, or None.
        self.failed: str | None = None

    def __call__(self, message: str) -> None:
        if self.failed is None:
            self.failed = message
        (self._on_fault or fail_stop)(message)

    def check(self) -> None:
        """Tell the handler again and raise :class:`StorageFault` once a sync has failed."""
        if self.failed is not None:
            self(self.failed)
            raise StorageFault(self.failed)


# ---------------------------------------------------------------------- syncs


def fsync(fd: int, what: Where, *, on_fault: FaultHandler | None = None) -> None:
    """``fsync`` the open file ``fd`` (``what`` names it in the message)."""
    try:
        os.fsync(fd)
    except OSError as exc:
        fault(what, exc, on_fault)


def fdatasync(fd: int, what: Where, *, on_fault: FaultHandler | None = None) -> None:
    """``fdatasync`` the open file ``fd``: its bytes and size, not its times."""
    try:
        os.fdatasync(fd)
    except OSError as exc:
        fault(what, exc, on_fault)


def sync_file(path: Where, *, on_fault: FaultHandler | None = None) -> None:
    """``fsync`` the file at ``path`` (written and closed by code that did not sync it)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        fault(path, exc, on_fault)
    try:
        fsync(fd, path, on_fault=on_fault)
    finally:
        os.close(fd)


def fsync_dir(path: Where, *, on_fault: FaultHandler | None = None) -> None:
    """Make the names in directory ``path`` durable (after a create, rename or unlink)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as exc:
        fault(path, exc, on_fault)
    try:
        fsync(fd, path, on_fault=on_fault)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------- names


def make_dirs(path: Where, *, on_fault: FaultHandler | None = None) -> Path:
    """``mkdir -p path``, each directory it creates made durable in its parent (a directory
    whose name is not synced is gone after a power cut, with everything in it)."""
    path = Path(path)
    missing: list[Path] = []
    p = path
    while not p.exists():
        missing.append(p)
        if p.parent == p:
            break
        p = p.parent
    for d in reversed(missing):
        try:
            d.mkdir()
        except FileExistsError:
            continue
        fsync_dir(d.parent, on_fault=on_fault)
    return path


def _folder(path: Where) -> str:
    return os.path.dirname(os.fspath(path)) or "."


def replace(src: Where, dst: Where, *, on_fault: FaultHandler | None = None) -> None:
    """Rename ``src`` (its bytes already synced) over ``dst``, then sync the directory: after
    a power cut either the old or the new file is found."""
    os.replace(src, dst)
    fsync_dir(_folder(dst), on_fault=on_fault)


def unlink(path: Where, *, missing_ok: bool = False, on_fault: FaultHandler | None = None) -> None:
    """Remove ``path`` and sync its directory, so that a power cut cannot bring it back."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        if not missing_ok:
            raise
    fsync_dir(_folder(path), on_fault=on_fault)


# ---------------------------------------------------------------------- writes


def pwrite_all(fd: int, data: bytes | bytearray | memoryview, at: int, what: Where) -> None:
    """Write all of ``data`` at offset ``at`` of ``fd``; a failure raises ``OSError`` naming
    ``what`` (a full disk writes part, then nothing: ``ENOSPC``)."""
    view = memoryview(data)
    while view:
        try:
            written = os.pwrite(fd, view, at)
        except OSError as exc:
            raise OSError(exc.errno, exc.strerror, os.fspath(what)) from exc
        if written == 0:
            raise OSError(errno.ENOSPC, "No space left on device", os.fspath(what))
        view = view[written:]
        at += written


@contextlib.contextmanager
def atomic_file(
    path: Where,
    *,
    tmp: Where | None = None,
    mode: int = 0o666,
    on_fault: FaultHandler | None = None,
) -> Iterator[int]:
    """Replace ``path`` by what the caller writes to the yielded descriptor: it writes a
    temp file (``tmp``, by default ``path`` + ``.tmp``), which is synced and renamed over
    ``path`` when the block ends without an exception, the directory synced after."""
    tmp = os.fspath(path) + ".tmp" if tmp is None else tmp
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        yield fd
        fsync(fd, tmp, on_fault=on_fault)
    finally:
        os.close(fd)
    replace(tmp, path, on_fault=on_fault)


def write_atomically(
    path: Where,
    data: bytes,
    *,
    tmp: Where | None = None,
    mode: int = 0o666,
    on_fault: FaultHandler | None = None,
) -> None:
    """Replace ``path`` by a file holding ``data``: either the old or the new file is found
    after a power cut, never a torn or empty one."""
    with atomic_file(path, tmp=tmp, mode=mode, on_fault=on_fault) as fd:
        pwrite_all(fd, data, 0, tmp if tmp is not None else os.fspath(path) + ".tmp")
