"""The replicated store: deterministic apply, idempotency, conditions, snapshots, restore."""

from __future__ import annotations

import copy
import hashlib
import random
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from chronomq.raftlog import record
from chronomq.raftlog import snapshot as snapshot_module
from chronomq.raftlog.errors import StoreCorruption
from chronomq.raftlog.snapshot import FetchTarget, decode_entry, encode_entry
from chronomq.raftlog.store import (
    BAD_QUEUE,
    CONDITION_FAILED,
    OK,
    ApplyResult,
    Store,
)

from ._fsync import FsyncSpy
from ._util import B, barrier, command, commitlog_bytes, msg_id, segment_files, tree_bytes

SEG = 4096

StoreFactory = Callable[..., Store]


@pytest.fixture
def make_store(tmp_path: Path) -> Iterator[StoreFactory]:
    stores: list[Store] = []

    def make(name: str = "a", segment_bytes: int = SEG, **kw: object) -> Store:
        s = Store(tmp_path / name, segment_bytes=segment_bytes, **kw)  # type: ignore[arg-type]
        stores.append(s)
        return s

    yield make
    for s in stores:
        s.close()


@pytest.fixture
def store(make_store: StoreFactory) -> Store:
    return make_store()


class Applier:
    """Applies commands to a store with consecutive Raft indexes."""

    def __init__(self, store: Store, index: int = 0) -> None:
        self.store = store
        self.index = index

    def __call__(self, data: bytes) -> ApplyResult:
        self.index += 1
        return self.store.apply(data, self.index)


def state(s: Store) -> dict[str, object]:
    """A copy of everything that must be equal between replicas."""
    return {
        "digest": s.digest(),
        "topics": copy.deepcopy(s.topics),
        "kv": dict(s.kv),
        "idem": list(s.idem.items()),
        "clients": list(s.clients.items()),
        "commitlog": commitlog_bytes(s.data_dir / "commitlog"),
        "consumequeue": tree_bytes(s.data_dir / "consumequeue"),
    }


def random_commands(seed: int, count: int) -> list[bytes]:
    """A mix of everything apply handles, deterministic in ``seed``."""
    rng = random.Random(seed)
    out: list[bytes] = []
    n = 0
    keys: list[str] = []
    topics = {"t": 4}
    out.append(command([B(f"init{seed}", [], creates=dict(topics))]))
    for c in range(count - 1):
        if rng.random() < 0.05:
            out.append(barrier())
            continue
        batches = []
        for b in range(rng.randint(1, 4)):
            roll = rng.random()
            if keys and roll < 0.1:
                batches.append(B(rng.choice(keys)))  # a retry of an earlier batch
                continue
            key = f"c{c}b{b}"
            keys.append(key)
            creates = None
            if roll < 0.2:
                name = f"new{c}"
                creates = {name: rng.randint(1, 3)}
                topics[name] = creates[name]
            msgs = []
            for _ in range(rng.randint(0, 6)):
                n += 1
                topic = rng.choice(sorted(topics))
                qid = rng.randrange(topics[topic] + (1 if rng.random() < 0.03 else 0))
                msgs.append((topic, qid, rng.randbytes(rng.randint(0, 900)), n))
            expect = {"k0": rng.randint(0, 3)} if roll > 0.85 else None
            updates = {f"k{rng.randint(0, 3)}": rng.choice([rng.randint(0, 3), "s", None])}
            batches.append(B(key, msgs, expect=expect, updates=updates, creates=creates))
        if rng.random() < 0.1:
            batches.append(B(batches[0].key, batches[0].messages))  # repeated in one command
        out.append(command(batches))
    return out


# ---------------------------------------------------------------------- determinism


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_two_stores_applying_the_same_commands_are_identical(
    make_store: StoreFactory, seed: int
) -> None:
    a = make_store("a")
    b = make_store("b")
    apply_a, apply_b = Applier(a), Applier(b)
    for data in random_commands(seed, 150):
        ra, rb = apply_a(data), apply_b(data)
        assert ra == rb, f"seed {seed}"
    assert a.commitlog.length > 5 * SEG, f"seed {seed}"
    assert state(a) == state(b), f"seed {seed}"
    assert a.digest()["length"] == a.commitlog.length


def test_digest_changes_with_every_write(store: Store) -> None:
    apply = Applier(store)
    seen = {store.digest()["chain"]}
    for i in range(10):
        apply(command([B(f"k{i}", [("t", 0, b"x", i)], creates={"t": 1})]))
        seen.add(store.digest()["chain"])
    assert len(seen) == 11
    assert store.digest()["index"] == 10


