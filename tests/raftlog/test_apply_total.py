"""Apply is total at the store: every command that breaks a rule is rejected, recorded and
answered the same way on every replica; only a fault of the node itself is raised."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from chronomq.raftlog import command as cmdcodec
from chronomq.raftlog import record
from chronomq.raftlog.consumequeue import ConsumeQueueStore
from chronomq.raftlog.errors import ApplyRejected, InvalidInput, NodeFault, StoreCorruption
from chronomq.raftlog.extension import ApplyContext
from chronomq.raftlog.store import OK, REJECTED, REJECTED_COUNT_KEY, REJECTED_LAST_KEY, Store

from ._util import STORE_MS, B, command, rec

SEG = 8192


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[list[Store]]:
    stores = [Store(tmp_path / n, segment_bytes=SEG) for n in ("a", "b")]
    yield stores
    for s in stores:
        s.close()


def apply_both(stores: list[Store], data: bytes, index: int) -> list[Any]:
    results = [s.apply(data, index) for s in stores]
    assert stores[0].digest() == stores[1].digest()
    assert stores[0].kv == stores[1].kv
    assert stores[0].topics == stores[1].topics
    return results


def raw(
    topics: tuple[Any, ...],
    messages: tuple[tuple[Any, Any, Any], ...],
    blob: bytes,
    batches: tuple[cmdcodec.Batch, ...] | None = None,
) -> bytes:
    if batches is None:
        batches = (cmdcodec.Batch("k", len(messages), None, None, {"t": 2}),)
    return cmdcodec.encode(
        cmdcodec.Command(cmdcodec.Kind.APPEND, STORE_MS, batches, topics, messages, blob)
    )


GOOD = rec("t", 0, b"hello", 1)


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (b"", "shorter than its header"),
        (b"\xc0\xde\x01\x07\x00\x00\x00\x00", "does not decode"),
        (b"\x00" * 64, "bad magic"),
        (raw(("t",), ((1, 0, len(GOOD)),), GOOD), "topic index"),
        (raw(("t",), ((0, -1, len(GOOD)),), GOOD), "queue -1"),
        (raw(("t",), ((0, 0, len(GOOD) + 1),), GOOD), "blob has"),
        (raw(("t",), ((0, 0, 10),), GOOD[:10]), "bytes, not"),
        (raw(("../../etc",), ((0, 0, len(GOOD)),), GOOD), "not a legal topic"),
        (raw(("t",), ((0, 0, len(GOOD)),), GOOD, (cmdcodec.Batch("k", 2, None, None, None),)), "count"),
        (raw((), (), b"", (cmdcodec.Batch("k", 0, None, {"x": 1.5}, None),)), "updates"),
        (raw((), (), b"", (cmdcodec.Batch("k", 0, None, {"x": [1]}, None),)), "updates"),
        (raw((), (), b"", (cmdcodec.Batch("k", 0, None, {"x": 1 << 63}, None),)), "updates"),
        (raw((), (), b"", (cmdcodec.Batch("k", 0, None, None, {"t": 5000}),)), "queues"),
        (raw((), (), b"", (cmdcodec.Batch("k", 0, None, None, {"a/b": 1}),)), "legal topic"),
        (raw((), (), b"", (cmdcodec.Batch("k", 0, [1], None, None),)), "expect"),
    ],
)  # fmt: skip
def test_a_command_that_breaks_a_rule_is_rejected_whole(
    pair: list[Store], data: bytes, why: str
) -> None:
    for res in apply_both(pair, data, 1):
        assert all(o.status == REJECTED for o in res.outcomes)
        assert res.bytes_written == 0
    s = pair[0]
    assert s.applied_index == 1
    assert s.kv[REJECTED_COUNT_KEY] == 1
    assert why in str(s.kv[REJECTED_LAST_KEY])
    assert s.topics == {}
    # The next command applies as usual.
    (res, _) = apply_both(pair, command([B("k2", [("t", 0, b"x", 2)], creates={"t": 1})]), 2)
    assert res.outcomes[0].status == OK


def _batch_with(data: bytes, topic: str = "t", qid: int = 0) -> bytes:
    """Command of two batches: a good one, then one holding ``data`` for ``topic``/``qid``."""
    return raw(
        ("t", topic) if topic != "t" else ("t",),
        ((0, 0, len(GOOD)), (1 if topic != "t" else 0, qid, len(data))),
        GOOD + data,
        (
            cmdcodec.Batch("good", 1, None, None, {"t": 2, topic: 2}),
            cmdcodec.Batch("bad", 1, None, None, None),
        ),
    )


def _flip(data: bytes, at: int) -> bytes:
    out = bytearray(data)
    out[at] ^= 0xFF
    return bytes(out)


@pytest.mark.parametrize(
    ("data", "topic", "qid", "field"),
    [
        (rec("u", 0, b"x", 3), "t", 0, "messages[0].topic"),
        (rec("t", 1, b"x", 3), "t", 0, "messages[0].queue"),
        (_flip(rec("t", 0, b"body", 3), -1), "t", 0, "messages[0].body"),
        (_flip(rec("t", 0, b"x", 3), 4), "t", 0, "messages[0]"),
        (_flip(rec("t", 0, b"x", 3), 93), "t", 0, "messages[0]"),
        (bytes(record.encode(topic="t", queue_id=0, msg_id=bytes(16), body=b"x", properties=b"n\x01\xff\x02")), "t", 0, "messages[0].properties"),
    ],
)  # fmt: skip
def test_a_batch_with_a_broken_record_is_rejected_alone(
    pair: list[Store], data: bytes, topic: str, qid: int, field: str
) -> None:
    (res, _) = apply_both(pair, _batch_with(data, topic, qid), 1)
    good, bad = res.outcomes
    assert good.status == OK and len(good.placed) == 1
    assert bad.status == REJECTED
    if field:
        assert bad.field == field
    assert pair[0].max_offset("t", 0) == 1
    assert pair[0].kv[REJECTED_COUNT_KEY] == 1


def test_record_rules_reject_a_batch_naming_the_field(pair: list[Store]) -> None:
    def rule(facts: Any, queue_count: Any) -> tuple[str, str] | None:
        if facts.properties.get("P") != "ok":
            return "P must be ok", "properties.P"
        return None

    for s in pair:
        s.record_rules["t"] = rule
    bad = command([B("k", [("t", 0, b"x", 1)], creates={"t": 1})])
    (res, _) = apply_both(pair, bad, 1)
    assert res.outcomes[0].status == REJECTED
    assert res.outcomes[0].field == "messages[0].properties.P"
    good = rec("t", 0, b"x", 2, properties={"P": "ok"})
    batches = (cmdcodec.Batch("k2", 1, None, None, {"t": 1}),)
    (res, _) = apply_both(pair, raw(("t",), ((0, 0, len(good)),), good, batches), 2)
    assert res.outcomes[0].status == OK


class _Ext:
    name = "e"

    def __init__(self, fail: BaseException | None) -> None:
        self.fail = fail

    def attach(self, store: Store) -> None:
        pass

    def apply(self, ctx: ApplyContext, payload: Any) -> Any:
        if payload == "topic":
            ctx.ensure_topic("/tmp/outside", 1)
        if self.fail is not None:
            raise self.fail
        return "done"

    def before_snapshot(self, index: int) -> None:
        pass

    def close(self) -> None:
        pass


def ext(name: str, payload: Any) -> bytes:
    return cmdcodec.encode(
        cmdcodec.Command(cmdcodec.Kind.EXTENSION, STORE_MS, extra={"e": name, "p": payload})
    )


def test_extension_commands_are_rejected_not_fatal(pair: list[Store]) -> None:
    for s in pair:
        s.expected_extensions = frozenset({"e"})
        s.register_extension(_Ext(ValueError("bad payload")))  # type: ignore[arg-type]
    apply_both(pair, ext("nosuch", {}), 1)
    apply_both(pair, ext("e", "x"), 2)
    apply_both(pair, ext("e", "topic"), 3)
    apply_both(
        pair,
        cmdcodec.encode(cmdcodec.Command(cmdcodec.Kind.EXTENSION, STORE_MS, extra={"p": 1})),
        4,
    )
    assert pair[0].kv[REJECTED_COUNT_KEY] == 4
    assert not Path("/tmp/outside").exists()
    assert pair[0].applied_index == 4


def test_a_fault_of_the_node_still_stops_apply(pair: list[Store]) -> None:
    s = pair[0]
    s.register_extension(_Ext(NodeFault("this node's timer files are damaged")))  # type: ignore[arg-type]
    with pytest.raises(NodeFault):
        s.apply(ext("e", 1), 1)
    s.extensions["e"] = _Ext(OSError(28, "No space left on device"))  # type: ignore[assignment]
    with pytest.raises(OSError):
        s.apply(ext("e", 1), 2)


def test_consume_queue_paths_never_leave_their_directory(tmp_path: Path) -> None:
    cqs = ConsumeQueueStore(tmp_path / "cq")
    try:
        for topic in ("/tmp/x", "../x", "a/b", "a\x00b", "", "..", "."):
            with pytest.raises(InvalidInput):
                cqs.append(topic, 0, 0, b"\x00" * 20)
        with pytest.raises(InvalidInput):
            cqs.append("t", -1, 0, b"\x00" * 20)
    finally:
        cqs.close()
    assert [p.name for p in tmp_path.iterdir()] == ["cq"]
    assert list((tmp_path / "cq").iterdir()) == []


def _stored(pair: list[Store]) -> tuple[int, int]:
    apply_both(pair, command([B("k", [("t", 0, b"payload", 1)], creates={"t": 1})]), 1)
    (unit,) = pair[0].read_units("t", 0, 0, 1)
    return unit.commitlog_offset, unit.size


def _corrupt(store: Store, at: int) -> None:
    (seg,) = [p for p in (store.data_dir / "commitlog").iterdir()]
    data = bytearray(seg.read_bytes())
    data[at + record.HEADER_SIZE] ^= 0xFF
    seg.write_bytes(bytes(data))


def test_read_record_takes_a_peers_copy_of_a_record_it_cannot_read(pair: list[Store]) -> None:
    at, size = _stored(pair)
    a, b = pair
    _corrupt(a, at)
    with pytest.raises(StoreCorruption, match="no peer could supply it"):
        a.read_record(at, size)
    asked: list[tuple[int, int]] = []

    def peer(start: int, end: int) -> bytes:
        asked.append((start, end))
        return b.commitlog.read_range(start, end)

    a.peer_bytes = peer
    assert record.decode(a.read_record(at, size)).body == b"payload"
    assert asked == [(at, at + size)]
    # A peer answering other bytes is never believed.
    a.peer_bytes = lambda start, end: _flip(b.commitlog.read_range(start, end), 20)
    with pytest.raises(StoreCorruption):
        a.read_record(at, size)


def test_a_rejection_reaches_the_proposer_as_a_caller_error_naming_the_field() -> None:
    from chronomq.raftlog.store import BatchOutcome

    out = BatchOutcome(
        "k", REJECTED, detail="REAL_QID '5000'", field="messages[0].properties.REAL_QID"
    )
    exc = ApplyRejected(out.detail, out.field)
    assert isinstance(exc, InvalidInput) and exc.field == "messages[0].properties.REAL_QID"
