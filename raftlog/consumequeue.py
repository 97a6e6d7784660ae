"""ConsumeQueues: per (topic, queue) indexes into the CommitLog.

Each queue is one append-only file of fixed 20-byte units, the unit at index ``n`` describing
the message at queue offset ``n``::

    0                               8               12                              20
    +-------------------------------+---------------+-------------------------------+
    | commitlog_offset (u64)        | size (u32)    | tags_code (i64)               |
    +-------------------------------+---------------+-------------------------------+

``tags_code`` is a hash of the message's tags, or for delayed messages the time it falls due
(ms), which is what the schedule service scans by. ConsumeQueues are derived from the
CommitLog: when one is missing or behind it is rebuilt from the records (see
:meth:`ConsumeQueueStore.repair`).
"""

from __future__ import annotations

import errno
import logging
import os
import struct
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from chronomq.raftlog import durable, record
from chronomq.raftlog.commitlog import CommitLog
from chronomq.raftlog.errors import InvalidInput

log = logging.getLogger(__name__)

UNIT = struct.Struct(">QIq")
UNIT_SIZE = UNIT.size  # 20
#: Open queue files kept by default; a node sizes it from its file-descriptor budget
#: (:mod:`chronomq.cluster.process.fdbudget`).
DEFAULT_MAX_OPEN_FILES = 512
#: How many handles an open that fails with EMFILE/ENFILE closes before trying once more.
_EMFILE_EVICT_FRACTION = 4


@dataclass(frozen=True, slots=True)
class CqUnit:
    queue_offset: int
    commitlog_offset: int
    size: int
    tags_code: int


def tags_hash(tags: str | None) -> int:
    """A stable 63-bit hash of a tag string (0 for none), used as a unit's tags_code."""
    if not tags:
        return 0
    h = 0
    for b in tags.encode():
        h = (h * 31 + b) & 0x7FFF_FFFF_FFFF_FFFF
    return h


