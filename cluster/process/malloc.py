"""glibc malloc settings for a node process.

A node allocates many short-lived buffers between 128 KiB and a few MiB: Raft commands, HTTP
bodies, append messages to followers. glibc serves the first such buffer from its own mapping,
and when it is freed raises its mmap threshold to that size (up to 32 MiB); from then on those
buffers come from the heap, whose freed space goes back to the system only from its top. The
resident set then grows with what a burst ever allocated, not with what is held: a million
messages left every node 60 to 100 MB larger. A fixed threshold keeps each large buffer in a
mapping of its own, returned when freed, at the cost of an mmap and munmap per buffer.

Set ``MALLOC_MMAP_THRESHOLD_`` (or ``glibc.malloc.mmap_threshold`` in ``GLIBC_TUNABLES``) to
choose another value; nothing is changed then. Other C libraries are left alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import platform

log = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3  # mallopt parameter number in glibc's malloc.h
MMAP_THRESHOLD_BYTES = 128 * 1024  # glibc's initial value, kept fixed


def fix_mmap_threshold() -> bool:
    """Pin glibc's mmap threshold (see the module docstring); True if it was set."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or "mmap_threshold" in os.environ.get(
        "GLIBC_TUNABLES", ""
    ):
        return False
    if platform.libc_ver()[0] != "glibc":
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        done = bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))
    except (OSError, AttributeError) as exc:
        log.debug("mallopt unavailable: %s", exc)
        return False
    return done
