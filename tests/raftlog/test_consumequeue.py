"""ConsumeQueues: 20-byte units, torn units, and repair from the CommitLog."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from chronomq.raftlog import record
from chronomq.raftlog.commitlog import CommitLog
from chronomq.raftlog.consumequeue import (
    UNIT,
    UNIT_SIZE,
    ConsumeQueueStore,
    CqUnit,
    pack_units,
    tags_hash,
)

from ._util import rec

SEG = 4096


class Fixture:
    """A CommitLog and its ConsumeQueues written together, as apply does."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.cl = CommitLog(
            root / "commitlog", segment_bytes=SEG, flush="async", flush_interval_ms=60_000
        )
        self.cqs = ConsumeQueueStore(root / "consumequeue")
        self.next: dict[tuple[str, int], int] = {}
        self.n = 0

    def write(self, topic: str, queue_id: int, body: bytes, tags_code: int = 0) -> CqUnit:
        self.n += 1
        data = bytearray(rec(topic, queue_id, body, self.n, tags_code=tags_code))
        key = (topic, queue_id)
        qoff = self.next.get(key, 0)
        [phys] = self.cl.append_records(data, [len(data)], [qoff])
        self.cqs.append(topic, queue_id, qoff, UNIT.pack(phys, len(data), tags_code))
        self.next[key] = qoff + 1
        return CqUnit(qoff, phys, len(data), tags_code)

    def fill(self, count: int = 60) -> dict[tuple[str, int], list[CqUnit]]:
        units: dict[tuple[str, int], list[CqUnit]] = {}
        keys = [("t", 0), ("t", 1), ("u", 0)]
        for i in range(count):
            topic, qid = keys[i % 3]
            units.setdefault((topic, qid), []).append(
                self.write(topic, qid, b"m" * (50 + 13 * i), tags_code=i * 7)
            )
        return units

    def reopen_queues(self) -> ConsumeQueueStore:
        self.cqs.close()
        self.cqs = ConsumeQueueStore(self.root / "consumequeue")
        return self.cqs

    def all_units(self, key: tuple[str, int]) -> list[CqUnit]:
        return self.cqs.read(key[0], key[1], 0, 1_000_000)

    def close(self) -> None:
        self.cqs.close()
        self.cl.close()


@pytest.fixture
def fx(tmp_path: Path) -> Iterator[Fixture]:
    f = Fixture(tmp_path)
    yield f
    f.close()


def qfile(fx: Fixture, topic: str, queue_id: int) -> Path:
    return fx.root / "consumequeue" / topic / f"{queue_id:05d}"


# ---------------------------------------------------------------------- units


def test_unit_layout() -> None:
    assert UNIT_SIZE == 20
    assert UNIT.pack(1, 2, -3) == bytes.fromhex("000000000000000100000002fffffffffffffffd")
    assert pack_units([(1, 2, 3), (4, 5, 6)]) == UNIT.pack(1, 2, 3) + UNIT.pack(4, 5, 6)


def test_tags_hash() -> None:
    assert tags_hash(None) == 0
    assert tags_hash("") == 0
    assert tags_hash("a") == 97
    assert tags_hash("ab") == 97 * 31 + 98
    assert 0 <= tags_hash("x" * 1000) < 2**63
    assert tags_hash("TagA") == tags_hash("TagA") != tags_hash("TagB")


