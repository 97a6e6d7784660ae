"""The Raft journal: pysyncobj's log entries and its term and vote, safe against a power cut.

pysyncobj's own ``FileJournal`` writes through mmap, with no checksum and no fsync, and
saves term and vote by a rename that is never synced. :class:`DurableJournal` replaces it
(``raftlog/machine.py`` hands it to ``SyncObj``) with the same interface.

The file ``journal``, records appended with ``pwrite``::

    +------------------+---------+----------+
    | magic (16 bytes) | version | reserved |      header, 24 bytes
    | CHRONOMQ-RAFTLOG | u32 = 2 | u32 = 0  |
    +--------+-------+-------+-------+-------+-----------------+
    | length | crc   | index | term  | group | command         |   one record per entry
    | u32    | u32   | u64   | u64   | u64   | length-24 bytes |
    +--------+-------+-------+-------+-------+-----------------+

``crc`` is the CRC32 of the length field and of everything after the crc field. ``group`` is
the number of syncs this journal had begun when the record was written. Integers are
little-endian. The file ends where the records end: no end offset to keep in step.

Durability. ``flush="sync"``: nothing is acknowledged before :meth:`DurableJournal.sync`
(one ``fdatasync`` for every entry appended since the last, see ``raftlog/machine.py``).
``flush="async"``: a thread syncs every ``flush_interval_ms``. Either way a truncation and
the rewrite that drops entries covered by a snapshot are synced before the next write, the
directory is synced after the file is created or replaced (which also makes durable the
snapshot that pysyncobj renamed into the same directory just before), and term and vote
(``journal.meta``, JSON) are replaced atomically and synced before pysyncobj sends the vote.
The commit index, saved once a second, is only a hint (``journal.commit``, not synced), and
read back only under ``flush="sync"``: under ``"async"`` a restarted node applies nothing past
its snapshot before a leader's commit index says what is committed.

Recovery. A record that fails its length or CRC is a torn write when it belongs to the last
sync groups (:data:`TORN_GROUPS`): written after the last completed sync, so never
acknowledged under ``flush="sync"``; it is cut with everything after it (a power cut may keep
later pages and lose earlier ones). A bad record followed by sound records written after it
was synced is damage; it is refused (see :mod:`chronomq.raftlog.journalcheck`). A journal in pysyncobj's format 1 is read strictly and rewritten
in this format.

An ``fsync`` that fails calls ``on_fault`` (by default the node stops, see
:mod:`chronomq.raftlog.durable`), and every later sync fails too.
"""

from __future__ import annotations

import contextlib
import logging
import os
import struct
import threading
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from pysyncobj.journal import Journal

from chronomq.raftlog import durable, safepickle

log = logging.getLogger(__name__)

MAGIC = b"CHRONOMQ-RAFTLOG"
VERSION = 2
#: ``v`` of ``journal.meta`` (JSON: ``v``, ``term``, ``voted_for``).
META_VERSION = 1
_HEADER = struct.Struct("<16sII")
HEADER_SIZE = _HEADER.size
_RECORD = struct.Struct("<IIQQQ")  # length, crc, index, term, group
RECORD_HEAD_SIZE = _RECORD.size
_ENTRY_HEAD = struct.Struct("<QQQ")
_ENTRY_HEAD_SIZE = _ENTRY_HEAD.size  # index, term and group, counted in length
#: A record of sync group g (syncs begun before it was written) is durable once a record of
#: group g + TORN_GROUPS + 1 exists: syncs run one at a time, and a writer may read the group
#: just before a concurrent sync begins. Only the newest TORN_GROUPS + 1 groups can be torn.
TORN_GROUPS = 2

# pysyncobj's format 1 (pysyncobj.journal): name, version, format, end offset, then records
# of  size | index term command | size  with no checksum.
_V1_NAME = b"PYSYNCOBJ"
_V1_FORMAT_AT = 32
_V1_END_AT = 36
_V1_FIRST = 40
_U32 = struct.Struct("<I")
_V1_ENTRY = struct.Struct("<QQ")

Entry = tuple[bytes, int, int]  # command, index, term


class JournalDamaged(Exception):
    """The journal holds a bad record that is not its tail: it cannot be repaired here."""

    def __init__(self, offset: int, index: int | None, reason: str) -> None:
        super().__init__(reason)
        self.offset = offset
        self.index = index
        self.reason = reason


def encode_record(command: bytes, index: int, term: int, group: int = 0) -> bytes:
    length = _ENTRY_HEAD_SIZE + len(command)
    body = _ENTRY_HEAD.pack(index, term, group) + command
    crc = zlib.crc32(body, zlib.crc32(_U32.pack(length)))
    return _RECORD.pack(length, crc, index, term, group) + command


