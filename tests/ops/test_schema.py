"""The log schema: golden lines both ways, corrupt lines, newer versions, construction rules."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from chronomq.cluster.logs import schema
from chronomq.cluster.logs.schema import (
    SCHEMA_VERSION,
    CorruptLine,
    EventRecord,
    EventType,
    InvalidRecord,
    LatencyRecord,
    MessageKind,
    NewerSchemaVersion,
    RecordType,
    ReplicationRecord,
    Stage,
    decode,
    encode,
)
from chronomq.ops.schema import spark_schema

GOLDEN = [
    (
        ReplicationRecord(index=7, term=2, size_bytes=812, msg_count=3, node="n1", apply_ms=1005),
        b'{"v":1,"t":"replication","index":7,"term":2,"size_bytes":812,"msg_count":3,'
        b'"node":"n1","apply_ms":1005}\n',
    ),
    (
        ReplicationRecord(
            index=7,
            term=2,
            size_bytes=812,
            msg_count=3,
            node="n0",
            apply_ms=1003,
            propose_ms=1000,
            commit_ms=1002,
        ),
        b'{"v":1,"t":"replication","index":7,"term":2,"size_bytes":812,"msg_count":3,'
        b'"node":"n0","apply_ms":1003,"propose_ms":1000,"commit_ms":1002}\n',
    ),
    (
        LatencyRecord(
            msg_id="AB01",
            topic="orders",
            kind=MessageKind.LEVEL,
            stage=Stage.DELIVERED,
            node="n0",
            level=3,
            store_ms=1000,
            due_ms=11000,
            delivered_ms=11042,
        ),
        b'{"v":1,"t":"latency","msg_id":"AB01","topic":"orders","kind":"level","level":3,'
        b'"stage":"delivered","node":"n0","store_ms":1000,"due_ms":11000,"delivered_ms":11042}\n',
    ),
    (
        LatencyRecord(
            msg_id="AB02",
            topic="orders",
            kind=MessageKind.PLAIN,
            stage=Stage.CONSUMED,
            node="n2",
            consumed_ms=1007,
        ),
        b'{"v":1,"t":"latency","msg_id":"AB02","topic":"orders","kind":"plain",'
        b'"stage":"consumed","node":"n2","consumed_ms":1007}\n',
    ),
    (
        EventRecord(
            ts_ms=5, node="n1", type=EventType.LEADER_CHANGE, detail={"leader": "n1", "term": 2}
        ),
        b'{"v":1,"t":"events","ts_ms":5,"node":"n1","type":"leader_change",'
        b'"detail":{"leader":"n1","term":2}}\n',
    ),
]


@pytest.mark.parametrize(("record", "line"), GOLDEN)
def test_golden_lines_both_ways(record: schema.Record, line: bytes) -> None:
    assert encode(record) == line
    assert decode(line) == record
    assert decode(line.rstrip(b"\n").decode()) == record
    assert decode(line, expect=record.TYPE) == record


def test_unknown_fields_are_ignored_and_null_optionals_are_absent() -> None:
    line = (
        b'{"v":1,"t":"latency","msg_id":"a","topic":"t","kind":"timer","stage":"stored",'
        b'"node":"n0","store_ms":1,"due_ms":9,"future_field":[1,2],"consumed_ms":null}'
    )
    record = decode(line)
    assert isinstance(record, LatencyRecord)
    assert record.consumed_ms is None and record.due_ms == 9


def test_event_detail_defaults_to_empty() -> None:
    record = decode(b'{"v":1,"t":"events","ts_ms":1,"node":"n0","type":"service_start"}')
    assert isinstance(record, EventRecord) and record.detail == {}
    assert decode(encode(record)) == record


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        (b'{"v":1,"t":"latency","msg_id":"a","topic":"t","ki', "not valid JSON"),
        (b"", "not valid JSON"),
        (b"\x00\xff garbage", "not valid JSON"),
        (b"[1,2,3]", "not a JSON object"),
        (b'{"t":"events","ts_ms":1,"node":"n0","type":"service_start"}', "schema version"),
        (b'{"v":true,"t":"events","ts_ms":1,"node":"n0","type":"service_start"}', "version"),
        (b'{"v":"1","t":"events","ts_ms":1,"node":"n0","type":"service_start"}', "version"),
        (b'{"v":0,"t":"events","ts_ms":1,"node":"n0","type":"service_start"}', "version"),
        (b'{"v":1,"t":"metrics","ts_ms":1}', "unknown record type"),
        (b'{"v":1,"t":"events","node":"n0","type":"service_start"}', "ts_ms"),
        (b'{"v":1,"t":"events","ts_ms":-5,"node":"n0","type":"service_start"}', "ts_ms"),
        (b'{"v":1,"t":"events","ts_ms":1.5,"node":"n0","type":"service_start"}', "ts_ms"),
        (b'{"v":1,"t":"events","ts_ms":1,"node":"","type":"service_start"}', "node"),
        (b'{"v":1,"t":"events","ts_ms":1,"node":"n0","type":"reboot"}', "event type"),
        (b'{"v":1,"t":"events","ts_ms":1,"node":"n0","type":"drill_fault","detail":[1]}', "detail"),
        (
            b'{"v":1,"t":"replication","index":0,"term":1,"size_bytes":1,"msg_count":1,'
            b'"node":"n0","apply_ms":1}',
            "index",
        ),
        (
            b'{"v":1,"t":"replication","index":3,"term":1,"size_bytes":true,"msg_count":1,'
            b'"node":"n0","apply_ms":1}',
            "size_bytes",
        ),
        (
            b'{"v":1,"t":"replication","index":3,"term":1,"size_bytes":1,"msg_count":1,'
            b'"node":"n0"}',
            "apply_ms",
        ),
        (
            b'{"v":1,"t":"latency","msg_id":"a","topic":"t","kind":"level","stage":"stored",'
            b'"node":"n0","store_ms":1,"due_ms":2}',
            "level",
        ),
        (
            b'{"v":1,"t":"latency","msg_id":"a","topic":"t","kind":"timer","level":2,'
            b'"stage":"stored","node":"n0","store_ms":1,"due_ms":2}',
            "level",
        ),
        (
            b'{"v":1,"t":"latency","msg_id":"a","topic":"t","kind":"timer","stage":"stored",'
            b'"node":"n0","store_ms":1}',
            "due_ms",
        ),
        (
            b'{"v":1,"t":"latency","msg_id":"a","topic":"t","kind":"plain","stage":"delivered",'
            b'"node":"n0","store_ms":1}',
            "delivered_ms",
        ),
        (
            b'{"v":1,"t":"latency","msg_id":"a","topic":"t","kind":"plain","stage":"eaten",'
            b'"node":"n0","store_ms":1}',
            "stage",
        ),
        (
            b'{"v":1,"t":"latency","msg_id":7,"topic":"t","kind":"plain","stage":"stored",'
            b'"node":"n0","store_ms":1}',
            "msg_id",
        ),
    ],
)
def test_corrupt_lines_are_rejected_with_a_reason(line: bytes, reason: str) -> None:
    with pytest.raises(CorruptLine) as caught:
        decode(line)
    assert reason in str(caught.value)


def test_overlong_line_is_corrupt() -> None:
    detail = "x" * schema.MAX_LINE_BYTES
    line = encode(EventRecord(ts_ms=1, node="n0", type=EventType.DRILL_FAULT, detail={"d": detail}))
    with pytest.raises(CorruptLine, match="longer than"):
        decode(line)


def test_line_of_another_type_than_expected_is_corrupt() -> None:
    line = encode(EventRecord(ts_ms=1, node="n0", type=EventType.SERVICE_STOP))
    with pytest.raises(CorruptLine, match="expected"):
        decode(line, expect=RecordType.LATENCY)


def test_newer_schema_version_is_its_own_error() -> None:
    line = b'{"v":%d,"t":"latency","whatever":"changed"}' % (SCHEMA_VERSION + 1)
    with pytest.raises(NewerSchemaVersion) as caught:
        decode(line)
    assert caught.value.version == SCHEMA_VERSION + 1
    assert caught.value.supported == SCHEMA_VERSION
    assert "upgrade chronomq" in str(caught.value)
    assert not isinstance(caught.value, CorruptLine)


def test_invalid_records_are_refused_at_construction() -> None:
    with pytest.raises(InvalidRecord) as caught:
        LatencyRecord("a", "t", MessageKind.TIMER, Stage.STORED, "n0", store_ms=1)
    assert caught.value.field == "due_ms"
    with pytest.raises(InvalidRecord):
        ReplicationRecord(1, 1, 1, 1, "n0", apply_ms=-1)
    with pytest.raises(InvalidRecord):
        EventRecord(1, "n0", "no-such-type")  # type: ignore[arg-type]
    with pytest.raises(InvalidRecord):
        LatencyRecord("a", "t", "plain", "stored", "n0", store_ms=True)  # type: ignore[arg-type]


def test_string_kinds_become_enums() -> None:
    record = LatencyRecord("a", "t", "plain", "stored", "n0", store_ms=1)  # type: ignore[arg-type]
    assert record.kind is MessageKind.PLAIN and record.stage is Stage.STORED


def test_records_are_frozen() -> None:
    record = ReplicationRecord(1, 1, 1, 1, "n0", apply_ms=1)
    with pytest.raises(AttributeError):
        record.index = 2  # type: ignore[misc]


_ms = st.integers(min_value=0, max_value=2**53)
_text = st.text(min_size=1, max_size=40)


@st.composite
def latency_records(draw: st.DrawFn) -> LatencyRecord:
    kind = draw(st.sampled_from(MessageKind))
    stage = draw(st.sampled_from(Stage))
    delayed = kind is not MessageKind.PLAIN
    optional = st.none() | _ms
    return LatencyRecord(
        msg_id=draw(_text),
        topic=draw(_text),
        kind=kind,
        stage=stage,
        node=draw(_text),
        level=draw(st.integers(1, 18)) if kind is MessageKind.LEVEL else None,
        store_ms=draw(_ms if stage is Stage.STORED else optional),
        due_ms=draw(_ms if delayed and stage is not Stage.CONSUMED else optional),
        delivered_ms=draw(_ms if stage is Stage.DELIVERED else optional),
        consumed_ms=draw(_ms if stage is Stage.CONSUMED else optional),
    )


@given(latency_records())
def test_any_latency_record_round_trips(record: LatencyRecord) -> None:
    line = encode(record)
    assert line.endswith(b"\n") and b"\n" not in line[:-1]
    assert decode(line) == record


@given(latency_records())
def test_fast_latency_line_is_the_checked_encoding(record: LatencyRecord) -> None:
    """The nodes' unchecked hot path writes exactly what encode() writes for a valid record."""
    fast = schema.latency_line(
        record.msg_id,
        record.topic,
        record.kind.value,
        record.stage.value,
        record.node,
        level=record.level,
        store_ms=record.store_ms,
        due_ms=record.due_ms,
        delivered_ms=record.delivered_ms,
        consumed_ms=record.consumed_ms,
    )
    assert fast == encode(record)


