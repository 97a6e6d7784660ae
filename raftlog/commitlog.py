"""The CommitLog: append-only segment files of message records, addressed by physical offset.

A segment file is named by the physical offset of its first byte (20 digits, as RocketMQ
does) and holds at most ``segment_bytes``. A record never spans two segments: when the next
record does not fit, a blank record fills the rest of the segment. After any write the space
left in a segment is either zero or at least :data:`record.BLANK_SIZE`, so a blank always fits.

``segment_bytes`` decides every record's physical offset, so it must be the same on every
node of a cluster (the snapshot records it and a node refuses a snapshot that disagrees).

Retention deletes whole segments from the head (:meth:`CommitLog.delete_head`): the log is
then ``[min_offset, length)``. The file ``min_offset`` in the directory records where it
starts, written before any segment is unlinked, so a restart tells a segment removed by
retention from a missing one. Offsets never move: ``length`` and every physical offset stay
what they were.

Durability: ``flush="sync"`` fsyncs after every append; ``flush="async"`` fsyncs from a
background thread every ``flush_interval_ms``. Either way the bytes are in the page cache as
soon as ``append`` returns, so a killed process loses nothing. A new segment's name is made
durable (its directory fsynced) when it is created. A failed fsync calls ``on_fault`` (by
default the process stops, see :mod:`chronomq.raftlog.durable`) and every later :meth:`sync` fails:
the kernel may have dropped the pages it could not write.

The replicated store (:mod:`chronomq.raftlog.store`) runs it with ``flush="async"`` under both of the
node's settings: between snapshots the CommitLog is rebuilt from the Raft journal, which is
what ``flush="sync"`` syncs before acknowledging; the store syncs the CommitLog before each
snapshot that covers it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from chronomq.raftlog import durable, record
from chronomq.raftlog.errors import StoreCorruption

log = logging.getLogger(__name__)

DEFAULT_SEGMENT_BYTES = 128 * 1024 * 1024
MIN_SEGMENT_BYTES = 4096
MIN_OFFSET_FILE = "min_offset"
#: How long the descriptor of a deleted segment stays open: a reader that looked the segment
#: up just before (a catch-up transfer, a pull) must never read another file through a
#: reused descriptor number.
RETIRED_FD_GRACE_S = 30.0


@dataclass(slots=True)
class _Segment:
    base: int
    path: Path
    fd: int
    size: int

    @property
    def end(self) -> int:
        return self.base + self.size


class CommitLog:
    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        segment_bytes: int = DEFAULT_SEGMENT_BYTES,
        flush: str = "async",
        flush_interval_ms: int = 500,
        on_fault: durable.FaultHandler = durable.fail_stop,
    ) -> None:
        if segment_bytes < MIN_SEGMENT_BYTES:
            raise ValueError(f"segment_bytes must be >= {MIN_SEGMENT_BYTES}, got {segment_bytes}")
        if flush not in ("async", "sync"):
            raise ValueError(f"flush must be 'async' or 'sync', got {flush!r}")
        self.directory = Path(directory)
        durable.make_dirs(self.directory)
        self.segment_bytes = segment_bytes
        self.flush_mode = flush
        self._faults = durable.FaultLatch(on_fault)
        self._lock = threading.RLock()
        self._segments: list[_Segment] = []
        self._dirty: set[int] = set()
        self._closed = False
        self._retired: list[tuple[float, int]] = []  # (monotonic time retired, fd)
        self.segments_deleted = 0
        self.bytes_deleted = 0
        self._open_segments()
        self._flusher: threading.Thread | None = None
        self._flush_wakeup = threading.Event()
        self._flush_interval_s = flush_interval_ms / 1000
        if flush == "async":
            self._flusher = threading.Thread(
                target=self._flush_loop, name="commitlog-flush", daemon=True
            )
            self._flusher.start()

    # ------------------------------------------------------------------ opening

    def _open_segments(self) -> None:
        names = sorted(
            p for p in self.directory.iterdir() if p.name.isdigit() and len(p.name) == 20
        )
        # Check every name before removing anything below: with a changed segment_bytes the
        # first segment looks partial and the rest would be taken for leftovers.
        for path in names:
            if int(path.name) % self.segment_bytes:
                raise StoreCorruption(
                    f"CommitLog segment {path.name} does not start on a segment boundary of "
                    f"{self.segment_bytes} bytes: was segment_bytes changed?"
                )
        expected = self._read_min_offset()
        if expected and not any(int(p.name) >= expected for p in names):
            raise StoreCorruption(
                f"{self.directory / MIN_OFFSET_FILE} says the CommitLog starts at {expected}, "
                "but no segment from there on exists: restore the directory, or remove it "
                "whole to let the node fetch the log again"
            )
        for path in [p for p in names if int(p.name) < expected]:
            # Retention recorded the new start, then stopped before unlinking these.
            log.info(
                "removing CommitLog segment %s below the retained start %d", path.name, expected
            )
            path.unlink()
        names = [p for p in names if int(p.name) >= expected]
        for path in names:
            base = int(path.name)
            if base != expected:
                raise StoreCorruption(
                    f"CommitLog segment {path.name} starts at {base}, expected {expected}: a segment is missing"
                )
            if base % self.segment_bytes:
                raise StoreCorruption(
                    f"CommitLog segment {path.name} does not start on a segment boundary of "
                    f"{self.segment_bytes} bytes: was segment_bytes changed?"
                )
            fd = os.open(path, os.O_RDWR)
            size = os.fstat(fd).st_size
            if size > self.segment_bytes:
                os.close(fd)
                raise StoreCorruption(f"CommitLog segment {path.name} is larger than segment_bytes")
            self._segments.append(_Segment(base, path, fd, size))
            expected = base + self.segment_bytes
            if size < self.segment_bytes:
                break
        # Anything after a partial segment is left over from a crash in the middle of a roll.
        for path in names[len(self._segments) :]:
            log.warning("removing CommitLog segment %s past the end of the log", path.name)
            path.unlink()

    def _read_min_offset(self) -> int:
        path = self.directory / MIN_OFFSET_FILE
        try:
            text = path.read_text().strip()
        except FileNotFoundError:
            return 0
        if not text.isdigit() or int(text) % self.segment_bytes:
            raise StoreCorruption(
                f"{path} holds {text!r}, not a segment boundary of {self.segment_bytes} bytes"
            )
        return int(text)

    def _write_min_offset(self, offset: int) -> None:
        path = self.directory / MIN_OFFSET_FILE
        if offset == 0:
            path.unlink(missing_ok=True)
            return
        durable.write_atomically(path, f"{offset}\n".encode(), on_fault=self._faults)

    # ------------------------------------------------------------------ sizes

    @property
    def length(self) -> int:
        """The physical offset one past the last byte written."""
        segments = self._segments
        return segments[-1].end if segments else 0

    @property
    def min_offset(self) -> int:
        """The first physical offset still held (0 until retention deletes a segment)."""
        segments = self._segments
        return segments[0].base if segments else 0

    def segments(self) -> list[tuple[int, int, float]]:
        """``(base, end, mtime)`` of every segment, oldest first (mtime in seconds)."""
        with self._lock:
            return [(seg.base, seg.end, os.fstat(seg.fd).st_mtime) for seg in self._segments]

    # ------------------------------------------------------------------ retention

    def delete_head(self, upto: int) -> int:
        """Delete every segment that ends at or below ``upto``, never the last one.

        Records the new start first (see the module docstring). Returns the segments deleted.
        """
        with self._lock:
            doomed = [seg for seg in self._segments[:-1] if seg.end <= upto]
            if not doomed:
                return 0
            keep = self._segments[len(doomed) :]
            self._write_min_offset(keep[0].base)
            self._segments = keep
            now = time.monotonic()
            for seg in doomed:
                if seg.fd in self._dirty:
                    durable.fsync(seg.fd, self._what, on_fault=self._faults)
                    self._dirty.discard(seg.fd)
                seg.path.unlink()
                self._retired.append((now, seg.fd))
                self.bytes_deleted += seg.size
            self.segments_deleted += len(doomed)
            self._close_retired(now - RETIRED_FD_GRACE_S)
            log.info(
                "retention deleted %d CommitLog segment(s) [%d, %d)",
                len(doomed),
                doomed[0].base,
                doomed[-1].end,
            )
            return len(doomed)

    def _close_retired(self, before: float) -> None:
        still = []
        for when, fd in self._retired:
            if when <= before:
                os.close(fd)
            else:
                still.append((when, fd))
        self._retired = still

    def close_retired(self) -> None:
        """Close descriptors of deleted segments past their grace period (frees their space)."""
        with self._lock:
            self._close_retired(time.monotonic() - RETIRED_FD_GRACE_S)

    # ------------------------------------------------------------------ writing

    def _segment_for_write(self, at: int) -> _Segment:
        base = at - at % self.segment_bytes
        if self._segments and self._segments[-1].base == base:
            return self._segments[-1]
        path = self.directory / f"{base:020d}"
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise OSError(exc.errno, exc.strerror, str(path)) from exc
        seg = _Segment(base, path, fd, 0)
        self._segments = [*self._segments, seg]
        # The new name must outlive a power cut as its bytes will.
        durable.fsync_dir(self.directory, on_fault=self._faults)
        return seg

    def layout(self, sizes: Sequence[int]) -> tuple[list[int], list[tuple[int, int]]]:
        """Where records of ``sizes`` would go if appended now.

        Returns each record's physical offset and the blanks ``(offset, size)`` that go before
        them. Pure: changes nothing.
        """
        seg_bytes = self.segment_bytes
        pos = self.length
        offsets: list[int] = []
        blanks: list[tuple[int, int]] = []
        for size in sizes:
            if size > seg_bytes or (size != seg_bytes and size > seg_bytes - record.BLANK_SIZE):
                # Past seg_bytes - BLANK_SIZE a record would leave a gap too small for a blank.
                raise ValueError(f"a record of {size} bytes does not fit a segment of {seg_bytes}")
            left = seg_bytes - pos % seg_bytes
            if size != left and size > left - record.BLANK_SIZE:
                blanks.append((pos, left))
                pos += left
            offsets.append(pos)
            pos += size
        return offsets, blanks

    def append_records(
        self, blob: bytearray, sizes: Sequence[int], queue_offsets: Sequence[int]
    ) -> list[int]:
        """Append the records packed back to back in ``blob``.

        Each record is sealed (offsets and CRC written) in place. Returns the physical offsets.
        """
        offsets, blanks = self.layout(sizes)
        at = 0
        for size, qoff, phys in zip(sizes, queue_offsets, offsets, strict=True):
            record.seal(blob, at, qoff, phys)
            at += size
        if not blanks:
            self.write_raw(self.length, blob)
            return offsets
        # Interleave the blanks with the slices of the blob that lie between them.
        view = memoryview(blob)
        pos = self.length
        at = 0
        for blank_at, blank_size in blanks:
            n = blank_at - pos
            if n:
                self.write_raw(pos, view[at : at + n])
                at += n
            self.write_raw(blank_at, record.blank(blank_size))
            pos = blank_at + blank_size
        if at < len(blob):
            self.write_raw(pos, view[at:])
        return offsets

    def write_raw(self, at: int, data: bytes | bytearray | memoryview) -> None:
        """Write bytes at the end of the log (``at`` must equal :attr:`length`)."""
        with self._lock:
            if at != self.length:
                raise StoreCorruption(f"write at {at} but the CommitLog ends at {self.length}")
            view = memoryview(data)
            while view:
                seg = self._segment_for_write(at)
                room = self.segment_bytes - seg.size
                chunk = view[:room]
                self._dirty.add(seg.fd)
                durable.pwrite_all(seg.fd, chunk, seg.size, seg.path)
                seg.size += len(chunk)
                at += len(chunk)
                view = view[len(chunk) :]
            if self.flush_mode == "sync":
                self.sync()

    # ------------------------------------------------------------------ reading

    def _segment_at(self, at: int) -> _Segment:
        segments = self._segments
        if not segments or at < segments[0].base or at >= segments[-1].end:
            raise IndexError(
                f"physical offset {at} is outside the CommitLog [{self.min_offset}, {self.length})"
            )
        idx = (at - segments[0].base) // self.segment_bytes
        return segments[idx]

    def read(self, at: int, size: int) -> bytes:
        """Read ``size`` bytes at physical offset ``at`` (within one segment)."""
        with self._lock:
            seg = self._segment_at(at)
            if at + size > seg.end:
                raise IndexError(f"read of {size} bytes at {at} runs past the end of its segment")
            return os.pread(seg.fd, size, at - seg.base)

    def read_range(self, start: int, end: int) -> bytes:
        """The bytes of ``[start, end)``, across segment boundaries."""
        return b"".join(os.pread(fd, n, off) for fd, off, n in self.ranges(start, end))

    def read_message(self, at: int, size: int | None = None) -> record.Message:
        if size is None:
            size, _magic = record.peek(self.read(at, record.BLANK_SIZE))
        return record.decode(self.read(at, size))

    def iter_records(
        self, start: int, end: int | None = None, chunk_bytes: int = 4 << 20
    ) -> Iterator[tuple[int, bytes]]:
        """Yield ``(physical_offset, record_bytes)`` of every message record in ``[start, end)``.

        Blank records are skipped. Raises :class:`StoreCorruption` on a bad record.
        """
        end = self.length if end is None else end
        pos = start
        while pos < end:
            seg = self._segment_at(pos)
            stop = min(end, seg.end)
            data = os.pread(seg.fd, min(chunk_bytes, stop - pos), pos - seg.base)
            at = 0
            while at < len(data):
                if len(data) - at < record.BLANK_SIZE:
                    break
                size, magic = record.peek(data, at)
                if at + size > len(data):
                    if at == 0:
                        if pos + size > stop:
                            # Also what a corrupt size looks like: never loop on it.
                            raise StoreCorruption(
                                f"record at {pos} of {size} bytes runs past {stop}"
                            )
                        # One record larger than the chunk: read it whole.
                        data = os.pread(seg.fd, size, pos - seg.base)
                        continue
                    break
                record.check(data, at)
                if magic == record.MESSAGE_MAGIC:
                    yield pos + at, data[at : at + size]
                at += size
            if at == 0:
                raise StoreCorruption(f"record at {pos} is cut short")
            pos += at

    def ranges(self, start: int, end: int) -> Iterator[tuple[int, int, int]]:
        """``(fd, file_offset, count)`` pieces covering ``[start, end)``, for ``os.sendfile``."""
        pos = start
        while pos < end:
            seg = self._segment_at(pos)
            n = min(end, seg.end) - pos
            yield seg.fd, pos - seg.base, n
            pos += n

    # ------------------------------------------------------------------ recovery

    def recover(self, start: int = 0) -> int:
        """Check records from ``start`` to the end; truncate at the first bad one (a torn tail).

        Returns the new length.
        """
        good = start
        try:
            pos = start
            end = self.length
            while pos < end:
                seg = self._segment_at(pos)
                data = os.pread(seg.fd, seg.end - pos, pos - seg.base)
                at = 0
                while at < len(data):
                    at += record.check(data, at)
                    good = pos + at
                pos = seg.end
        except StoreCorruption as exc:
            log.warning(
                "CommitLog torn tail at %d (%s): truncating %d bytes", good, exc, self.length - good
            )
        if good < self.length:
            self.truncate(good)
        return good

    def truncate(self, length: int) -> None:
        """Drop everything from ``length`` on."""
        with self._lock:
            if length > self.length:
                raise ValueError(
                    f"cannot truncate to {length}: the CommitLog ends at {self.length}"
                )
            start = self.min_offset
            if 0 < length < start:
                raise StoreCorruption(
                    f"cannot truncate the CommitLog to {length}: retention deleted the bytes "
                    f"below {start} (file {self.directory / MIN_OFFSET_FILE})"
                )
            if length == 0 and start:
                self._write_min_offset(0)
                start = 0
            keep: list[_Segment] = []
            unlinked = False
            for seg in self._segments:
                if seg.base < length or seg.base == length == start:
                    if seg.end > length:
                        os.ftruncate(seg.fd, length - seg.base)
                        seg.size = length - seg.base
                    keep.append(seg)
                else:
                    self._dirty.discard(seg.fd)
                    os.close(seg.fd)
                    seg.path.unlink()
                    unlinked = True
            self._segments = keep
            self._dirty = {seg.fd for seg in keep}
            self.sync()
            if unlinked:
                durable.fsync_dir(self.directory, on_fault=self._faults)

    # ------------------------------------------------------------------ durability

    def sync(self) -> None:
        """Make every byte written so far durable; on a failed fsync, ``on_fault``."""
        with self._lock:
            self._faults.check()
            for fd in self._dirty:
                durable.fsync(fd, self._what, on_fault=self._faults)
            self._dirty.clear()

    @property
    def _what(self) -> str:
        """The CommitLog's segments, as a failed fsync's message names them."""
        return f"the CommitLog in {self.directory}"

    def _flush_loop(self) -> None:
        while not self._closed:
            self._flush_wakeup.wait(self._flush_interval_s)
            if self._closed:
                break
            try:
                self.sync()
            except durable.StorageFault:
                return  # on_fault has been told (a node has stopped by now)

    def close(self) -> None:
        if self._closed:
            return
        self.sync()
        self._closed = True
        self._flush_wakeup.set()
        if self._flusher is not None:
            self._flusher.join(timeout=5)
        with self._lock:
            for seg in self._segments:
                os.close(seg.fd)
            self._segments = []
            self._close_retired(float("inf"))