def test_different_bytes_give_different_digests(make_store: StoreFactory) -> None:
    a, b = make_store("a"), make_store("b")
    Applier(a)(command([B("k", [("t", 0, b"x", 1)], creates={"t": 1})]))
    Applier(b)(command([B("k", [("t", 0, b"y", 1)], creates={"t": 1})]))
    assert a.digest()["length"] == b.digest()["length"]
    assert a.digest()["chain"] != b.digest()["chain"]


# ---------------------------------------------------------------------- apply basics


def test_apply_places_messages_and_indexes_them(store: Store) -> None:
    apply = Applier(store)
    res = apply(
        command(
            [
                B(
                    "k1",
                    [("t", 0, b"a", 1), ("t", 1, b"b", 2), ("t", 0, b"c", 3)],
                    creates={"t": 2},
                ),
                B("k2", [("u", 0, b"d", 4)], creates={"u": 1}, tags_code=99),
            ]
        )
    )
    assert res.index == 1
    assert res.messages == 4
    assert res.bytes_written == store.commitlog.length
    assert [o.status for o in res.outcomes] == [OK, OK]
    placed = res.outcomes[0].placed
    assert [(p.topic, p.queue_id, p.queue_offset) for p in placed] == [
        ("t", 0, 0),
        ("t", 1, 0),
        ("t", 0, 1),
    ]
    assert [p.msg_id for p in placed] == [msg_id(1), msg_id(2), msg_id(3)]
    assert store.topics == {"t": [2, 1], "u": [1]}
    msgs = store.read_messages("t", 0, 0, 10)
    assert [m.body for m in msgs] == [b"a", b"c"]
    assert [(m.queue_offset, m.physical_offset) for m in msgs] == [
        (0, placed[0].physical_offset),
        (1, placed[2].physical_offset),
    ]
    [unit] = store.read_units("u", 0, 0, 10)
    assert unit.tags_code == 99
    assert store.max_offset("t", 0) == 2
    assert store.max_offset("t", 5) == 0
    assert store.max_offset("nope", 0) == 0
    assert store.queue_count("t") == 2
    assert store.queue_count("nope") is None
    assert store.read_messages("t", 0, 2, 10) == []


def test_barrier_moves_only_the_index(store: Store) -> None:
    apply = Applier(store)
    apply(command([B("k", [("t", 0, b"a", 1)], creates={"t": 1})]))
    before = state(store)
    res = apply(barrier())
    assert res.outcomes == ()
    assert store.applied_index == 2
    after = state(store)
    assert after["commitlog"] == before["commitlog"]
    assert after["digest"] == {**before["digest"], "index": 2}  # type: ignore[dict-item]


def test_apply_listeners_run_and_a_failing_one_is_contained(store: Store) -> None:
    seen: list[int] = []

    def bad(_: ApplyResult) -> None:
        raise RuntimeError("listener bug")

    store.listeners += [bad, lambda r: seen.append(r.index)]
    Applier(store)(command([B("k", [], updates={"a": 1})]))
    assert seen == [1]


# ---------------------------------------------------------------------- idempotency


def test_repeated_key_returns_the_original_placement(store: Store) -> None:
    apply = Applier(store)
    first = apply(command([B("key", [("t", 0, b"a", 1), ("t", 0, b"b", 2)], creates={"t": 1})]))
    length = store.commitlog.length
    chain = store.chain
    again = apply(command([B("key", [("t", 0, b"other", 3)], creates={"t": 1})]))
    assert again.messages == 0
    assert store.commitlog.length == length
    assert store.chain == chain
    [o1], [o2] = first.outcomes, again.outcomes
    assert o2.duplicate and not o1.duplicate
    assert o2.status == OK
    assert o2.placed == o1.placed
    assert store.max_offset("t", 0) == 2


def test_repeated_key_across_blanks_and_segments(store: Store) -> None:
    apply = Applier(store)
    big = b"z" * 2500
    first = apply(command([B("k", [("t", 0, big, i) for i in range(5)], creates={"t": 1})]))
    assert store.commitlog.length > 4 * SEG
    again = apply(command([B("k", [("t", 0, big, 9)])]))
    assert again.outcomes[0].placed == first.outcomes[0].placed


def test_key_repeated_inside_one_command(store: Store) -> None:
    apply = Applier(store)
    res = apply(
        command(
            [
                B("k", [("t", 0, b"a", 1)], creates={"t": 1}),
                B("other", [("t", 0, b"b", 2)]),
                B("k", [("t", 0, b"a", 1)]),
            ]
        )
    )
    assert res.messages == 2
    assert [o.key for o in res.outcomes] == ["k", "other", "k"]
    first, _, repeat = res.outcomes
    assert not first.duplicate and repeat.duplicate
    assert first.placed and repeat.placed == first.placed
    assert store.max_offset("t", 0) == 2
    # And in a later command, the same answer again.
    later = apply(command([B("k", [("t", 0, b"a", 1)])]))
    assert later.outcomes[0].placed == first.placed


