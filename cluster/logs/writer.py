"""A log writer that never slows the broker.

``write(record)`` only appends the record object to a bounded in-memory buffer and returns; a
thread of the writer's own encodes the records with orjson and writes them as JSON lines to
``<directory>/<node>/<type>-<seq>.jsonl``, one open file per record type, rotated when a file
reaches ``rotate_bytes``. Every drain (each ``drain_interval_ms``, or sooner when the buffer is
half full) ends with the lines handed to the operating system, so a killed process loses at most
what it logged in the last drain interval (an OS crash: what the page cache held). When the
buffer is full the record is dropped and counted; the writer thread logs how many were dropped
(and writes a ``log_drop`` event) at most once per flush interval. No I/O and no waiting happen
on the caller's thread.

``write_rows(record_type, rows, render)`` queues many records in one step: the rows are raw
values the caller already has (tuples, objects it will not change again), and ``render`` turns
one row into its line on the writer thread. The caller's cost is then one append for a whole
batch, whatever its size; the buffer still counts, and drops, the rows one by one.

Sampling keeps a fraction ``sample_rate`` of the latency and replication records, decided by a
hash of the message id (latency) or of the Raft index (replication), so every node and every
stage keeps the same messages and commands and the report can still join them. Events are never
sampled.
"""

from __future__ import annotations

import collections
import io
import logging
import os
import re
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from chronomq.cluster.logs.schema import (
    EventRecord,
    EventType,
    LatencyRecord,
    Record,
    RecordType,
    ReplicationRecord,
    encode,
)

_log = logging.getLogger("chronomq.logwriter")

_SEQ_DIGITS = 6
_DRAIN_BATCH = 4096


def keep_sample(key: str | int, rate: float) -> bool:
    """True if the item named ``key`` is in the sample of fraction ``rate`` (deterministic)."""
    if rate >= 1.0:
        return True
    if rate <= 0.0:
        return False
    data = key.encode() if isinstance(key, str) else key.to_bytes(8, "little", signed=True)
    return zlib.crc32(data) < rate * 0x1_0000_0000


@dataclass(frozen=True, slots=True)
class LogWriterConfig:
    """Settings of one node's log writer. Invalid values raise ``ValueError`` naming the key."""

    enabled: bool = True
    sample_rate: float = 1.0
    buffer_records: int = 65_536
    rotate_bytes: int = 64 * 1024 * 1024
    flush_interval_ms: int = 1_000
    drain_interval_ms: int = 50
    #: Rotated files older than this are deleted (0: kept whatever their age).
    retention_ms: int = 0
    #: Rotated files are deleted, oldest first, while all files together exceed this (0: no
    #: bound). The file being written is never deleted.
    max_total_bytes: int = 0
    #: How often the writer thread looks for files to delete (also after every rotation).
    prune_interval_ms: int = 60_000

    def __post_init__(self) -> None:
        if self.retention_ms < 0 or self.max_total_bytes < 0:
            raise ValueError("log retention_ms and max_total_bytes must be >= 0")
        if not 0.0 <= self.sample_rate <= 1.0:
            raise ValueError(f"log sample_rate must be within 0..1, got {self.sample_rate}")
        if self.buffer_records < 1:
            raise ValueError(f"log buffer_records must be >= 1, got {self.buffer_records}")
        if self.rotate_bytes < 1024:
            raise ValueError(f"log rotate_bytes must be >= 1024, got {self.rotate_bytes}")
        if self.flush_interval_ms < 1:
            raise ValueError(f"log flush_interval_ms must be >= 1, got {self.flush_interval_ms}")
        if not 1 <= self.drain_interval_ms <= self.flush_interval_ms:
            raise ValueError(
                "log drain_interval_ms must be within 1..flush_interval_ms, "
                f"got {self.drain_interval_ms}"
            )


@dataclass(frozen=True, slots=True)
class _Rows:
    """Rows queued by :meth:`LogWriter.write_rows`, rendered into lines on the writer thread."""

    TYPE: RecordType
    rows: Sequence[Any]
    render: Callable[[Any], bytes]
    sample_key: Callable[[Any], str | int] | None


@dataclass(frozen=True, slots=True)
class WriterStats:
    accepted: int
    written: int
    dropped: int
    sampled_out: int
    write_errors: int
    files_opened: int