@given(latency_records())
def test_latency_lines_splice_ids_into_the_checked_encoding(record: LatencyRecord) -> None:
    lines = schema.LatencyLines(
        record.topic,
        record.kind,
        record.stage,
        record.node,
        level=record.level,
        store_ms=record.store_ms,
        due_ms=record.due_ms,
        delivered_ms=record.delivered_ms,
        consumed_ms=record.consumed_ms,
    )
    assert lines.line(record.msg_id) == encode(record)  # any id: spliced or encoded
    for msg_id in ("01A20035F936D0E4DC6E55B8258416E6", "M1"):
        assert lines.line(msg_id) == encode(dataclasses.replace(record, msg_id=msg_id))


def test_latency_lines_check_the_record_once() -> None:
    with pytest.raises(InvalidRecord, match="due_ms"):
        schema.LatencyLines("orders", MessageKind.LEVEL, Stage.STORED, "n0", level=1, store_ms=5)
    lines = schema.LatencyLines("orders", "plain", "stored", "n0", store_ms=5)
    with pytest.raises(InvalidRecord, match="msg_id"):
        lines.line("")


@given(
    st.builds(
        ReplicationRecord,
        index=st.integers(1, 2**62),
        term=st.integers(0, 2**31),
        size_bytes=st.integers(0, 2**40),
        msg_count=st.integers(0, 10**6),
        node=_text,
        apply_ms=_ms,
        propose_ms=st.none() | _ms,
        commit_ms=st.none() | _ms,
    )
)
def test_any_replication_record_round_trips(record: ReplicationRecord) -> None:
    assert decode(encode(record)) == record


def test_importing_the_schema_does_not_import_pyspark() -> None:
    code = "import sys, cluster.logs.schema, cluster.logs.writer, ops.schema; sys.exit('pyspark' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_spark_schema_has_every_field() -> None:
    pytest.importorskip("pyspark")
    for record_type in RecordType:
        names = spark_schema(record_type).fieldNames()
        assert names[:2] == ["v", "t"]
        assert set(names[2:]) == set(schema.field_names(record_type))
