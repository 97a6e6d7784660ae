"""Disk room of a node's replicated log: when it stops taking Raft entries and applying them
for want of space, and when it takes them again.

The leader's produce guard (:mod:`chronomq.cluster.node.disk`) refuses writes long before a
member of its majority gets near full. This is the last line below it, on every node: under
:func:`floor_bytes` of free space (or after a write failed with ENOSPC) the node *pauses*: as a
follower it takes no new entries from the leader (its appends are answered without them, so
the leader sends them again later) and it applies none; as a leader it proposes nothing. It
keeps serving reads of what it holds, and reports its free space with every acknowledgement.
It resumes once :func:`resume_bytes` are free (retention deleted segments, the journal was
compacted, the disk grew). Nothing is lost: entries it did not take are still in the leader's
log, committed ones still in its own journal.

:class:`RoomWatch` is the decision, without I/O: it is fed ``(free, total)`` samples and the
bytes about to be written, and says whether they may be.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

MIN_FLOOR_BYTES = 2 * 1024 * 1024
FLOOR_RATIO = 0.02
#: How often the free space is read (``os.statvfs``) at most; bytes written since the last
#: reading are subtracted from it meanwhile.
SAMPLE_INTERVAL_S = 0.05


def floor_bytes(total_bytes: int) -> int:
    """Below this much free space a node pauses (see the module)."""
    return max(MIN_FLOOR_BYTES, int(total_bytes * FLOOR_RATIO))


def resume_bytes(total_bytes: int) -> int:
    """A paused node resumes with this much free space."""
    return 2 * floor_bytes(total_bytes)


@dataclass(frozen=True, slots=True)
class Room:
    free_bytes: int
    total_bytes: int


@dataclass(frozen=True, slots=True)
class Pause:
    """Why a node paused, from when (``since_s``, monotonic)."""

    reason: str
    since_s: float


class RoomWatch:
    """Whether this node may write ``n`` more bytes of Raft entries or applied state."""

    def __init__(self) -> None:
        self.pause: Pause | None = None
        self.pauses = 0

    def allows(self, room: Room, need_bytes: int, now_s: float) -> bool:
        """True when ``need_bytes`` fit above the floor; pauses (or stays paused) otherwise.
        A paused node needs :func:`resume_bytes` free before it takes anything again."""
        if room.total_bytes <= 0:
            return True  # nothing known: the disk is not this module's to guess
        floor = floor_bytes(room.total_bytes)
        if self.pause is not None:
            if room.free_bytes - need_bytes < resume_bytes(room.total_bytes):
                return False
            self.pause = None
            return True
        if room.free_bytes - need_bytes >= floor:
            return True
        self.hit(
            f"{room.free_bytes / 2**20:.1f} MiB free, {need_bytes / 2**20:.1f} MiB to write, "
            f"below the floor of {floor / 2**20:.1f} MiB",
            now_s,
        )
        return False

    def hit(self, reason: str, now_s: float) -> None:
        """Pause now (a write failed with ENOSPC, or the floor was reached)."""
        if self.pause is None:
            self.pauses += 1
            self.pause = Pause(reason, now_s)


class RoomGauge:
    """Free space of the data directory's disk: ``os.statvfs`` at most every
    :data:`SAMPLE_INTERVAL_S`, less the bytes :meth:`spent` since (thread-safe)."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        statvfs: Callable[[str], Any] = os.statvfs,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._path = os.fspath(path)
        self._statvfs = statvfs
        self._clock = clock
        self._lock = threading.Lock()
        self._at = float("-inf")
        self._room = Room(0, 0)
        self._spent = 0

    def room(self) -> Room:
        now = self._clock()
        with self._lock:
            if now - self._at >= SAMPLE_INTERVAL_S:
                try:
                    st = self._statvfs(self._path)
                    self._room = Room(st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize)
                    self._spent = 0
                except OSError:
                    pass  # the last reading stands
                self._at = now
            return Room(max(0, self._room.free_bytes - self._spent), self._room.total_bytes)

    def spent(self, n: int) -> None:
        with self._lock:
            self._spent += n