class ConsumeQueueStore:
    """Every ConsumeQueue of a node, with a bounded LRU cache of open file handles.

    ``max_open_files`` bounds the cache. Evicting a handle never fsyncs under
    ``flush="async"`` (a closed file's written pages stay in the page cache and reach disk like
    any other; :meth:`sync` is what makes them durable), so a node writing to more queues than
    it keeps open pays an ``open``/``close`` per miss, not an ``fsync``. Under
    ``flush="sync"`` the store syncs each queue when it writes it, so an evicted handle has
    nothing dirty in the common case, and the rare dirty one is synced before it is closed.
    An open that fails for want of descriptors (EMFILE, ENFILE) evicts a quarter of the cache
    and tries once more before giving up.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        max_open_files: int = DEFAULT_MAX_OPEN_FILES,
        flush: str = "async",
    ) -> None:
        if max_open_files < 1:
            raise ValueError("max_open_files must be at least 1")
        self.directory = Path(directory)
        durable.make_dirs(self.directory)
        self.max_open_files = max_open_files
        self.flush = flush
        self.evictions = 0
        self.emfile_retries = 0
        self._lock = threading.RLock()
        self._fds: OrderedDict[tuple[str, int], int] = OrderedDict()
        self._units: dict[tuple[str, int], int] = {}
        self._dirty: set[tuple[str, int]] = set()
        # (topic, queue) -> (CommitLog floor, min offset found, unit count then)
        self._min_cache: dict[tuple[str, int], tuple[int, int, int]] = {}
        self._scan()

    # ------------------------------------------------------------------ files

    def _path(self, topic: str, queue_id: int) -> Path:
        """The file of a queue: always inside :attr:`directory`, whatever the caller passes."""
        record.validate_topic(topic)  # no separator, no "..", no NUL: one plain directory name
        if not 0 <= queue_id < 100_000:
            raise InvalidInput(f"queue id {queue_id} is out of range", "queue")
        path = self.directory / topic / f"{queue_id:05d}"
        if path.parent.parent != self.directory or topic in (".", ".."):
            raise InvalidInput(f"topic {topic!r} does not name a directory", "topic")
        return path

    def _scan(self) -> None:
        for topic_dir in self.directory.iterdir():
            if not topic_dir.is_dir():
                continue
            for qfile in topic_dir.iterdir():
                if not qfile.name.isdigit():
                    continue
                size = qfile.stat().st_size
                if size % UNIT_SIZE:
                    log.warning("ConsumeQueue %s has a torn unit: truncating", qfile)
                    os.truncate(qfile, size - size % UNIT_SIZE)
                    size -= size % UNIT_SIZE
                self._units[(topic_dir.name, int(qfile.name))] = size // UNIT_SIZE

    def _fd(self, key: tuple[str, int]) -> int:
        fd = self._fds.get(key)
        if fd is not None:
            self._fds.move_to_end(key)
            return fd
        path = self._path(*key)
        # A topic's folder is not synced in its parent: ConsumeQueues are derived, and a store
        # that finds one short after a power cut rebuilds it from the CommitLog.
        path.parent.mkdir(parents=True, exist_ok=True)
        # Make room first: the cache never holds more than its budget, even for a moment.
        while len(self._fds) >= self.max_open_files:
            self._evict_oldest()
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            if exc.errno not in (errno.EMFILE, errno.ENFILE) or not self._fds:
                raise
            # Out of descriptors (sockets took them): give some back and try once more.
            self.emfile_retries += 1
            for _ in range(max(1, len(self._fds) // _EMFILE_EVICT_FRACTION)):
                self._evict_oldest()
            log.warning(
                "out of file descriptors opening ConsumeQueue %s/%d: closed cached handles, "
                "%d left open",
                key[0],
                key[1],
                len(self._fds),
            )
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        self._fds[key] = fd
        return fd

    def _evict_oldest(self) -> None:
        old_key, old_fd = self._fds.popitem(last=False)
        self.evictions += 1
        if self.flush == "sync" and old_key in self._dirty:
            durable.fsync(old_fd, self._path(*old_key))
            self._dirty.discard(old_key)
        os.close(old_fd)

    @property
    def open_files(self) -> int:
        return len(self._fds)

    # ------------------------------------------------------------------ queries

    def queues(self) -> dict[tuple[str, int], int]:
        """Every queue on disk and its unit count (= its max offset)."""
        return dict(self._units)

    def max_offset(self, topic: str, queue_id: int) -> int:
        return self._units.get((topic, queue_id), 0)

    def min_offset(self, topic: str, queue_id: int, floor: int) -> int:
        """The first queue offset whose message lies at or above CommitLog offset ``floor``
        (where retention left the CommitLog starting); units below it point at deleted bytes.

        Units are in CommitLog order, so this is a binary search, cached per queue until the
        floor or the queue changes.
        """
        key = (topic, queue_id)
        if floor <= 0:
            return 0
        with self._lock:
            count = self._units.get(key, 0)
            lo = 0
            cached = self._min_cache.get(key)
            if cached is not None and cached[0] <= floor and cached[1] <= count:
                if cached[0] == floor and cached[1] < cached[2]:
                    return cached[1]  # a unit at or above the floor was found: it stays first
                lo = cached[1]  # the floor only rose, or new units came: search on from there
            hi = count
            while lo < hi:
                mid = (lo + hi) // 2
                if self.read(topic, queue_id, mid, 1)[0].commitlog_offset < floor:
                    lo = mid + 1
                else:
                    hi = mid
            self._min_cache[key] = (floor, lo, count)
            return lo

    def read(self, topic: str, queue_id: int, offset: int, max_units: int) -> list[CqUnit]:
        key = (topic, queue_id)
        with self._lock:
            end = min(self._units.get(key, 0), offset + max_units)
            if offset >= end or offset < 0:
                return []
            data = os.pread(self._fd(key), (end - offset) * UNIT_SIZE, offset * UNIT_SIZE)
        return [
            CqUnit(offset + i, phys, size, tags)
            for i, (phys, size, tags) in enumerate(UNIT.iter_unpack(data))
        ]

    # ------------------------------------------------------------------ writing

    def append(self, topic: str, queue_id: int, first_offset: int, units: bytes) -> None:
        """Append packed units whose first queue offset is ``first_offset``."""
        key = (topic, queue_id)
        with self._lock:
            have = self._units.get(key, 0)
            if first_offset != have:
                raise ValueError(
                    f"ConsumeQueue {topic}/{queue_id} has {have} units, not {first_offset}"
                )
            fd = self._fd(key)
            try:
                written = os.pwrite(fd, units, have * UNIT_SIZE)
            except OSError as exc:
                raise OSError(exc.errno, exc.strerror, str(self._path(*key))) from exc
            if written != len(units):  # a full disk writes part, then refuses the rest
                os.ftruncate(fd, have * UNIT_SIZE)
                raise OSError(errno.ENOSPC, "short write", str(self._path(*key)))
            self._units[key] = have + len(units) // UNIT_SIZE
            self._dirty.add(key)

    def truncate(self, topic: str, queue_id: int, units: int) -> None:
        key = (topic, queue_id)
        with self._lock:
            if self._units.get(key, 0) <= units:
                return
            self._min_cache.pop(key, None)
            os.ftruncate(self._fd(key), units * UNIT_SIZE)
            self._units[key] = units
            self._dirty.add(key)

    def drop(self, topic: str, queue_id: int) -> None:
        key = (topic, queue_id)
        with self._lock:
            fd = self._fds.pop(key, None)
            if fd is not None:
                os.close(fd)
            self._units.pop(key, None)
            self._min_cache.pop(key, None)
            self._dirty.discard(key)
            self._path(topic, queue_id).unlink(missing_ok=True)

    def sync(self) -> None:
        with self._lock:
            for key in list(self._dirty):
                durable.fsync(self._fd(key), self._path(*key))
            self._dirty.clear()

    def close(self) -> None:
        with self._lock:
            if self.flush == "sync":
                self.sync()
            else:
                # Evicted queues' pages are in the page cache like the rest of an async node's
                # writes; reopening thousands of files to fsync them would only slow the stop.
                for key, fd in self._fds.items():
                    if key in self._dirty:
                        durable.fsync(fd, self._path(*key))
                self._dirty.clear()
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()

    # ------------------------------------------------------------------ repair

    def _cut_past(self, key: tuple[str, int], end: int) -> int:
        # Units are in CommitLog order: find the first that ends past ``end``.
        lo, hi = 0, self._units.get(key, 0)
        while lo < hi:
            mid = (lo + hi) // 2
            unit = self.read(key[0], key[1], mid, 1)[0]
            if unit.commitlog_offset + unit.size <= end:
                lo = mid + 1
            else:
                hi = mid
        self.truncate(key[0], key[1], lo)
        return lo

    def repair(self, commitlog: CommitLog, expected: Mapping[tuple[str, int], int]) -> int:
        """Make every queue hold exactly ``expected[queue]`` units, all pointing below the
        CommitLog's end; queues not in ``expected`` are dropped.

        Units past the expected count are cut; missing ones are rebuilt by scanning the
        CommitLog from the earliest point any queue needs. Returns the records re-dispatched.
        """
        length = commitlog.length
        with self._lock:
            for key in list(self._units):
                if key not in expected:
                    self.drop(*key)
            behind: dict[tuple[str, int], int] = {}
            scan_from = length
            for key, want in expected.items():
                self.truncate(key[0], key[1], want)
                # A unit must point inside the CommitLog; a stale tail from before a truncation
                # of the CommitLog is cut here.
                have = self._cut_past(key, length)
                if have < want:
                    behind[key] = have
                    if have == 0:
                        scan_from = commitlog.min_offset
                    else:
                        last = self.read(key[0], key[1], have - 1, 1)[0]
                        scan_from = min(scan_from, last.commitlog_offset + last.size)
            if not behind:
                return 0
            log.info("rebuilding %d ConsumeQueues from CommitLog offset %d", len(behind), scan_from)
            count = 0
            pending: dict[tuple[str, int], list[bytes]] = {}
            for phys, data in commitlog.iter_records(scan_from, length):
                msg = record.decode(data)
                key = (msg.topic, msg.queue_id)
                if key not in behind:
                    continue
                if msg.queue_offset != behind[key]:
                    continue
                units = pending.setdefault(key, [])
                units.append(UNIT.pack(phys, msg.size, msg.tags_code))
                behind[key] += 1
                count += 1
            for key, units in pending.items():
                self.append(key[0], key[1], self._units.get(key, 0), b"".join(units))
            for key, want in expected.items():
                if self._units.get(key, 0) != want:
                    raise ValueError(
                        f"ConsumeQueue {key[0]}/{key[1]} rebuilt to {self._units.get(key, 0)} units, expected {want}"
                    )
            return count


def pack_units(units: Iterable[tuple[int, int, int]]) -> bytes:
    return b"".join(UNIT.pack(p, s, t) for p, s, t in units)
