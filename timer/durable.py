"""Durable file replacement: the new file's bytes and its name both survive a crash."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


def replace_durably(tmp: Path, path: Path) -> None:
    """Rename the already-fsynced ``tmp`` over ``path``, then fsync the directory."""
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        with contextlib.suppress(OSError):
            os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
