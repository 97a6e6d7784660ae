"""Small helpers that make a file change survive a power cut, and fail-stop when it cannot.

A file's new bytes are durable after ``fsync`` of the file; its name (a create, a rename, an
unlink) only after ``fsync`` of the directory that holds it. An ``fsync`` that fails must
stop the node: Linux may drop the dirty pages it could not write and report success to the
next ``fsync`` of the same file (PostgreSQL's "fsyncgate"), so carrying on would acknowledge
data that is not on disk.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

#: The exit status of a node stopped by a fault of its own storage.
EXIT_STORE_FAULT = 70

#: What a failed ``fsync`` calls with its message: never returns in a node.
FaultHandler = Callable[[str], None]


class StorageFault(OSError):
    """An fsync failed: raised where the fault handler returns (tests), so nothing goes on
    as if the data were durable."""


def fail_stop(message: str) -> None:
    """Log ``message`` and exit at once (no cleanup that could write or sync more)."""
    log.critical("%s: this node stops so that it never acknowledges what its disk lost", message)
    logging.shutdown()
    os._exit(EXIT_STORE_FAULT)


def fsync_failed(what: str | os.PathLike[str], exc: OSError) -> str:
    """The message of a failed fsync of ``what``."""
    return (
        f"fsync of {what} failed ({exc.strerror or exc}): the kernel may have dropped the "
        "unwritten data, and a later fsync could report success without it. Check the disk, "
        "then start the node again: it recovers from what its disk holds and its peers"
    )


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make the names in directory ``path`` durable (after a create, rename or unlink)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_dirs(path: str | os.PathLike[str]) -> Path:
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
        fsync_dir(d.parent)
    return path


def write_atomically(path: str | os.PathLike[str], data: bytes) -> None:
    """Replace ``path`` by a file holding ``data``: either the old or the new file is found
    after a power cut, never a torn or empty one."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)
