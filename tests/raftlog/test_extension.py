"""Apply extensions: derived records placed like produced ones, state in kv through snapshots,
attach at registration and after restore/reset, and a missing extension stops apply."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from chronomq.raftlog import command as cmdcodec
from chronomq.raftlog import record
from chronomq.raftlog.errors import StoreCorruption
from chronomq.raftlog.extension import ApplyContext, DerivedRecord
from chronomq.raftlog.store import Store

from ._util import STORE_MS, B, command, msg_id

SEG = 4096


class Echo:
    """Copies the payload's bodies to topic ``out`` and counts commands in kv ``echo/n``."""

    name = "echo"

    def __init__(self) -> None:
        self.attached: list[int] = []
        self.snapshots: list[int] = []
        self.closed = False

    def attach(self, store: Store) -> None:
        self.attached.append(store.applied_index)

    def apply(self, ctx: ApplyContext, payload: Any) -> Any:
        ctx.ensure_topic("out", 2)
        n = int(ctx.kv_get("echo/n") or 0) + 1
        ctx.kv_set("echo/n", n)
        records = [
            DerivedRecord(
                "out",
                i % 2,
                record.encode(
                    topic="out",
                    queue_id=i % 2,
                    msg_id=msg_id(1000 * n + i),
                    body=body.encode(),
                    store_ms=ctx.propose_ms,
                ),
            )
            for i, body in enumerate(payload["bodies"])
        ]
        placed = ctx.append(records)
        return [(p.queue_id, p.queue_offset) for p in placed]

    def before_snapshot(self, index: int) -> None:
        self.snapshots.append(index)

    def close(self) -> None:
        self.closed = True


def ext_command(bodies: list[str], name: str = "echo") -> bytes:
    return cmdcodec.encode(
        cmdcodec.Command(
            cmdcodec.Kind.EXTENSION, STORE_MS, extra={"e": name, "p": {"bodies": bodies}}
        )
    )


@pytest.fixture
def stores(tmp_path: Path) -> Iterator[list[Store]]:
    made = [Store(tmp_path / n, segment_bytes=SEG) for n in ("a", "b")]
    yield made
    for s in made:
        s.close()


def test_derived_records_are_placed_indexed_and_digested_identically(stores: list[Store]) -> None:
    for s in stores:
        s.register_extension(Echo())
        s.apply(command([B("k1", [("t", 0, b"plain", 1)], creates={"t": 1})]), 1)
        result = s.apply(ext_command(["a", "b", "c"]), 2)
        assert result.ext == [(0, 0), (1, 0), (0, 1)]
        assert result.messages == 3 and result.bytes_written > 0
    a, b = stores
    assert a.digest() == b.digest()
    assert [m.body for m in a.read_messages("out", 0, 0, 10)] == [b"a", b"c"]
    assert a.kv["echo/n"] == 1
    # A plain command after the derived records still lands where both stores agree.
    for s in stores:
        s.apply(command([B("k2", [("t", 0, b"after", 2)])]), 3)
    assert a.digest() == b.digest()
    assert a.digest()["length"] == a.commitlog.length


def test_state_in_kv_survives_a_snapshot_and_attach_runs_again(stores: list[Store]) -> None:
    a, b = stores
    ext_a, ext_b = Echo(), Echo()
    a.register_extension(ext_a)
    a.apply(ext_command(["x"]), 1)
    a.apply(ext_command(["y"]), 2)
    snap = Store.parse_snapshot(a.snapshot({"s": None}))
    assert ext_a.snapshots == [2]
    b.register_extension(ext_b)
    assert ext_b.attached == [0]
    b.restore(snap, lambda into: into.write(a.commitlog.read_range(into.start, into.end)))
    assert ext_b.attached == [0, 2]
    assert b.kv["echo/n"] == 2 and b.digest() == a.digest()
    b.reset()
    assert ext_b.attached == [0, 2, 0]
    b.close()
    assert ext_b.closed


def test_a_command_waits_for_its_extension_to_register(stores: list[Store]) -> None:
    a = stores[0]
    results: list[Any] = []
    applier = threading.Thread(target=lambda: results.append(a.apply(ext_command(["w"]), 1)))
    applier.start()
    a.register_extension(Echo())
    applier.join(timeout=10)
    assert not applier.is_alive()
    assert results[0].ext == [(0, 0)]


def test_a_command_for_an_extension_that_never_registers_stops_apply(stores: list[Store]) -> None:
    a = stores[0]
    a.extension_wait_s = 0.01
    with pytest.raises(StoreCorruption, match="nosuch"):
        a.apply(ext_command(["w"], name="nosuch"), 1)


def test_registering_a_name_twice_is_refused(stores: list[Store]) -> None:
    stores[0].register_extension(Echo())
    with pytest.raises(ValueError, match="registered already"):
        stores[0].register_extension(Echo())


def test_extension_commands_round_trip_through_the_codec() -> None:
    cmd = cmdcodec.decode(ext_command(["q"]))
    assert cmd.kind is cmdcodec.Kind.EXTENSION
    assert cmd.extra == {"e": "echo", "p": {"bodies": ["q"]}}