class RotatingFile:
    """``<directory>/<type>-<seq>.jsonl`` files of one record type, rotated by size.

    Starts after the highest sequence number already present, so a restarted node never
    appends to a file whose last line a crash may have torn.
    """

    def __init__(self, directory: Path, record_type: RecordType, rotate_bytes: int) -> None:
        self._directory = directory
        self._prefix = record_type.value
        self._rotate_bytes = rotate_bytes
        self._seq = self._last_seq()
        self._file: io.BufferedWriter | None = None
        self._size = 0
        self.opened = 0

    def _last_seq(self) -> int:
        pattern = re.compile(rf"^{re.escape(self._prefix)}-(\d+)\.jsonl$")
        seqs = [int(m.group(1)) for p in self._directory.iterdir() if (m := pattern.match(p.name))]
        return max(seqs, default=0)

    def path(self) -> Path:
        return self._directory / f"{self._prefix}-{self._seq:0{_SEQ_DIGITS}d}.jsonl"

    def _open_next(self) -> None:
        self.close()
        self._seq += 1
        self._file = open(self.path(), "ab")  # noqa: SIM115 - kept open across batches
        self._size = 0
        self.opened += 1

    def write(self, lines: list[bytes]) -> None:
        """Append whole lines; a line never straddles two files."""
        start = 0
        while start < len(lines):
            if self._file is None or (
                self._size > 0 and self._size + len(lines[start]) > self._rotate_bytes
            ):
                self._open_next()
            assert self._file is not None
            room = self._rotate_bytes - self._size
            end, taken = start, 0
            # Lines that fit; a single line longer than a whole file goes alone into a new one.
            while end < len(lines) and (
                taken + len(lines[end]) <= room or (end == start and self._size == 0)
            ):
                taken += len(lines[end])
                end += 1
            self._file.write(b"".join(lines[start:end]))
            self._size += taken
            start = end

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


@dataclass(frozen=True, slots=True)
class _LogFile:
    path: Path
    record_type: str
    seq: int
    size_bytes: int
    mtime_ms: int


_FILE_NAME = re.compile(r"^(?P<type>[a-z_]+)-(?P<seq>\d+)\.jsonl$")


def prune(directory: Path, now_ms: int, retention_ms: int, max_total_bytes: int) -> list[Path]:
    """Delete rotated log files in ``directory``: those older than ``retention_ms`` (by
    modification time), then the oldest while all files exceed ``max_total_bytes``. The newest
    file of each record type (the one being written) is never deleted. Returns what went.
    """
    files: list[_LogFile] = []
    for entry in os.scandir(directory):
        m = _FILE_NAME.match(entry.name)
        if m is None or not entry.is_file(follow_symlinks=False):
            continue
        st = entry.stat(follow_symlinks=False)
        files.append(
            _LogFile(
                Path(entry.path), m["type"], int(m["seq"]), st.st_size, st.st_mtime_ns // 1_000_000
            )
        )
    current: dict[str, _LogFile] = {}
    for f in files:
        if f.record_type not in current or f.seq > current[f.record_type].seq:
            current[f.record_type] = f
    rotated = sorted(
        (f for f in files if current[f.record_type] is not f), key=lambda f: (f.mtime_ms, f.seq)
    )
    total = sum(f.size_bytes for f in files)
    deleted: list[Path] = []
    for f in rotated:
        too_old = retention_ms > 0 and now_ms - f.mtime_ms > retention_ms
        too_big = max_total_bytes > 0 and total > max_total_bytes
        if not (too_old or too_big):
            continue
        try:
            f.path.unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:
            _log.error("cannot delete old log file %s: %s", f.path, exc)
            continue
        total -= f.size_bytes
        deleted.append(f.path)
    return deleted