def test_repeat_of_a_failed_batch_fails_the_same_way(store: Store) -> None:
    apply = Applier(store)
    res = apply(
        command(
            [
                B("k", [("t", 0, b"a", 1)], creates={"t": 1}, expect={"x": 1}),
                B("k", [("t", 0, b"a", 1)], creates={"t": 1}),
            ]
        )
    )
    assert [o.status for o in res.outcomes] == [CONDITION_FAILED, CONDITION_FAILED]
    assert res.outcomes[1].duplicate
    later = apply(command([B("k", [("t", 0, b"a", 1)], creates={"t": 1})]))
    assert later.outcomes[0].status == CONDITION_FAILED
    assert later.outcomes[0].duplicate
    assert store.commitlog.length == 0


def test_idempotency_window_is_bounded(make_store: StoreFactory) -> None:
    s = make_store("w", idempotency_window_batches=3)
    apply = Applier(s)
    for i in range(5):
        apply(command([B(f"k{i}", [], updates={"n": i})]))
    assert list(s.idem) == ["k2", "k3", "k4"]
    # k0 has left the window: applied again.
    res = apply(command([B("k0", [], updates={"n": 100})]))
    assert not res.outcomes[0].duplicate
    assert s.kv["n"] == 100


# ---------------------------------------------------------------------- conditions and tables


def test_failed_condition_writes_nothing(store: Store) -> None:
    apply = Applier(store)
    apply(command([B("setup", [("t", 0, b"a", 1)], creates={"t": 1}, updates={"off": 5})]))
    before = state(store)
    res = apply(
        command(
            [
                B(
                    "k",
                    [("t", 0, b"b", 2), ("new", 0, b"c", 3)],
                    expect={"off": 4},
                    updates={"off": 6, "other": "x"},
                    creates={"new": 1},
                )
            ]
        )
    )
    [o] = res.outcomes
    assert o.status == CONDITION_FAILED
    assert "off" in o.detail
    assert res.messages == 0 and res.bytes_written == 0
    after = state(store)
    assert after["idem"] != before["idem"]  # the key is remembered
    for name in ("topics", "kv", "commitlog", "consumequeue"):
        assert after[name] == before[name], name
    assert after["digest"] == {**before["digest"], "index": 2}  # type: ignore[dict-item]


def test_conditions_that_hold(store: Store) -> None:
    apply = Applier(store)
    apply(command([B("a", [], updates={"off": 5, "name": "x"})]))
    res = apply(
        command([B("b", [], expect={"off": 5, "name": "x", "absent": None}, updates={"off": 6})])
    )
    assert res.outcomes[0].status == OK
    assert store.kv == {"off": 6, "name": "x"}


def test_a_later_batch_sees_an_earlier_batch_of_the_same_command(store: Store) -> None:
    res = Applier(store)(
        command([B("a", [], updates={"v": 1}), B("b", [], expect={"v": 1}, updates={"v": 2})])
    )
    assert [o.status for o in res.outcomes] == [OK, OK]
    assert store.kv == {"v": 2}