def test_append_and_read(tmp_path: Path) -> None:
    cqs = ConsumeQueueStore(tmp_path)
    try:
        assert cqs.max_offset("t", 0) == 0
        assert cqs.read("t", 0, 0, 10) == []
        cqs.append("t", 0, 0, pack_units([(0, 100, 5), (100, 200, -1)]))
        cqs.append("t", 0, 2, pack_units([(300, 50, 2**63 - 1)]))
        cqs.append("t", 3, 0, pack_units([(350, 60, 0)]))
        assert cqs.max_offset("t", 0) == 3
        assert cqs.queues() == {("t", 0): 3, ("t", 3): 1}
        assert cqs.read("t", 0, 0, 10) == [
            CqUnit(0, 0, 100, 5),
            CqUnit(1, 100, 200, -1),
            CqUnit(2, 300, 50, 2**63 - 1),
        ]
        assert cqs.read("t", 0, 1, 1) == [CqUnit(1, 100, 200, -1)]
        assert cqs.read("t", 0, 3, 10) == []
        assert cqs.read("t", 0, -1, 10) == []
        assert cqs.read("t", 3, 0, 10) == [CqUnit(0, 350, 60, 0)]
        with pytest.raises(ValueError):
            cqs.append("t", 0, 5, pack_units([(1, 1, 1)]))
        assert (tmp_path / "t" / "00000").stat().st_size == 3 * UNIT_SIZE
    finally:
        cqs.close()
    again = ConsumeQueueStore(tmp_path)
    try:
        assert again.queues() == {("t", 0): 3, ("t", 3): 1}
        assert again.read("t", 0, 2, 1) == [CqUnit(2, 300, 50, 2**63 - 1)]
    finally:
        again.close()


def test_truncate_and_drop(tmp_path: Path) -> None:
    cqs = ConsumeQueueStore(tmp_path)
    try:
        cqs.append("t", 0, 0, pack_units([(i, 1, 0) for i in range(10)]))
        cqs.truncate("t", 0, 4)
        assert cqs.max_offset("t", 0) == 4
        cqs.truncate("t", 0, 8)  # never grows
        assert cqs.max_offset("t", 0) == 4
        cqs.append("t", 0, 4, pack_units([(99, 1, 0)]))
        assert cqs.read("t", 0, 4, 1) == [CqUnit(4, 99, 1, 0)]
        cqs.drop("t", 0)
        assert cqs.queues() == {}
        assert not (tmp_path / "t" / "00000").exists()
        cqs.drop("t", 0)  # twice is harmless
    finally:
        cqs.close()


@pytest.mark.parametrize("extra", [1, 7, 19])
def test_torn_unit_is_truncated_on_open(tmp_path: Path, extra: int) -> None:
    cqs = ConsumeQueueStore(tmp_path)
    cqs.append("t", 2, 0, pack_units([(i * 10, 10, i) for i in range(3)]))
    cqs.close()
    path = tmp_path / "t" / "00002"
    with open(path, "ab") as f:
        f.write(b"\xab" * extra)
    again = ConsumeQueueStore(tmp_path)
    try:
        assert path.stat().st_size == 3 * UNIT_SIZE
        assert again.max_offset("t", 2) == 3
        again.append("t", 2, 3, pack_units([(30, 10, 3)]))
        assert [u.commitlog_offset for u in again.read("t", 2, 0, 10)] == [0, 10, 20, 30]
    finally:
        again.close()


def test_scan_ignores_stray_files(tmp_path: Path) -> None:
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "notes.txt").write_text("x")
    (tmp_path / "file-at-top").write_text("x")
    cqs = ConsumeQueueStore(tmp_path)
    try:
        assert cqs.queues() == {}
    finally:
        cqs.close()


# ---------------------------------------------------------------------- repair


def test_repair_when_everything_matches_does_nothing(fx: Fixture) -> None:
    units = fx.fill()
    expected = {k: len(v) for k, v in units.items()}
    assert fx.cqs.repair(fx.cl, expected) == 0
    for key, want in units.items():
        assert fx.all_units(key) == want


def test_missing_queue_file_is_rebuilt(fx: Fixture) -> None:
    units = fx.fill()
    fx.cqs.close()
    qfile(fx, "t", 1).unlink()
    cqs = fx.reopen_queues()
    assert ("t", 1) not in cqs.queues()
    expected = {k: len(v) for k, v in units.items()}
    assert cqs.repair(fx.cl, expected) == len(units[("t", 1)])
    for key, want in units.items():
        assert fx.all_units(key) == want


def test_whole_consumequeue_directory_rebuilt(fx: Fixture) -> None:
    units = fx.fill()
    fx.cqs.close()
    for path in (fx.root / "consumequeue").rglob("0*"):
        path.unlink()
    cqs = fx.reopen_queues()
    expected = {k: len(v) for k, v in units.items()}
    assert cqs.repair(fx.cl, expected) == sum(expected.values())
    for key, want in units.items():
        assert fx.all_units(key) == want


