"""Client idempotency keys in the store: window by propose time, fingerprints, bound, snapshots.

A client's key (a batch with a fingerprint) is remembered for a window of propose times with
the fingerprint of its request; internal keys (no fingerprint) by count, apart. The limits
travel in the command, so replicas configured differently still forget the same keys.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import orjson
import pytest

from chronomq.raftlog import command as cmdcodec
from chronomq.raftlog.clientkeys import CLIENT_ENTRY, key_digest
from chronomq.raftlog.errors import StoreCorruption
from chronomq.raftlog.snapshot import SNAPSHOT_MAGIC
from chronomq.raftlog.store import KEY_REUSED, OK, ApplyResult, Store

from ._util import STORE_MS, rec

SEG = 64 * 1024
WINDOW_MS = 10_000
LIMITS = cmdcodec.IdemLimits(client_window_ms=WINDOW_MS, client_max_keys=1000, internal_keys=50)

# (key, fingerprint or None, bodies)
Batch = tuple[str, str | None, Sequence[bytes]]


def fp(name: str) -> str:
    return hashlib.blake2b(name.encode(), digest_size=16).hexdigest()


class Cmds:
    """Builds APPEND commands to topic ``t`` (queue 0) with unique message ids."""

    def __init__(self) -> None:
        self.n = 0

    def __call__(
        self,
        batches: Sequence[Batch],
        propose_ms: int = STORE_MS,
        limits: cmdcodec.IdemLimits | None = LIMITS,
    ) -> bytes:
        metas: list[tuple[int, int, int]] = []
        parts: list[bytes] = []
        out: list[cmdcodec.Batch] = []
        for key, fingerprint, bodies in batches:
            for body in bodies:
                self.n += 1
                data = rec("t", 0, body, self.n)
                metas.append((0, 0, len(data)))
                parts.append(data)
            out.append(cmdcodec.Batch(key, len(bodies), None, None, {"t": 1}, fingerprint))
        return cmdcodec.encode(
            cmdcodec.Command(
                kind=cmdcodec.Kind.APPEND,
                propose_ms=propose_ms,
                batches=tuple(out),
                topics=("t",) if metas else (),
                messages=tuple(metas),
                blob=b"".join(parts),
                idem=limits,
            )
        )


class Replicas:
    """Stores fed the same commands; each apply checks they answer and hold the same."""

    def __init__(self, stores: Sequence[Store]) -> None:
        self.stores = stores
        self.index = 0

    def __call__(self, data: bytes) -> ApplyResult:
        self.index += 1
        results = [s.apply(data, self.index) for s in self.stores]
        assert all(r == results[0] for r in results[1:])
        first = self.stores[0]
        for s in self.stores[1:]:
            assert s.digest() == first.digest()
            assert list(s.clients.items()) == list(first.clients.items())
            assert list(s.idem.items()) == list(first.idem.items())
        return results[0]


@pytest.fixture
def make_store(tmp_path: Path) -> Iterator[Callable[..., Store]]:
    stores: list[Store] = []

    def make(name: str, **kw: int) -> Store:
        s = Store(tmp_path / name, segment_bytes=SEG, **kw)
        stores.append(s)
        return s

    yield make
    for s in stores:
        s.close()


@pytest.fixture
def two(make_store: Callable[..., Store]) -> Replicas:
    # Configured differently on purpose: the command's limits are the ones that count.
    return Replicas(
        [
            make_store("a"),
            make_store("b", client_window_ms=1, client_max_keys=1, idempotency_window_batches=1),
        ]
    )


def test_a_replay_within_the_window_answers_the_first_placement(two: Replicas) -> None:
    cmds = Cmds()
    first = two(cmds([("k", fp("r1"), [b"a", b"b"])]))
    length = two.stores[0].commitlog.length
    again = two(cmds([("k", fp("r1"), [b"a", b"b"])], STORE_MS + WINDOW_MS - 1))
    [o1], [o2] = first.outcomes, again.outcomes
    assert o1.status == o2.status == OK
    assert o2.duplicate and not o1.duplicate
    assert o2.placed == o1.placed
    assert again.messages == 0
    assert two.stores[0].commitlog.length == length


def test_the_window_is_measured_in_propose_times(two: Replicas) -> None:
    cmds = Cmds()
    two(cmds([("k", fp("r1"), [b"a"])]))
    # Other commands move the propose time on; the key expires with it, not with a clock.
    two(cmds([("other", fp("o"), [b"o"])], STORE_MS + WINDOW_MS))
    assert two.stores[0].client_key("k") is None
    anew = two(cmds([("k", fp("r1"), [b"a"])], STORE_MS + WINDOW_MS))
    [o] = anew.outcomes
    assert o.status == OK and not o.duplicate and anew.messages == 1
    known = two.stores[0].client_key("k")
    assert known is not None and known.propose_ms == STORE_MS + WINDOW_MS


def test_an_expired_key_behind_a_younger_one_is_not_replayed(two: Replicas) -> None:
    """Propose times may step back across leaders: expiry at the front stops at a younger
    entry, and lookups check each entry's own time."""
    cmds = Cmds()
    two(cmds([("young", fp("y"), [b"y"])], STORE_MS + 5_000))
    two(cmds([("old", fp("o"), [b"o"])], STORE_MS))  # a leader whose clock is behind
    res = two(cmds([("old", fp("o2"), [b"o"])], STORE_MS + WINDOW_MS + 1))
    [o] = res.outcomes
    assert o.status == OK and not o.duplicate  # expired: neither a replay nor a reuse
    assert list(two.stores[0].clients) == [key_digest("young"), key_digest("old")]