class LogWriter:
    """Background JSON-lines writer of one node. Start with :meth:`start`, end with :meth:`close`.

    Thread-safe: any thread may call :meth:`write` and :meth:`write_rows` (the event loop, the
    Raft thread). The buffer holds at most ``buffer_records`` records, give or take one batch per
    thread writing at the very same moment. A record written while :meth:`close` runs may miss
    the final drain; it then shows as ``accepted - written`` in :meth:`stats`. It is also a
    context manager.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        node: str,
        config: LogWriterConfig | None = None,
        *,
        wall_ms: Callable[[], int] = lambda: time.time_ns() // 1_000_000,
    ) -> None:
        if not node or "/" in node or node in (".", ".."):
            raise ValueError(f"node must be a plain directory name, got {node!r}")
        self.config = config or LogWriterConfig()
        self.node = node
        self.directory = Path(directory).absolute() / node
        self._buffer: collections.deque[Record | _Rows] = collections.deque()
        self._buffered = 0  # records in the buffer (a _Rows entry counts its rows)
        self._wake = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._count_lock = threading.Lock()
        self._accepted = 0
        self._dropped = 0
        self._sampled_out = 0
        self._written = 0
        self._write_errors = 0
        self._drops_reported = 0
        self._files: dict[RecordType, RotatingFile] = {}
        self._high_water = max(1, self.config.buffer_records // 2)
        self._wall_ms = wall_ms
        self._pruned_at_ms: int | None = None
        self._rotations_seen = 0
        self.files_deleted = 0

    # -- caller side: no I/O, no waiting ----------------------------------------------------

    def write(self, record: Record) -> bool:
        """Queue ``record``; False if it was switched off, sampled out or dropped (buffer full)."""
        config = self.config
        if not config.enabled or self._stopping:
            return False
        if config.sample_rate < 1.0:
            if isinstance(record, LatencyRecord):
                key: str | int | None = record.msg_id
            elif isinstance(record, ReplicationRecord):
                key = record.index
            else:
                key = None
            if key is not None and not keep_sample(key, config.sample_rate):
                with self._count_lock:
                    self._sampled_out += 1
                return False
        return self._enqueue(record, 1)

    def write_rows(
        self,
        record_type: RecordType,
        rows: Sequence[Any],
        render: Callable[[Any], bytes],
        sample_key: Callable[[Any], str | int] | None = None,
    ) -> bool:
        """Queue ``rows``, each to become one ``record_type`` line ``render(row)`` (a bytes line
        with its newline, e.g. from :func:`chronomq.cluster.logs.schema.encode`), rendered on the writer thread.

        ``rows`` must not change after the call. With a sample rate below 1, a row is kept iff
        ``keep_sample(sample_key(row), rate)`` (no ``sample_key``: every row is kept); rows
        sampled out count as accepted until the writer thread drops them. The rows are queued
        all together or, when they do not fit in the buffer, dropped and counted all together.
        False if switched off, empty or dropped. A row whose ``render`` raises is lost and
        counted as a write error.
        """
        config = self.config
        if not config.enabled or self._stopping or not rows:
            return False
        return self._enqueue(_Rows(record_type, rows, render, sample_key), len(rows))

    def _enqueue(self, entry: Record | _Rows, n: int) -> bool:
        if self._buffered + n > self.config.buffer_records:
            with self._count_lock:
                self._dropped += n
            return False
        with self._count_lock:
            self._accepted += n
            self._buffered += n
            size = self._buffered
        self._buffer.append(entry)
        if size >= self._high_water:
            self._wake.set()
        return True

    def reconfigure(
        self, *, enabled: bool | None = None, sample_rate: float | None = None
    ) -> LogWriterConfig:
        """Switch logging on or off, or change the sample rate, while running (any thread)."""
        changes: dict[str, Any] = {}
        if enabled is not None:
            changes["enabled"] = enabled
        if sample_rate is not None:
            changes["sample_rate"] = sample_rate
        self.config = replace(self.config, **changes)
        return self.config

    def stats(self) -> WriterStats:
        with self._count_lock:
            return WriterStats(
                accepted=self._accepted,
                written=self._written,
                dropped=self._dropped,
                sampled_out=self._sampled_out,
                write_errors=self._write_errors,
                files_opened=sum(f.opened for f in self._files.values()),
            )

    @property
    def buffered(self) -> int:
        return self._buffered

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self) -> LogWriter:
        if self._thread is not None:
            raise RuntimeError("log writer already started")
        if self.config.enabled:
            self.directory.mkdir(parents=True, exist_ok=True)
        self._thread = threading.Thread(
            target=self._run, name=f"logwriter-{self.node}", daemon=True
        )
        self._thread.start()
        return self

    def close(self, timeout_s: float = 30.0) -> WriterStats:
        """Stop accepting, write everything buffered, close the files. Returns final stats."""
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                _log.error("log writer %s did not drain within %.1f s", self.node, timeout_s)
        return self.stats()

    def __enter__(self) -> LogWriter:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- writer thread -----------------------------------------------------------------------

    def _run(self) -> None:
        drain_s = self.config.drain_interval_ms / 1000
        flush_s = self.config.flush_interval_ms / 1000
        next_flush = time.monotonic() + flush_s
        while True:
            self._wake.wait(drain_s)
            self._wake.clear()
            stopping = self._stopping
            if self._drain():
                self._flush()  # to the OS now: a killed node loses one drain interval at most
            now = time.monotonic()
            if stopping or now >= next_flush:
                self._report_drops()
                self._flush()
                self.prune_old_files()
                next_flush = now + flush_s
            if stopping:
                break
        for f in self._files.values():
            try:
                f.close()
            except OSError as exc:
                _log.error("log writer %s: closing %s failed: %s", self.node, f.path(), exc)

    def _drain(self) -> int:
        """Write out everything buffered; returns how many records it took."""
        buffer = self._buffer
        taken = 0
        while buffer:
            batch: dict[RecordType, list[bytes]] = {}
            n = 0
            while buffer and n < _DRAIN_BATCH:
                entry = buffer.popleft()
                if isinstance(entry, _Rows):
                    n += len(entry.rows)
                    batch.setdefault(entry.TYPE, []).extend(self._render(entry))
                else:
                    n += 1
                    try:
                        line = encode(entry)
                    except (TypeError, ValueError):  # e.g. an event detail orjson cannot encode
                        _log.exception(
                            "log writer %s: a %s record did not encode", self.node, entry.TYPE
                        )
                        with self._count_lock:
                            self._write_errors += 1
                        continue
                    batch.setdefault(entry.TYPE, []).append(line)
            with self._count_lock:
                self._buffered -= n
            taken += n
            self._write_batch(batch, sum(len(lines) for lines in batch.values()))
        return taken

    def _render(self, entry: _Rows) -> list[bytes]:
        rate = self.config.sample_rate
        key = entry.sample_key
        render = entry.render
        lines: list[bytes] = []
        sampled_out = failed = 0
        for row in entry.rows:
            try:
                if key is not None and rate < 1.0 and not keep_sample(key(row), rate):
                    sampled_out += 1
                    continue
                lines.append(render(row))
            except Exception:
                failed += 1
                if failed == 1:
                    _log.exception("log writer %s: a %s row did not render", self.node, entry.TYPE)
        if sampled_out or failed:
            with self._count_lock:
                self._accepted -= sampled_out
                self._sampled_out += sampled_out
                self._write_errors += failed
        return lines

    def _write_batch(self, batch: dict[RecordType, list[bytes]], n: int) -> None:
        written = 0
        for record_type, lines in batch.items():
            try:
                file = self._files.get(record_type)
                if file is None:
                    self.directory.mkdir(parents=True, exist_ok=True)
                    file = self._files[record_type] = RotatingFile(
                        self.directory, record_type, self.config.rotate_bytes
                    )
                file.write(lines)
                written += len(lines)
            except OSError as exc:
                with self._count_lock:
                    self._write_errors += len(lines)
                _log.error(
                    "log writer %s: lost %d %s records: %s", self.node, len(lines), record_type, exc
                )
        with self._count_lock:
            self._written += written

    def prune_old_files(self, force: bool = False) -> list[Path]:
        """Apply ``retention_ms`` and ``max_total_bytes`` (writer thread): after a rotation,
        and otherwise once per ``prune_interval_ms`` of the wall clock."""
        config = self.config
        if not (config.retention_ms or config.max_total_bytes) or not self.directory.is_dir():
            return []
        now_ms = self._wall_ms()
        rotations = sum(f.opened for f in self._files.values())
        due = (
            force
            or rotations != self._rotations_seen
            or self._pruned_at_ms is None
            or now_ms - self._pruned_at_ms >= config.prune_interval_ms
        )
        if not due:
            return []
        self._rotations_seen = rotations
        self._pruned_at_ms = now_ms
        try:
            deleted = prune(self.directory, now_ms, config.retention_ms, config.max_total_bytes)
        except OSError as exc:
            _log.error("log writer %s: pruning old files failed: %s", self.node, exc)
            return []
        self.files_deleted += len(deleted)
        return deleted

    def _flush(self) -> None:
        for f in self._files.values():
            try:
                f.flush()
            except OSError as exc:
                _log.error("log writer %s: flush of %s failed: %s", self.node, f.path(), exc)

    def _report_drops(self) -> None:
        with self._count_lock:
            dropped = self._dropped
        new = dropped - self._drops_reported
        if new <= 0:
            return
        self._drops_reported = dropped
        _log.warning(
            "log writer %s: buffer full (%d records), dropped %d records (%d in total)",
            self.node,
            self.config.buffer_records,
            new,
            dropped,
        )
        event = EventRecord(
            ts_ms=time.time_ns() // 1_000_000,
            node=self.node,
            type=EventType.LOG_DROP,
            detail={"dropped": new, "dropped_total": dropped},
        )
        self._write_batch({RecordType.EVENTS: [encode(event)]}, 1)