def test_queue_behind_is_rebuilt(fx: Fixture) -> None:
    units = fx.fill()
    os.truncate(qfile(fx, "u", 0), 4 * UNIT_SIZE)
    cqs = fx.reopen_queues()
    assert cqs.max_offset("u", 0) == 4
    expected = {k: len(v) for k, v in units.items()}
    assert cqs.repair(fx.cl, expected) == len(units[("u", 0)]) - 4
    for key, want in units.items():
        assert fx.all_units(key) == want


def test_queue_ahead_is_cut(fx: Fixture) -> None:
    units = fx.fill()
    expected = {k: len(v) for k, v in units.items()}
    expected[("t", 0)] = 5
    assert fx.cqs.repair(fx.cl, expected) == 0
    assert fx.all_units(("t", 0)) == units[("t", 0)][:5]
    assert (qfile(fx, "t", 0)).stat().st_size == 5 * UNIT_SIZE


def test_queues_not_expected_are_dropped(fx: Fixture) -> None:
    units = fx.fill()
    expected = {k: len(v) for k, v in units.items() if k[0] == "t"}
    fx.cqs.repair(fx.cl, expected)
    assert set(fx.cqs.queues()) == {("t", 0), ("t", 1)}
    assert not qfile(fx, "u", 0).exists()
    fx.cqs.repair(fx.cl, {})
    assert fx.cqs.queues() == {}


def test_expected_queue_with_no_messages(fx: Fixture) -> None:
    units = fx.fill(9)
    expected = {k: len(v) for k, v in units.items()}
    expected[("empty", 3)] = 0
    assert fx.cqs.repair(fx.cl, expected) == 0
    assert fx.cqs.max_offset("empty", 3) == 0


def test_units_pointing_past_the_commitlog_end_are_cut(fx: Fixture) -> None:
    units = fx.fill(30)
    a = units[("t", 0)]  # 10 units
    # The CommitLog is cut after t/0's unit 5, then different, smaller records are written
    # for t/0 offsets 6 and 7: the stale queue units 6.. point past the new end.
    cut = a[5].commitlog_offset + a[5].size
    fx.cl.truncate(cut)
    for key in list(fx.next):
        fx.next[key] = sum(1 for u in units[key] if u.commitlog_offset < cut)
    n6 = fx.cl.append_records(bytearray(rec("t", 0, b"6", 1006)), [len(rec("t", 0, b"6"))], [6])
    n7 = fx.cl.append_records(bytearray(rec("t", 0, b"7", 1007)), [len(rec("t", 0, b"7"))], [7])
    assert n7[0] + len(rec("t", 0, b"7")) < a[6].commitlog_offset + a[6].size
    expected = {key: fx.next[key] for key in units}
    expected[("t", 0)] = 8
    assert fx.cqs.repair(fx.cl, expected) == 2
    got = fx.all_units(("t", 0))
    assert got[:6] == a[:6]
    assert [u.commitlog_offset for u in got[6:]] == [n6[0], n7[0]]
    assert record.decode(fx.cl.read(got[7].commitlog_offset, got[7].size)).body == b"7"
    for key in (("t", 1), ("u", 0)):
        assert fx.all_units(key) == units[key][: expected[key]]
        assert all(u.commitlog_offset + u.size <= fx.cl.length for u in fx.all_units(key))


def test_repair_that_cannot_reach_the_expected_count_raises(fx: Fixture) -> None:
    units = fx.fill(30)
    expected = {k: len(v) for k, v in units.items()}
    expected[("t", 0)] += 3
    with pytest.raises(ValueError, match="expected"):
        fx.cqs.repair(fx.cl, expected)


def test_rebuilt_units_carry_tags_codes(fx: Fixture) -> None:
    units = fx.fill()
    fx.cqs.close()
    qfile(fx, "t", 0).unlink()
    cqs = fx.reopen_queues()
    cqs.repair(fx.cl, {k: len(v) for k, v in units.items()})
    assert [u.tags_code for u in fx.all_units(("t", 0))] == [u.tags_code for u in units[("t", 0)]]
    assert any(u.tags_code for u in units[("t", 0)])