def test_another_request_with_the_key_is_rejected_on_every_replica(two: Replicas) -> None:
    cmds = Cmds()
    first = two(cmds([("k", fp("r1"), [b"a"])]))
    before = two.stores[0].digest()["chain"]
    res = two(cmds([("k", fp("r2"), [b"other"])], STORE_MS + 1))
    [o] = res.outcomes
    assert o.status == KEY_REUSED and not o.duplicate and not o.placed
    assert "Idempotency-Key" in o.detail
    assert res.messages == 0 and two.stores[0].digest()["chain"] == before
    # The first request is still what the key answers.
    replay = two(cmds([("k", fp("r1"), [b"a"])], STORE_MS + 2))
    assert replay.outcomes[0].duplicate
    assert replay.outcomes[0].placed == first.outcomes[0].placed


def test_two_requests_racing_with_one_key_in_one_command(two: Replicas) -> None:
    cmds = Cmds()
    res = two(cmds([("k", fp("r1"), [b"a"]), ("k", fp("r2"), [b"b"]), ("k", fp("r1"), [b"a"])]))
    first, racer, retry = res.outcomes
    assert first.status == OK and not first.duplicate
    assert racer.status == KEY_REUSED
    assert retry.status == OK and retry.duplicate and retry.placed == first.placed
    assert res.messages == 1


def test_client_keys_are_bounded_oldest_first(make_store: Callable[..., Store]) -> None:
    two = Replicas([make_store("a"), make_store("b")])
    limits = cmdcodec.IdemLimits(WINDOW_MS, 3, 50)
    cmds = Cmds()
    for i in range(5):
        two(cmds([(f"k{i}", fp(f"r{i}"), [b"x"])], STORE_MS + i, limits))
    assert list(two.stores[0].clients) == [key_digest(f"k{i}") for i in (2, 3, 4)]
    assert two.stores[0].clients_evicted == 2
    # k0 was dropped by the bound before its window ended: it is stored again.
    res = two(cmds([("k0", fp("r0"), [b"x"])], STORE_MS + 5, limits))
    assert not res.outcomes[0].duplicate and res.messages == 1
    assert two(cmds([("k4", fp("r4"), [b"x"])], STORE_MS + 6, limits)).outcomes[0].duplicate


def test_internal_batches_do_not_push_client_keys_out(two: Replicas) -> None:
    cmds = Cmds()
    two(cmds([("client", fp("c"), [b"c"])]))
    for i in range(LIMITS.internal_keys * 3):
        two(cmds([(f"node-{i}", None, [b"i"])], STORE_MS + 1))
    assert len(two.stores[0].idem) == LIMITS.internal_keys
    assert "node-0" not in two.stores[0].idem
    assert two(cmds([("client", fp("c"), [b"c"])], STORE_MS + 2)).outcomes[0].duplicate
    # An internal key is replayed whatever the request (internal writers reuse keys on purpose).
    last = f"node-{LIMITS.internal_keys * 3 - 1}"
    assert two(cmds([(last, None, [b"other"])], STORE_MS + 3)).outcomes[0].duplicate