def header() -> bytes:
    return _HEADER.pack(MAGIC, VERSION, 0)


@dataclass(slots=True)
class Scan:
    """What a journal file holds: its entries, where each record starts, where they end and,
    when its last bytes are a torn record, how many bytes of it are to be cut."""

    entries: list[Entry] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    end: int = HEADER_SIZE
    torn_bytes: int = 0
    torn_reason: str = ""
    legacy: bool = False
    groups: list[int] = field(default_factory=list)

    @property
    def max_group(self) -> int:
        return max(self.groups, default=0)


def _record_at(data: bytes, at: int) -> tuple[Entry, int, int] | str:
    """The entry of the record at ``at``, its size and sync group, or why it is bad."""
    if len(data) - at < RECORD_HEAD_SIZE:
        return f"{len(data) - at} bytes, shorter than a record's head"
    length, crc, index, term, group = _RECORD.unpack_from(data, at)
    if length < _ENTRY_HEAD_SIZE:
        return f"a record length of {length}"
    size = 8 + length
    if at + size > len(data):
        return f"a record of {size} bytes runs past the file's end"
    body = memoryview(data)[at + 8 : at + size]
    if zlib.crc32(body, zlib.crc32(_U32.pack(length))) != crc:
        return "the record's CRC does not match"
    return (bytes(data[at + RECORD_HEAD_SIZE : at + size]), index, term), size, group