def test_the_records_are_written_before_the_kv_moves(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reader on another thread that sees a progress key move (a delay level's offset, read
    by the message lookup) finds the records the command wrote: apply writes them first. It
    used to set kv first, and a lookup between the two answered "delivered" without the
    delivered copy."""
    apply = Applier(store)
    apply(command([B("setup", [("t", 0, b"a", 1)], creates={"t": 1}, updates={"off": 1})]))
    seen: list[object] = []
    write = store._write_records

    def watching(*args: Any, **kwargs: Any) -> Any:
        seen.append(store.kv.get("off"))
        return write(*args, **kwargs)

    monkeypatch.setattr(store, "_write_records", watching)
    res = apply(command([B("move", [("t", 0, b"b", 2)], expect={"off": 1}, updates={"off": 2})]))
    assert res.outcomes[0].status == OK
    assert seen == [1]  # still the old offset while the record was written
    assert store.kv["off"] == 2


def test_updates_and_deletes(store: Store) -> None:
    apply = Applier(store)
    apply(command([B("1", [], updates={"a": 1, "b": "two", "c": 3})]))
    assert store.kv == {"a": 1, "b": "two", "c": 3}
    apply(command([B("2", [], updates={"a": 10, "b": None, "missing": None})]))
    assert store.kv == {"a": 10, "c": 3}
    res = apply(command([B("3", [], updates={"c": None})]))
    assert res.outcomes[0].status == OK and res.outcomes[0].placed == ()
    assert store.kv == {"a": 10}


def test_creates(store: Store) -> None:
    apply = Applier(store)
    apply(command([B("1", [], creates={"t": 3, "%RETRY%g": 1})]))
    assert store.topics == {"t": [0, 0, 0], "%RETRY%g": [0]}
    apply(command([B("2", [("t", 2, b"x", 1)])]))
    # Creating an existing topic changes nothing.
    apply(command([B("3", [], creates={"t": 8})]))
    assert store.topics["t"] == [0, 0, 1]


def test_message_for_a_missing_queue_writes_nothing(store: Store) -> None:
    apply = Applier(store)
    apply(command([B("setup", [("t", 0, b"a", 1)], creates={"t": 2}, updates={"v": 1})]))
    before = state(store)
    res = apply(
        command(
            [
                B("bad-queue", [("t", 0, b"ok", 2), ("t", 2, b"no", 3)], updates={"v": 2}),
                B("bad-topic", [("nope", 0, b"no", 4)]),
                B("bad-create", [("made", 1, b"no", 5)], creates={"made": 1, "side": 2}),
            ]
        )
    )
    assert [o.status for o in res.outcomes] == [BAD_QUEUE, BAD_QUEUE, BAD_QUEUE]
    assert "no queue 2" in res.outcomes[0].detail
    assert res.messages == 0
    after = state(store)
    for name in ("topics", "kv", "commitlog", "consumequeue"):
        assert after[name] == before[name], name
    assert "made" not in store.topics and "side" not in store.topics


def test_a_bad_batch_does_not_stop_the_others(store: Store) -> None:
    res = Applier(store)(
        command(
            [
                B("good1", [("t", 0, b"a", 1)], creates={"t": 1}),
                B("bad", [("t", 7, b"b", 2)]),
                B("good2", [("t", 0, b"c", 3)]),
            ]
        )
    )
    assert [o.status for o in res.outcomes] == [OK, BAD_QUEUE, OK]
    assert [m.body for m in store.read_messages("t", 0, 0, 10)] == [b"a", b"c"]
    assert [m.msg_id for m in store.read_messages("t", 0, 0, 10)] == [msg_id(1), msg_id(3)]


def test_creation_with_the_messages_that_use_it(store: Store) -> None:
    res = Applier(store)(command([B("k", [("fresh", 2, b"x", 1)], creates={"fresh": 3})]))
    assert res.outcomes[0].status == OK
    assert store.topics == {"fresh": [0, 0, 1]}


# ---------------------------------------------------------------------- snapshots


def _populate(s: Store, seed: int = 11, count: int = 60) -> Applier:
    apply = Applier(s)
    for data in random_commands(seed, count):
        apply(data)
    return apply


def test_snapshot_round_trip(store: Store) -> None:
    _populate(store)
    raft = {"s": [1, 2], "cluster": ["a", "b"]}
    data = store.snapshot(raft)
    snap = Store.parse_snapshot(data)
    assert snap["index"] == store.applied_index
    assert snap["length"] == store.applied_length == store.commitlog.length
    assert snap["chain"] == store.chain.hex()
    assert snap["segment_bytes"] == SEG
    assert snap["topics"] == store.topics
    assert snap["kv"] == store.kv
    assert [tuple(x) for x in snap["idem"]] == [(k, *v) for k, v in store.idem.items()]
    assert snap["raft"] == raft
    assert data[:8] == b"CMQSNAP1"
    assert store.snapshot(raft) == data  # nothing in it depends on time


def test_snapshot_of_an_empty_store(make_store: StoreFactory) -> None:
    a, b = make_store("a"), make_store("b")
    snap = Store.parse_snapshot(a.snapshot({}))
    assert snap["length"] == 0
    b.restore(snap, lambda target: pytest.fail("nothing to fetch"))
    assert b.digest() == a.digest()


def _corruptions(data: bytes) -> list[tuple[str, bytes]]:
    payload_at = 8 + 8 + 32
    flipped = bytearray(data)
    flipped[payload_at + 10] ^= 1
    bad_hash = bytearray(data)
    bad_hash[20] ^= 1
    bad_magic = b"CMQSNAP2" + data[8:]
    head = struct.Struct(">8sQ32s")
    v3 = orjson.dumps({"v": snapshot_module.SNAPSHOT_VERSION + 1})
    return [
        ("flipped payload", bytes(flipped)),
        ("bad hash", bytes(bad_hash)),
        ("bad magic", bad_magic),
        ("truncated", data[:-1]),
        ("truncated header", data[:30]),
        ("empty", b""),
        ("overlong", data + b"\x00"),
        ("other version", head.pack(b"CMQSNAP1", len(v3), hashlib.sha256(v3).digest()) + v3),
    ]


def test_corrupted_snapshots_are_rejected(store: Store) -> None:
    _populate(store, count=10)
    data = store.snapshot({})
    for name, bad in _corruptions(data):
        with pytest.raises(StoreCorruption):
            Store.parse_snapshot(bad)
            pytest.fail(name)


def test_entry_codec() -> None:
    entry = (b"\x00\x01cmd", 17, 3)
    assert decode_entry(encode_entry(entry)) == entry
    assert decode_entry(orjson.loads(orjson.dumps(encode_entry(entry)))) == entry


# ---------------------------------------------------------------------- restore


def _fetcher(
    source: Store, target: Store, calls: list[tuple[int, int]] | None = None
) -> Callable[[FetchTarget], None]:
    """A fetch that appends ``source``'s bytes to ``target``, noting each call in ``calls``."""

    def fetch(into: FetchTarget) -> None:
        assert into.start == target.commitlog.length
        if calls is not None:
            calls.append((into.start, into.end))
        into.write(source.commitlog.read_range(into.start, into.end))

    return fetch


def test_restore_truncates_a_longer_commitlog(store: Store) -> None:
    apply = _populate(store, count=40)
    snap = Store.parse_snapshot(store.snapshot({}))
    at_snapshot = state(store)
    later = random_commands(99, 30)
    for data in later:
        apply(data)
    after_later = state(store)
    assert store.commitlog.length > int(snap["length"])
    store.restore(snap, lambda target: pytest.fail("nothing to fetch"))
    assert state(store) == at_snapshot
    # Replaying the same entries gives the same state again, not a doubled one.
    replay = Applier(store, index=int(snap["index"]))
    for data in later:
        replay(data)
    assert state(store) == after_later


def test_restore_then_replay_matches_a_store_that_never_restored(make_store: StoreFactory) -> None:
    a, b = make_store("a"), make_store("b")
    cmds = random_commands(5, 80)
    apply_a, apply_b = Applier(a), Applier(b)
    for data in cmds[:50]:
        apply_a(data)
        apply_b(data)
    snap = Store.parse_snapshot(b.snapshot({}))
    for data in cmds[50:]:
        apply_b(data)
    b.restore(snap, lambda target: pytest.fail("nothing to fetch"))
    replay = Applier(b, index=50)
    for data in cmds[50:]:
        apply_a(data)
        replay(data)
    assert state(a) == state(b)


def test_restore_into_an_empty_store_fetches_the_commitlog(make_store: StoreFactory) -> None:
    a, b = make_store("a"), make_store("b")
    _populate(a, count=80)
    snap = Store.parse_snapshot(a.snapshot({}))
    calls: list[tuple[int, int]] = []
    fetch = _fetcher(a, b, calls)
    b.restore(snap, fetch)
    assert calls == [(0, a.commitlog.length)]
    assert b.digest() == a.digest()
    assert state(b) == state(a)
    for (topic, qid), n in b.cqs.queues().items():
        assert b.read_messages(topic, qid, 0, 1000) == a.read_messages(topic, qid, 0, 1000)
        assert len(b.read_messages(topic, qid, 0, 1000)) == n == a.max_offset(topic, qid)
    # Both go on identically.
    apply_a, apply_b = Applier(a, a.applied_index), Applier(b, b.applied_index)
    for data in random_commands(7, 20):
        assert apply_a(data) == apply_b(data)
    assert state(a) == state(b)


@pytest.mark.parametrize("compare", [False, True], ids=["no-peer", "tail-agrees"])
def test_restore_into_a_store_that_is_behind(make_store: StoreFactory, compare: bool) -> None:
    """A store behind the snapshot fetches only what it lacks, whether or not its tail is first
    compared with a peer's (an agreeing tail is kept)."""
    a, b = make_store("a"), make_store("b")
    cmds = random_commands(21, 60)
    apply_a, apply_b = Applier(a), Applier(b)
    for data in cmds[:20]:
        apply_a(data)
        apply_b(data)
    for data in cmds[20:]:
        apply_a(data)
    have = b.commitlog.length
    calls: list[tuple[int, int]] = []
    fetch = _fetcher(a, b, calls)
    peer = _peer_bytes(a) if compare else None
    b.restore(Store.parse_snapshot(a.snapshot({})), fetch, peer)
    assert calls == [(have, a.commitlog.length)]
    assert state(b) == state(a)


def _peer_bytes(source: Store) -> Callable[[int, int], bytes | None]:
    def read(start: int, end: int) -> bytes | None:
        if end > source.commitlog.length:
            return None
        return source.commitlog.read_range(start, end)

    return read


@pytest.mark.parametrize("window", [512, 1 << 20])
def test_restore_replaces_a_tail_the_cluster_never_committed(
    make_store: StoreFactory, monkeypatch: pytest.MonkeyPatch, window: int
) -> None:
    """A replica that applied entries the cluster replaced (a cut-off leader's) is repaired."""
    monkeypatch.setattr(snapshot_module, "COMPARE_WINDOW_BYTES", window)
    a, b = make_store("a"), make_store("b")
    cmds = random_commands(31, 90)
    apply_a, apply_b = Applier(a), Applier(b)
    for data in cmds[:30]:
        apply_a(data)
        apply_b(data)
    common = b.commitlog.length
    for data in random_commands(77, 8):
        apply_b(data)
    for data in cmds[30:]:
        apply_a(data)
    assert common < b.commitlog.length < a.commitlog.length
    calls: list[tuple[int, int]] = []
    fetch = _fetcher(a, b, calls)
    b.restore(Store.parse_snapshot(a.snapshot({})), fetch, _peer_bytes(a))
    assert calls == [(0, a.commitlog.length)]
    assert state(b) == state(a)
    for (topic, qid), n in b.cqs.queues().items():
        assert b.read_messages(topic, qid, 0, 10_000) == a.read_messages(topic, qid, 0, 10_000)
        assert n == a.max_offset(topic, qid)


def test_restore_rebuilds_lost_consumequeues(make_store: StoreFactory, tmp_path: Path) -> None:
    a = make_store("a")
    _populate(a, count=50)
    snap = Store.parse_snapshot(a.snapshot({}))
    queues = a.cqs.queues()
    a.close()
    for path in (tmp_path / "a" / "consumequeue").rglob("0*"):
        path.unlink()
    b = make_store("a")  # same directory, ConsumeQueues gone
    assert b.cqs.queues() == {}
    b.restore(snap, lambda target: pytest.fail("nothing to fetch"))
    assert b.cqs.queues() == queues
    assert sum(queues.values()) > 50
    for (topic, qid), n in b.cqs.queues().items():
        msgs = b.read_messages(topic, qid, 0, 10_000)
        assert [m.queue_offset for m in msgs] == list(range(n))
        assert all(m.topic == topic and m.queue_id == qid for m in msgs)


def test_fetch_that_falls_short_is_corruption(make_store: StoreFactory) -> None:
    a, b = make_store("a"), make_store("b")
    _populate(a, count=30)
    snap = Store.parse_snapshot(a.snapshot({}))
    with pytest.raises(StoreCorruption, match="incomplete"):
        b.restore(snap, lambda target: None)


def test_diverged_tail_is_fetched_again_and_corruption_without_a_peer(
    make_store: StoreFactory,
) -> None:
    """A CommitLog as long as the snapshot's whose bytes differ (damaged or diverged) is
    discarded and fetched whole from a peer, checked against the chain; with no peer to
    send it, the restore fails naming the CommitLog."""
    a, b = make_store("a"), make_store("b")
    Applier(a)(command([B("k", [("t", 0, b"A" * 300, 1)], creates={"t": 1})]))
    Applier(b)(command([B("k", [("t", 0, b"B" * 300, 1)], creates={"t": 1})]))
    assert a.commitlog.length == b.commitlog.length
    snap = Store.parse_snapshot(a.snapshot({}))
    with pytest.raises(StoreCorruption, match="incomplete"):
        b.restore(snap, lambda target: None)
    assert b.commitlog.length == 0  # nothing unchecked is kept
    calls: list[tuple[int, int]] = []
    b.restore(snap, _fetcher(a, b, calls))
    assert calls == [(0, a.commitlog.length)]
    assert state(b) == state(a)


def test_segment_bytes_mismatch_is_rejected(make_store: StoreFactory) -> None:
    a = make_store("a", segment_bytes=SEG)
    b = make_store("b", segment_bytes=2 * SEG)
    _populate(a, count=5)
    before = state(b)
    with pytest.raises(StoreCorruption, match="segment_bytes"):
        b.restore(Store.parse_snapshot(a.snapshot({})), lambda target: pytest.fail("no fetch"))
    assert state(b) == before


def test_reset_empties_everything(store: Store) -> None:
    _populate(store, count=20)
    store.reset()
    assert store.commitlog.length == 0
    assert store.cqs.queues() == {}
    assert (store.topics, store.kv, len(store.idem)) == ({}, {}, 0)
    assert store.digest() == {"index": 0, "length": 0, "chain": bytes(16).hex()}
    assert record.BLANK_SIZE == 8


def _every_record_indexed(s: Store) -> None:
    """Every message record of the CommitLog is the one its ConsumeQueue unit points at, and
    every queue holds exactly its topic table's count."""
    per_queue: dict[tuple[str, int], int] = {}
    for at, data in s.commitlog.iter_records(0):
        msg = record.decode(data)
        key = (msg.topic, msg.queue_id)
        assert msg.queue_offset == per_queue.get(key, 0), f"{key} out of order at {at}"
        per_queue[key] = msg.queue_offset + 1
        [unit] = s.read_units(msg.topic, msg.queue_id, msg.queue_offset, 1)
        assert (unit.commitlog_offset, unit.size) == (at, len(data))
    counts = {(t, q): n for t, qs in s.topics.items() for q, n in enumerate(qs) if n}
    assert counts == per_queue
    assert {k: n for k, n in s.cqs.queues().items() if n} == per_queue


@pytest.mark.parametrize("seed", [3, 17, 40])
def test_the_same_snapshot_installed_again_after_entries_past_it(
    make_store: StoreFactory, seed: int
) -> None:
    """A follower far behind may be sent the same snapshot several times, applying some of
    the entries after it in between (its answers to old append messages rewind the leader's
    view of it). Each install takes it back to exactly the snapshot's state; replaying the
    entries after it gives what a replica that never restored has, every message readable."""
    leader, follower = make_store("leader"), make_store("follower")
    cmds = random_commands(seed, 120)
    apply_leader, apply_follower = Applier(leader), Applier(follower)
    for data in cmds[:30]:
        apply_leader(data)
        apply_follower(data)
    for data in cmds[30:80]:
        apply_leader(data)
    snap_bytes = leader.snapshot({})
    for data in cmds[80:]:
        apply_leader(data)
    rng = random.Random(seed)
    for _round in range(4):
        follower.restore(
            Store.parse_snapshot(snap_bytes), _fetcher(leader, follower), _peer_bytes(leader)
        )
        _every_record_indexed(follower)
        replay = Applier(follower, index=80)
        for data in cmds[80 : 80 + rng.randint(0, 40)]:
            replay(data)
        _every_record_indexed(follower)
    follower.restore(
        Store.parse_snapshot(snap_bytes), _fetcher(leader, follower), _peer_bytes(leader)
    )
    replay = Applier(follower, index=80)
    for data in cmds[80:]:
        replay(data)
    _every_record_indexed(follower)
    assert state(follower) == state(leader)


def test_holds_a_snapshot_it_went_past_along_the_same_history_only(
    make_store: StoreFactory,
) -> None:
    a, b, c = make_store("a"), make_store("b"), make_store("c")
    cmds = random_commands(8, 60)
    apply_a, apply_b, apply_c = Applier(a), Applier(b), Applier(c)
    for data in cmds[:30]:
        apply_a(data)
        apply_b(data)
        apply_c(data)
    at_30 = Store.parse_snapshot(a.snapshot({}))
    assert a.holds(at_30, lambda start, end: pytest.fail("nothing past the snapshot"))
    for data in cmds[30:]:
        apply_a(data)
        apply_b(data)
    assert a.holds(at_30, _peer_bytes(b))  # past it, along the same history
    assert not a.holds(at_30, lambda start, end: None)  # no peer to tell
    # c went on with a command the cluster never committed: its tail is not the peers'.
    apply_c(command([B("other", [("t", 0, b"not the leader's" * 20, 10**6)])]))
    assert c.commitlog.length > int(at_30["length"])
    assert not c.holds(at_30, _peer_bytes(a))
    # Nor does a store behind a snapshot hold it.
    assert c.commitlog.length < a.commitlog.length
    assert not c.holds(Store.parse_snapshot(a.snapshot({})), _peer_bytes(a))


# ---------------------------------------------------------------------- fetched bytes and the chain


def test_fetched_bytes_that_fail_the_chain_are_never_taken(make_store: StoreFactory) -> None:
    a, b = make_store("a"), make_store("b")
    _populate(a, count=40)
    snap = Store.parse_snapshot(a.snapshot({}))
    before = state(b)

    def lie(into: FetchTarget) -> None:
        data = bytearray(a.commitlog.read_range(into.start, into.end))
        data[len(data) // 2] ^= 1
        into.write(bytes(data))

    with pytest.raises(StoreCorruption, match="fail the hash chain"):
        b.restore(snap, lie)
    assert b.commitlog.length == 0 and state(b) == before
    b.restore(snap, _fetcher(a, b))
    assert state(b) == state(a)


def test_a_restarted_store_shorter_than_the_snapshot_fetches_everything(
    make_store: StoreFactory,
) -> None:
    """At start the chain of a local CommitLog shorter than the snapshot is not known: every
    byte is fetched again, so that every byte is checked."""
    a, b = make_store("a"), make_store("b")
    cmds = random_commands(12, 60)
    apply_a, apply_b = Applier(a), Applier(b)
    for data in cmds[:20]:
        apply_a(data)
        apply_b(data)
    for data in cmds[20:]:
        apply_a(data)
    b.close()
    b = make_store("b")  # reopened: its CommitLog is there, its chain is not
    assert b.commitlog.length > 0
    calls: list[tuple[int, int]] = []
    b.restore(Store.parse_snapshot(a.snapshot({})), _fetcher(a, b, calls), _peer_bytes(a))
    assert calls == [(0, a.commitlog.length)]
    assert state(b) == state(a)


def test_a_format_1_snapshot_is_still_restored(make_store: StoreFactory) -> None:
    a, b = make_store("a"), make_store("b")
    _populate(a, count=30)
    snap = dict(Store.parse_snapshot(a.snapshot({})))
    snap["v"] = 1
    snap["chain"] = "00" * 16  # a chain over commands: means nothing now
    del snap["chain_block"]
    b.restore(snap, _fetcher(a, b))
    assert state(b) == state(a)
    a.restore(snap, lambda target: pytest.fail("nothing to fetch"))
    assert a.digest() == b.digest()


def test_a_fetch_that_fails_halfway_leaves_nothing_behind(make_store: StoreFactory) -> None:
    a, b = make_store("a"), make_store("b")
    _populate(a, count=40)
    snap = Store.parse_snapshot(a.snapshot({}))

    def half_then_give_up(into: FetchTarget) -> None:
        into.write(a.commitlog.read_range(into.start, (into.start + into.end) // 2))
        raise TimeoutError("no peer could serve the rest")

    with pytest.raises(TimeoutError):
        b.restore(snap, half_then_give_up)
    assert b.commitlog.length == 0 and b.applied_length == 0


class _RecordingExtension:
    """An apply extension that records the kv it was attached to."""

    name = "rec"

    def __init__(self) -> None:
        self.attached: list[dict[str, object]] = []

    def attach(self, store: Store) -> None:
        self.attached.append(dict(store.kv))

    def apply(self, ctx: object, payload: object) -> None:
        return None

    def before_snapshot(self, index: int) -> None:
        return None

    def close(self) -> None:
        return None


def test_an_extension_registered_before_the_snapshot_is_restored_attaches_to_it(
    make_store: StoreFactory,
) -> None:
    """A node with a snapshot: pysyncobj restores it on its first tick, which may come after
    the services registered. Attaching them to the empty state then would make the timer cut
    its TimerLog to 0 and wait for peers that did the same; they attach to the snapshot."""
    a = make_store("a")
    _populate(a, count=20)
    Applier(a)(command([B("kv", [], updates={"timer/tl": 160})]))
    snap = Store.parse_snapshot(a.snapshot({}))
    b = make_store("b")
    b.settled = False  # what ReplicatedLog sets when a snapshot file exists
    ext = _RecordingExtension()
    b.register_extension(ext)
    assert ext.attached == []
    b.restore(snap, _fetcher(a, b, []))
    assert len(ext.attached) == 1 and ext.attached[0]["timer/tl"] == 160
    assert b.settled


@pytest.mark.parametrize("flush", ["async", "sync"])
def test_a_snapshot_never_covers_commitlog_bytes_a_power_cut_can_take(
    make_store: StoreFactory, spy: FsyncSpy, flush: str
) -> None:
    """The journal entries a snapshot covers are dropped after it: under either setting the
    CommitLog it names is synced before the snapshot's bytes exist. Under ``flush="sync"``
    applying does not fsync (the journal was synced before the entries were acknowledged)."""
    s = make_store(flush=flush, flush_interval_ms=60_000)
    apply = Applier(s)
    spy.calls.clear()
    for cmd in random_commands(5, 20):
        apply(cmd)
    assert not [p for p in spy.paths() if "/commitlog/0" in p]  # nothing synced per apply
    s.snapshot({})
    synced = {p for p in spy.paths() if "/commitlog/0" in p}
    assert synced == {str(p) for p in segment_files(s.data_dir / "commitlog")}
    assert not s.commitlog._dirty