def test_commands_without_limits_use_the_store_defaults(make_store: Callable[..., Store]) -> None:
    """Commands written before they carried limits (an old journal replayed)."""
    s = Replicas([make_store("a", client_window_ms=100, client_max_keys=2)])
    cmds = Cmds()
    s(cmds([("k", fp("r"), [b"a"])], STORE_MS, None))
    assert s(cmds([("k", fp("r"), [b"a"])], STORE_MS + 99, None)).outcomes[0].duplicate
    assert not s(cmds([("k", fp("r"), [b"a"])], STORE_MS + 100, None)).outcomes[0].duplicate


def test_snapshot_round_trip_keeps_the_client_keys(make_store: Callable[..., Store]) -> None:
    a, b = make_store("a"), make_store("b")
    cmds = Cmds()
    apply = Replicas([a])
    for i in range(20):
        apply(cmds([(f"k{i}", fp(f"r{i}"), [b"x"]), (f"node-{i}", None, [b"y"])], STORE_MS + i))
    apply(cmds([("k3", fp("other"), [b"z"])], STORE_MS + 30))  # rejected: not remembered
    snap = Store.parse_snapshot(a.snapshot({}))
    assert snap["v"] == 3
    assert len(snap["clients"]) == 4 * -(-20 * CLIENT_ENTRY.size // 3)  # base64 of 20 entries
    b.restore(snap, lambda target: target.write(a.commitlog.read_range(target.start, target.end)))
    assert list(b.clients.items()) == list(a.clients.items())
    assert list(b.idem.items()) == list(a.idem.items())
    # Both go on identically: replay, reuse, expiry.
    both = Replicas([a, b])
    both.index = a.applied_index
    assert both(cmds([("k5", fp("r5"), [b"x"])], STORE_MS + 40)).outcomes[0].duplicate
    assert both(cmds([("k6", fp("no"), [b"x"])], STORE_MS + 41)).outcomes[0].status == KEY_REUSED
    res = both(cmds([("k7", fp("r7"), [b"x"])], STORE_MS + 7 + WINDOW_MS))
    assert not res.outcomes[0].duplicate
    assert a.client_key("k6") is None  # expired with the same command on both


def _snapshot_file(payload: dict[str, object]) -> bytes:
    raw = orjson.dumps(payload)
    return SNAPSHOT_MAGIC + len(raw).to_bytes(8, "big") + hashlib.sha256(raw).digest() + raw


def test_a_version_1_snapshot_still_restores(make_store: Callable[..., Store]) -> None:
    """Before fingerprints every key was in ``idem``: such a client key still replays (for
    any request) until the count window drops it."""
    a, b = make_store("a"), make_store("b")
    cmds = Cmds()
    apply = Replicas([a])
    first = apply(cmds([("http:t:old", None, [b"x"])], STORE_MS, None))
    payload = Store.parse_snapshot(a.snapshot({}))
    payload["v"] = 1
    payload["chain"] = "00" * 16  # a chain over commands: means nothing now
    del payload["clients"], payload["chain_block"]
    data = _snapshot_file(payload)
    b.restore(
        Store.parse_snapshot(data),
        lambda target: target.write(a.commitlog.read_range(target.start, target.end)),
    )
    assert not b.clients and "http:t:old" in b.idem
    res = Replicas([b])
    res.index = b.applied_index
    again = res(cmds([("http:t:old", fp("r"), [b"x"])], STORE_MS + 1))
    assert again.outcomes[0].duplicate and again.outcomes[0].placed == first.outcomes[0].placed


def test_a_version_2_snapshot_is_refused(make_store: Callable[..., Store]) -> None:
    """Version 2 was written by no release and by no build a cluster is upgraded from."""
    payload = Store.parse_snapshot(make_store("a").snapshot({}))
    payload["v"] = 2
    with pytest.raises(StoreCorruption, match="snapshot version 2 is not supported"):
        Store.parse_snapshot(_snapshot_file(payload))


def test_commands_with_five_field_batches_still_decode() -> None:
    meta = {"t": 5, "b": [["k", 0, None, None, None]], "tp": [], "m": [], "x": None}
    raw = orjson.dumps(meta)
    data = bytes.fromhex("c0de0101") + len(raw).to_bytes(4, "big") + raw
    cmd = cmdcodec.decode(data)
    assert cmd.batches == (cmdcodec.Batch("k", 0),)
    assert cmd.idem is None
    both = cmdcodec.Command(
        cmdcodec.Kind.APPEND, 5, (cmdcodec.Batch("k", 0, fingerprint="f"),), idem=LIMITS
    )
    assert cmdcodec.decode(cmdcodec.encode(both)) == both