def scan(data: bytes) -> Scan:
    """Read a journal file's bytes; :class:`JournalDamaged` when they cannot be trusted."""
    if data[: len(_V1_NAME)] == _V1_NAME:
        return _scan_v1(data)
    if len(data) < HEADER_SIZE:
        # A journal created but never synced: nothing in it was acknowledged.
        return Scan(torn_bytes=len(data), torn_reason="a header cut short")
    magic, version, _ = _HEADER.unpack_from(data, 0)
    if magic != MAGIC:
        raise JournalDamaged(0, None, f"magic {magic!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise JournalDamaged(16, None, f"format {version}, expected {VERSION}")
    out = Scan()
    at = HEADER_SIZE
    last: tuple[int, int] | None = None
    group: int | None = None
    while at < len(data):
        got = _record_at(data, at)
        if isinstance(got, str):
            damage = _synced_damage(data, at, group)
            if damage is not None:
                raise JournalDamaged(at, None, f"{got}, and {damage}")
            out.torn_bytes = len(data) - at
            out.torn_reason = got
            break
        entry, size, group = got
        _, index, term = entry
        if last is not None and (index != last[0] + 1 or term < last[1]):
            raise JournalDamaged(
                at, index, f"entry {index} term {term} follows entry {last[0]} term {last[1]}"
            )
        out.entries.append(entry)
        out.offsets.append(at)
        out.groups.append(group)
        last = (index, term)
        at += size
    out.end = at
    return out


def _synced_damage(data: bytes, at: int, before: int | None) -> str | None:
    """Why the bad record at ``at`` cannot be a write torn by a power cut, or None.

    A power cut can tear only records of the last syncs begun (:data:`TORN_GROUPS`), in any
    order of their pages: a bad record followed by sound ones is torn when it belongs to
    those groups, as told by the sound record before it (``before``) or by its own group field.
    """
    if len(data) - at < RECORD_HEAD_SIZE:
        return None
    length, _crc, _index, _term, own = _RECORD.unpack_from(data, at)
    pos = at + 8 + length
    if length < _ENTRY_HEAD_SIZE:
        return None  # where the next record starts is lost with it
    later: list[int] = []
    while pos < len(data):
        got = _record_at(data, pos)
        if isinstance(got, str):
            break
        later.append(got[2])
        pos += got[1]
    if not later:
        return None
    newest = max(later)
    if before is not None and before >= newest - TORN_GROUPS:
        return None
    if newest - TORN_GROUPS <= own <= newest:
        return None
    return f"{len(later)} sound records follow it, written after it was synced"


def _scan_v1(data: bytes) -> Scan:
    """pysyncobj's format 1: no checksum, so every doubt is damage."""
    if len(data) < _V1_FIRST:
        raise JournalDamaged(0, None, f"{len(data)} bytes, shorter than the header")
    (fmt,) = _U32.unpack_from(data, _V1_FORMAT_AT)
    (end,) = _U32.unpack_from(data, _V1_END_AT)
    if fmt != 1:
        raise JournalDamaged(_V1_FORMAT_AT, None, f"format {fmt}, expected 1")
    if not _V1_FIRST <= end <= len(data):
        raise JournalDamaged(_V1_END_AT, None, f"its end offset {end} lies outside the file")
    out = Scan(legacy=True)
    at = _V1_FIRST
    last: tuple[int, int] | None = None
    while at < end:
        if at + 4 + _V1_ENTRY.size + 4 > end:
            raise JournalDamaged(at, None, "a record runs past the journal's end")
        (size,) = _U32.unpack_from(data, at)
        if size < _V1_ENTRY.size or at + size + 8 > end:
            raise JournalDamaged(at, None, f"a record length of {size} runs past the end")
        (trailer,) = _U32.unpack_from(data, at + 4 + size)
        if trailer != size:
            raise JournalDamaged(at, None, f"record lengths {size} and {trailer} differ")
        index, term = _V1_ENTRY.unpack_from(data, at + 4)
        if last is not None and (index != last[0] + 1 or term < last[1]):
            raise JournalDamaged(
                at, index, f"entry {index} term {term} follows entry {last[0]} term {last[1]}"
            )
        out.entries.append((bytes(data[at + 4 + _V1_ENTRY.size : at + 4 + size]), index, term))
        out.offsets.append(at)
        last = (index, term)
        at += size + 8
    return out


def load_meta(path: str) -> dict[str, Any]:
    """Term, vote and commit index from ``path`` (``journal.meta``); empty when absent.

    Written atomically and synced, so a file that cannot be read is damage
    (:class:`JournalDamaged`), never a reason to start again from term 0; so is one of another
    version than :data:`META_VERSION` (one without ``v`` was written before the field: 1).
    """
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return {}
    try:
        meta = orjson.loads(raw)
    except orjson.JSONDecodeError:
        meta = None
    if isinstance(meta, dict):
        version = meta.get("v", META_VERSION)
        if version != META_VERSION or isinstance(version, bool):
            raise JournalDamaged(
                0, None, f"{path} has version {version!r}, this node reads {META_VERSION}"
            )
        return meta
    # pysyncobj's pickled dict (written before this module).
    try:
        old = safepickle.loads_log(raw)
        return {
            "term": int(old.get("currentTerm", 0)),
            "voted_for": old.get("votedForNodeId"),
            "commit_index": int(old.get("raftCommitIndex", 1)),
        }
    except Exception as exc:
        raise JournalDamaged(0, None, f"{path} holds no term and vote that can be read") from exc


_U64 = struct.Struct("<Q")
_COMMIT = struct.Struct("<QI")  # commit index, CRC32 of it


def _load_commit_index(path: str, meta: dict[str, Any]) -> int:
    try:
        with open(path, "rb") as f:
            raw = f.read(_COMMIT.size)
    except FileNotFoundError:
        raw = b""
    if len(raw) == _COMMIT.size:
        index, crc = _COMMIT.unpack(raw)
        if zlib.crc32(_U64.pack(index)) == crc:
            return int(index)
    return int(meta.get("commit_index", 1))  # pysyncobj kept it in its meta file


def read_file(path: str) -> Scan | None:
    """Scan the journal at ``path``; None when there is none."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return None
    return scan(data)


class DurableJournal(Journal):
    def __init__(
        self,
        path: str,
        *,
        flush: str = "async",
        flush_interval_ms: int = 500,
        on_fault: durable.FaultHandler = durable.fail_stop,
    ) -> None:
        if flush not in ("async", "sync"):
            raise ValueError(f"flush must be 'async' or 'sync', got {flush!r}")
        self.path = path
        self._dir = str(Path(path).parent)
        self._meta_path = path + ".meta"
        self.flush_mode = flush
        self._faults = durable.FaultLatch(on_fault)
        self._lock = threading.Lock()  # the descriptor against the flusher's sync
        self._dirty = False
        self.syncs = 0  # fdatasyncs of entries (the figure group commit lowers)
        #: The longest an appended entry waited until a sync made it durable, in seconds:
        #: under ``flush="async"`` what a power cut of every node could lose, measured.
        self.max_unsynced_s = 0.0
        self._dirty_since: float | None = None
        self._meta: dict[str, Any] = load_meta(self._meta_path)
        self._commit_path = path + ".commit"
        # Raft's commit index is volatile state. Under "sync" every committed entry is on
        # the disks of a majority, so the saved one is a safe head start; under "async" a
        # power cut of every node can take committed entries from most journals, and a node
        # that applied them from its own journal before hearing from a leader would keep
        # them when a leader without them wins: it waits for the leader's commit index.
        self._commit_index = (
            _load_commit_index(self._commit_path, self._meta) if flush == "sync" else 1
        )
        self._commit_saved = True
        self._entries: list[Entry] = []
        self._offsets: list[int] = []
        self._group = 0  # syncs begun (see TORN_GROUPS)
        self._fd = self._open()
        self._closed = False
        self._flush_wakeup = threading.Event()
        self._flusher: threading.Thread | None = None
        self._cond = threading.Condition()  # the group-commit thread's hand-over
        self._inflight = False
        self._inflight_since: float | None = None
        self._committer: threading.Thread | None = None
        if flush == "sync":
            self._committer = threading.Thread(
                target=self._group_commit_loop, name="journal-group-commit", daemon=True
            )
            self._committer.start()
        if flush == "async":
            self._flush_interval_s = flush_interval_ms / 1000
            self._flusher = threading.Thread(
                target=self._flush_loop, name="journal-flush", daemon=True
            )
            self._flusher.start()

    # ------------------------------------------------------------------ opening

    def _open(self) -> int:
        got = read_file(self.path)
        if got is None or got.legacy or got.end == HEADER_SIZE and got.torn_bytes:
            entries = [] if got is None else got.entries
            fd = self._rewrite(entries)
            if got is not None and got.legacy:
                log.info("rewrote the Raft journal %s in format %d", self.path, VERSION)
                self._store_meta()  # and its meta file as JSON
            return fd
        if got.torn_bytes:
            log.warning(
                "the Raft journal %s ends in a torn record at byte %d (%s): cutting its %d "
                "bytes, written after the last sync",
                self.path,
                got.end,
                got.torn_reason,
                got.torn_bytes,
            )
        fd = os.open(self.path, os.O_RDWR)
        if got.torn_bytes:
            os.ftruncate(fd, got.end)
        # What was read is on disk from now on: later records are of later groups.
        durable.fsync(fd, self.path, on_fault=self._faults)
        self._group = got.max_group + TORN_GROUPS + 1
        self._entries = got.entries
        self._offsets = got.offsets
        self._end = got.end
        return fd

    def _rewrite(self, entries: list[Entry]) -> int:
        """Write ``entries`` to a new file and put it in place, synced; its descriptor."""
        tmp = self.path + ".tmp"
        chunks = [header()]
        offsets = []
        at = HEADER_SIZE
        for command, index, term in entries:
            rec = encode_record(command, index, term, self._group)
            offsets.append(at)
            chunks.append(rec)
            at += len(rec)
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            durable.pwrite_all(fd, b"".join(chunks), 0, tmp)
            durable.fsync(fd, tmp, on_fault=self._faults)
            durable.replace(tmp, self.path, on_fault=self._faults)
        except BaseException:
            os.close(fd)
            raise
        self._group += TORN_GROUPS + 1
        self._entries = list(entries)
        self._offsets = offsets
        self._end = at
        return fd

    # ------------------------------------------------------------------ pysyncobj's Journal

    def add(self, command: bytes, idx: int, term: int) -> None:
        rec = encode_record(bytes(command), idx, term, self._group)
        try:
            durable.pwrite_all(self._fd, rec, self._end, self.path)
        except OSError:
            # Not added (a full disk): the bytes written of it are cut, so that the file ends
            # where the entries in memory do, and the caller decides (raftlog/room.py).
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, self._end)
            raise
        self._entries.append((command, idx, term))
        self._offsets.append(self._end)
        self._end += len(rec)
        if self._dirty_since is None:
            self._dirty_since = time.monotonic()
        self._dirty = True

    def clear(self) -> None:
        self._truncate(0)

    def deleteEntriesFrom(self, entryFrom: int) -> None:  # noqa: N802, N803 - pysyncobj's names
        self._truncate(entryFrom)

    def deleteEntriesTo(self, entryTo: int) -> None:  # noqa: N802, N803
        """Drop the entries before ``entryTo`` (a snapshot covers them): rewritten in a new
        file. The directory is synced first, so that the snapshot pysyncobj has just renamed
        into it is durable before the entries it replaces are gone."""
        durable.fsync_dir(self._dir, on_fault=self._faults)
        keep = self._entries[entryTo:]
        with self._lock:
            old = self._fd
            self._fd = self._rewrite(keep)
            self._dirty = False
            os.close(old)

    def _truncate(self, keep: int) -> None:
        if keep >= len(self._entries):
            return
        end = self._offsets[keep] if keep < len(self._offsets) else self._end
        os.ftruncate(self._fd, end)
        # Synced before anything is written after it: a power cut must not bring back
        # entries of another term behind new ones.
        self._sync_now()
        del self._entries[keep:]
        del self._offsets[keep:]
        self._end = end

    def __getitem__(self, item: Any) -> Any:
        return self._entries[item]

    def __len__(self) -> int:
        return len(self._entries)

    def _destroy(self) -> None:
        self.close()

    def flush(self) -> None:
        self.sync()

    def setRaftCommitIndex(self, raftCommitIndex: int) -> None:  # noqa: N802, N803
        self._commit_index = raftCommitIndex
        self._commit_saved = False

    def getRaftCommitIndex(self) -> int:  # noqa: N802
        return self._commit_index

    def setCurrentTerm(self, term: int, votedForNodeId: Any) -> None:  # noqa: N802, N803
        """Raft: term and vote are durable before any message that reflects them is sent."""
        self._meta["term"] = term
        self._meta["voted_for"] = votedForNodeId
        self._store_meta()

    def getCurrentTerm(self) -> int:  # noqa: N802
        return int(self._meta.get("term", 0))

    def getVotedForNodeId(self) -> Any:  # noqa: N802
        return self._meta.get("voted_for")

    def onOneSecondTimer(self) -> None:  # noqa: N802
        if not self._commit_saved:
            self._save_commit_index()

    def _save_commit_index(self) -> None:
        """A hint, not synced: after a power cut an older or unreadable one only makes the
        node wait for its leader's commit index before applying what it holds."""
        data = _COMMIT.pack(self._commit_index, zlib.crc32(_U64.pack(self._commit_index)))
        fd = os.open(self._commit_path, os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            os.pwrite(fd, data, 0)
        finally:
            os.close(fd)
        self._commit_saved = True

    # ------------------------------------------------------------------ meta

    def _store_meta(self) -> None:
        self._faults.check()
        self._meta["v"] = META_VERSION
        durable.write_atomically(self._meta_path, orjson.dumps(self._meta), on_fault=self._faults)

    # ------------------------------------------------------------------ durability

    @property
    def dirty(self) -> bool:
        """Entries were appended that are not durable yet (or are being synced)."""
        return self._dirty or self._inflight

    def sync(self) -> None:
        """Make every entry appended so far durable (one ``fdatasync`` for all of them, or
        the end of the one :meth:`start_sync` began)."""
        with self._cond:
            while self._inflight:
                self._cond.wait()
        if self._dirty or self._faults.failed is not None:
            self._sync_now()

    def start_sync(self) -> None:
        """Begin syncing every entry appended so far on the group-commit thread
        (``flush="sync"``); :meth:`sync` waits for it. The leader's Raft thread goes on
        reading its followers' answers meanwhile."""
        if self._committer is None:
            self.sync()
            return
        with self._cond:
            if not self._dirty or self._inflight:
                return
            self._group += 1
            self._inflight = True
            self._dirty = False
            self._inflight_since, self._dirty_since = self._dirty_since, None
            self._cond.notify_all()

    def _group_commit_loop(self) -> None:
        while True:
            with self._cond:
                while not self._inflight and not self._closed:
                    self._cond.wait()
                if not self._inflight:
                    return
            try:
                with self._lock:
                    if self._faults.failed is None:
                        durable.fdatasync(self._fd, self.path, on_fault=self._faults)
                        self._synced(self._inflight_since)
            except durable.StorageFault:
                pass  # on_fault has been told; the next sync() fails too
            finally:
                with self._cond:
                    self._inflight = False
                    self._cond.notify_all()

    def _sync_now(self) -> None:
        with self._lock:
            self._faults.check()
            self._group += 1
            self._dirty = False
            since, self._dirty_since = self._dirty_since, None
            fd = self._fd
            durable.fdatasync(fd, self.path, on_fault=self._faults)
            self._synced(since)

    def _synced(self, since: float | None) -> None:
        self.syncs += 1
        if since is not None:
            self.max_unsynced_s = max(self.max_unsynced_s, time.monotonic() - since)

    def _flush_loop(self) -> None:
        # Syncs begin every interval, however long each takes: an entry waits at most the
        # interval plus one sync.
        began = time.monotonic()
        while not self._closed:
            self._flush_wakeup.wait(max(0.0, began + self._flush_interval_s - time.monotonic()))
            if self._closed:
                break
            began = time.monotonic()
            try:
                self.sync()
            except durable.StorageFault:
                return  # on_fault has been told (a node has stopped by now)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._flush_wakeup.set()
        if self._flusher is not None:
            self._flusher.join(timeout=5)
        with self._cond:
            self._cond.notify_all()
        if self._committer is not None:
            self._committer.join(timeout=5)
        self.sync()
        if not self._commit_saved:
            self._save_commit_index()
        with self._lock:
            os.close(self._fd)
