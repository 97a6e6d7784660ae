"""The Raft journal (raftlog/journal.py): record codec, torn tails, damage, term and vote
made durable, group commit, and fail-stop on a failed fsync."""

from __future__ import annotations

import os
import pickle
import struct
import threading
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from pysyncobj.journal import FileJournal

from chronomq.raftlog import durable
from chronomq.raftlog.journal import (
    HEADER_SIZE,
    DurableJournal,
    JournalDamaged,
    encode_record,
    header,
    read_file,
    scan,
)
from chronomq.raftlog.journalcheck import check_journal

from ._fsync import Faults, FsyncSpy

# _REGULAR command type byte + a body; the check decodes only regular calls' arguments.
NOOP = b"\x01"


def _journal(path: Path, **kw: Any) -> DurableJournal:
    kw.setdefault("flush", "sync")
    kw.setdefault("on_fault", Faults())
    return DurableJournal(str(path), **kw)


@pytest.fixture
def jpath(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path / "raft" / "journal"


def _fill(j: DurableJournal, n: int, start: int = 1, term: int = 1) -> None:
    for i in range(start, start + n):
        j.add(NOOP + f"cmd-{i}".encode(), i, term)


# ---------------------------------------------------------------------- codec


def test_record_golden_bytes_both_ways() -> None:
    rec = encode_record(b"\x01ab", 7, 3, 9)
    body = struct.pack("<QQQ", 7, 3, 9) + b"\x01ab"
    assert rec[:4] == struct.pack("<I", 27)
    assert rec[8:] == body
    assert struct.unpack("<I", rec[4:8])[0] == zlib.crc32(body, zlib.crc32(rec[:4]))
    assert header() == b"CHRONOMQ-RAFTLOG" + struct.pack("<II", 2, 0)
    got = scan(header() + rec)
    assert got.entries == [(b"\x01ab", 7, 3)] and got.groups == [9]
    assert got.offsets == [HEADER_SIZE] and got.end == HEADER_SIZE + len(rec)
    assert got.torn_bytes == 0


def test_a_flipped_bit_in_the_last_record_is_a_torn_tail() -> None:
    recs = [encode_record(NOOP, i, 1) for i in (1, 2, 3)]
    data = bytearray(header() + b"".join(recs))
    data[-1] ^= 0x40
    got = scan(bytes(data))
    assert [e[1] for e in got.entries] == [1, 2]
    assert got.torn_bytes == len(recs[2]) and "CRC" in got.torn_reason


def _journal_bytes(groups: list[int]) -> tuple[bytearray, list[int]]:
    recs = [encode_record(NOOP + b"x" * 10, i, 1, g) for i, g in enumerate(groups, start=1)]
    offsets = [HEADER_SIZE + sum(len(r) for r in recs[:k]) for k in range(len(recs))]
    return bytearray(header() + b"".join(recs)), offsets


def test_a_bad_record_followed_by_records_written_after_its_sync_is_damage() -> None:
    data, offsets = _journal_bytes([0, 0, 5])
    data[offsets[1] + 40] ^= 0xFF  # inside entry 2's command
    with pytest.raises(JournalDamaged, match="written after it was synced") as exc:
        scan(bytes(data))
    assert exc.value.offset == offsets[1]


@pytest.mark.parametrize("groups", [[0, 4, 5], [4, 5, 5], [5, 5, 5]])
def test_a_torn_write_of_the_last_syncs_is_cut_whatever_pages_survived(
    groups: list[int],
) -> None:
    """A power cut may keep a later page and lose an earlier one: entry 2 is bad, entry 3
    sound, both written after the last completed sync. Both go."""
    data, offsets = _journal_bytes(groups)
    data[offsets[1] + 40] ^= 0xFF
    got = scan(bytes(data))
    assert [e[1] for e in got.entries] == [1]
    assert got.end == offsets[1] and got.torn_bytes == len(data) - offsets[1]


def test_entries_out_of_order_are_damage() -> None:
    data = header() + encode_record(NOOP, 1, 2) + encode_record(NOOP, 2, 1)
    with pytest.raises(JournalDamaged, match="entry 2 term 1 follows entry 1 term 2"):
        scan(data)


# ---------------------------------------------------------------------- torn tails


@pytest.mark.parametrize("cut", ["short", "garbage", "zeros"])
def test_a_torn_tail_is_cut_on_open_and_the_journal_goes_on(jpath: Path, cut: str) -> None:
    jpath.parent.mkdir()
    j = _journal(jpath)
    _fill(j, 5)
    j.sync()
    j.close()
    size = jpath.stat().st_size
    raw = bytearray(jpath.read_bytes())
    if cut == "short":  # the last record half written
        raw = raw[: size - 5]
    elif cut == "garbage":  # its bytes never reached the disk, others did
        raw[size - 12 : size] = os.urandom(12)
    else:  # the file grew, the data did not arrive
        raw += b"\x00" * 4096
    jpath.write_bytes(bytes(raw))
    assert check_journal(str(jpath)) is None  # not a reason to refuse

    j = _journal(jpath)
    expect = 5 if cut == "zeros" else 4
    assert [e[1] for e in j[:]] == list(range(1, expect + 1))
    _fill(j, 2, start=expect + 1)
    j.sync()
    j.close()
    again = read_file(str(jpath))
    assert again is not None and again.torn_bytes == 0
    assert [e[1] for e in again.entries] == list(range(1, expect + 3))


def test_damage_before_the_tail_is_refused_naming_the_byte(jpath: Path) -> None:
    jpath.parent.mkdir()
    j = _journal(jpath)
    _fill(j, 5)
    j.close()
    raw = bytearray(jpath.read_bytes())
    raw[HEADER_SIZE + 26] ^= 0xFF  # inside the first record's command
    jpath.write_bytes(bytes(raw))
    problem = check_journal(str(jpath))
    assert problem is not None and problem.offset == HEADER_SIZE
    assert "damaged at byte" in problem.describe(str(jpath))


def test_a_pysyncobj_format_1_journal_is_read_and_rewritten(jpath: Path) -> None:
    jpath.parent.mkdir()
    old = FileJournal(str(jpath))
    for i in (1, 2, 3):
        old.add(NOOP + bytes([i]), i, 4)
    old.setCurrentTerm(5, "127.0.0.1:7001")
    old._destroy()
    assert check_journal(str(jpath)) is None
    j = _journal(jpath)
    assert j[:] == [(NOOP + bytes([i]), i, 4) for i in (1, 2, 3)]
    assert (j.getCurrentTerm(), j.getVotedForNodeId()) == (5, "127.0.0.1:7001")
    j.close()
    assert jpath.read_bytes()[:16] == b"CHRONOMQ-RAFTLOG"
    assert orjson.loads((jpath.parent / "journal.meta").read_bytes())["term"] == 5


# ---------------------------------------------------------------------- term and vote


def test_a_vote_is_synced_file_and_directory_before_set_current_term_returns(
    jpath: Path, spy: FsyncSpy
) -> None:
    """A vote cast just before a power cut: what pysyncobj sends after setCurrentTerm (the
    vote) is only sent once the meta file and its name are on disk."""
    jpath.parent.mkdir()
    j = _journal(jpath)
    spy.calls.clear()
    j.setCurrentTerm(9, "node-b")
    meta = str(jpath) + ".meta"
    # The new file's bytes (fsynced as .tmp), then the directory after the rename.
    assert spy.paths() == [meta + ".tmp", str(jpath.parent)]
    j.close()
    # Restarted (a power cut after the vote): the node still knows it voted in term 9.
    again = _journal(jpath)
    assert (again.getCurrentTerm(), again.getVotedForNodeId()) == (9, "node-b")
    again.close()


def test_an_unreadable_meta_file_refuses_instead_of_forgetting_the_vote(jpath: Path) -> None:
    jpath.parent.mkdir()
    j = _journal(jpath)
    _fill(j, 1)
    j.setCurrentTerm(3, "x")
    j.close()
    (jpath.parent / "journal.meta").write_bytes(b"\x80garbage")
    problem = check_journal(str(jpath))
    assert problem is not None and "term and vote" in problem.reason


def test_the_meta_file_carries_its_version_and_another_version_is_refused(jpath: Path) -> None:
    jpath.parent.mkdir()
    j = _journal(jpath)
    j.setCurrentTerm(3, "x")
    j.close()
    meta_path = jpath.parent / "journal.meta"
    meta = orjson.loads(meta_path.read_bytes())
    assert meta == {"v": 1, "term": 3, "voted_for": "x"}
    del meta["v"]  # as written before the field
    meta_path.write_bytes(orjson.dumps(meta))
    again = _journal(jpath)
    assert (again.getCurrentTerm(), again.getVotedForNodeId()) == (3, "x")
    again.close()
    meta_path.write_bytes(orjson.dumps({**meta, "v": 2}))
    problem = check_journal(str(jpath))
    assert problem is not None and "version 2" in problem.reason


def test_the_commit_index_is_saved_on_the_one_second_timer(jpath: Path) -> None:
    jpath.parent.mkdir()
    j = _journal(jpath)
    j.setRaftCommitIndex(42)
    j.onOneSecondTimer()
    j.close()
    assert _journal(jpath).getRaftCommitIndex() == 42


# ---------------------------------------------------------------------- group commit


def test_sync_mode_syncs_once_for_every_entry_added_since_the_last(
    jpath: Path, spy: FsyncSpy
) -> None:
    jpath.parent.mkdir()
    j = _journal(jpath)
    spy.calls.clear()
    _fill(j, 50)
    assert spy.calls == [] and j.dirty
    j.sync()
    j.sync()  # nothing new: no second fsync
    assert spy.calls == [("fdatasync", str(jpath))]
    assert not j.dirty and j.syncs == 1
    j.close()


def test_truncating_entries_is_synced_before_anything_is_written_after(
    jpath: Path, spy: FsyncSpy
) -> None:
    jpath.parent.mkdir()
    j = _journal(jpath)
    _fill(j, 5)
    j.sync()
    spy.calls.clear()
    j.deleteEntriesFrom(3)
    assert spy.calls == [("fdatasync", str(jpath))]
    _fill(j, 2, start=4, term=2)
    j.sync()
    j.close()
    got = read_file(str(jpath))
    assert got is not None
    assert [(e[1], e[2]) for e in got.entries] == [(1, 1), (2, 1), (3, 1), (4, 2), (5, 2)]


def test_compaction_syncs_the_directory_before_and_after_replacing_the_file(
    jpath: Path, spy: FsyncSpy
) -> None:
    """pysyncobj renames the snapshot into the directory, then drops the entries it covers:
    the directory is synced first, so the snapshot is durable before the entries go."""
    jpath.parent.mkdir()
    j = _journal(jpath)
    _fill(j, 10)
    spy.calls.clear()
    j.deleteEntriesTo(8)
    folder = str(jpath.parent)
    assert spy.paths() == [folder, str(jpath) + ".tmp", folder]
    assert [e[1] for e in j[:]] == [9, 10]
    _fill(j, 1, start=11)
    j.close()
    got = read_file(str(jpath))
    assert got is not None and [e[1] for e in got.entries] == [9, 10, 11]


def test_async_mode_syncs_in_the_background_within_the_interval(jpath: Path) -> None:
    jpath.parent.mkdir()
    j = _journal(jpath, flush="async", flush_interval_ms=20)
    _fill(j, 3)
    deadline = time.monotonic() + 10
    while j.syncs == 0 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert not j.dirty and j.syncs >= 1
    j.close()


# ---------------------------------------------------------------------- fsync errors


def test_a_failed_fsync_stops_and_every_later_sync_fails_too(jpath: Path, spy: FsyncSpy) -> None:
    """fsyncgate: after a failed fsync Linux may report the next one successful although
    the pages were dropped. The journal never trusts a later sync."""
    jpath.parent.mkdir()
    faults = Faults()
    j = _journal(jpath, on_fault=faults)
    _fill(j, 2)
    spy.fail = lambda path: True
    with pytest.raises(durable.StorageFault):
        j.sync()
    assert len(faults.messages) == 1
    assert f"fsync of {jpath} failed (Input/output error)" in faults.messages[0]
    spy.fail = lambda path: False  # the disk "recovers"
    _fill(j, 1, start=3)
    with pytest.raises(durable.StorageFault):
        j.sync()
    with pytest.raises(durable.StorageFault):
        j.setCurrentTerm(2, None)
    assert len(faults.messages) == 3


def test_a_failed_background_fsync_calls_the_fault_handler(jpath: Path, spy: FsyncSpy) -> None:
    jpath.parent.mkdir()
    called = threading.Event()
    messages: list[str] = []

    def on_fault(message: str) -> None:
        messages.append(message)
        called.set()

    j = _journal(jpath, flush="async", flush_interval_ms=10, on_fault=on_fault)
    spy.fail = lambda path: path == str(jpath)
    _fill(j, 1)
    assert called.wait(10)
    assert "fsync of" in messages[0]
    with pytest.raises(durable.StorageFault):
        j.close()


def test_old_pickled_meta_is_read(jpath: Path) -> None:
    jpath.parent.mkdir()
    (jpath.parent / "journal.meta").write_bytes(
        pickle.dumps({"currentTerm": 4, "votedForNodeId": "a:1", "raftCommitIndex": 7}, 2)
    )
    j = _journal(jpath)
    assert (j.getCurrentTerm(), j.getVotedForNodeId(), j.getRaftCommitIndex()) == (4, "a:1", 7)
    j.close()


def test_a_sync_started_runs_on_the_group_commit_thread_and_sync_waits_for_it(
    jpath: Path, spy: FsyncSpy
) -> None:
    jpath.parent.mkdir()
    j = _journal(jpath)
    _fill(j, 3)
    spy.calls.clear()
    j.start_sync()
    assert j.dirty  # until the thread is done, nothing is acknowledged
    _fill(j, 2, start=4)  # arrives while the sync runs: the next one takes it
    j.sync()
    assert not j.dirty
    assert 1 <= len(spy.calls) <= 2 and set(spy.calls) == {("fdatasync", str(jpath))}
    j.close()
