"""The Spark side of the structured logs (:mod:`chronomq.cluster.logs.schema`): the schema to parse lines
with and the validity rules of :func:`chronomq.cluster.logs.schema.decode` as a Column. ``pyspark`` is
imported only here, and only when these are called."""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

from chronomq.cluster.logs.schema import _FIELDS, EventType, MessageKind, RecordType, Stage

if TYPE_CHECKING:
    from pyspark.sql import Column
    from pyspark.sql.types import StructType


# --- Spark side ---------------------------------------------------------------------------


@functools.cache
def spark_schema(record_type: RecordType) -> StructType:
    """The Spark schema to parse lines of ``record_type`` with ``from_json``.

    Every field is nullable: a damaged line parses to nulls and :func:`spark_valid` rejects it.
    ``detail`` stays the raw JSON text of the object.
    """
    from pyspark.sql import types as st

    long_, text = st.LongType(), st.StringType()
    types = {
        "v": long_,
        "t": text,
        "index": long_,
        "term": long_,
        "size_bytes": long_,
        "msg_count": long_,
        "node": text,
        "apply_ms": long_,
        "propose_ms": long_,
        "commit_ms": long_,
        "msg_id": text,
        "topic": text,
        "kind": text,
        "level": long_,
        "stage": text,
        "store_ms": long_,
        "due_ms": long_,
        "delivered_ms": long_,
        "consumed_ms": long_,
        "ts_ms": long_,
        "type": text,
        "detail": text,
    }
    names = ("v", "t", *_FIELDS[record_type])
    return st.StructType([st.StructField(n, types[n], nullable=True) for n in names])


def spark_valid(record_type: RecordType) -> Column:
    """A boolean Column over the fields of :func:`spark_schema`: the rules of :func:`decode`.

    It assumes ``v`` is known to be ``<= SCHEMA_VERSION`` (the report sorts newer lines out
    first) and says nothing about line length, which the report checks on the raw text.
    """
    from pyspark.sql import functions as sf

    def ms(name: str) -> Column:
        return sf.col(name).isNull() | (sf.col(name) >= 0)

    def need_ms(name: str) -> Column:
        return sf.col(name).isNotNull() & (sf.col(name) >= 0)

    def text(name: str) -> Column:
        return sf.col(name).isNotNull() & (sf.length(name) > 0)

    def one_of(name: str, values: type[enum.StrEnum]) -> Column:
        return sf.col(name).isin([m.value for m in values])

    base = sf.col("v").isNotNull() & (sf.col("v") >= 1) & (sf.col("t") == record_type.value)
    rule: Callable[[], Column]
    if record_type is RecordType.REPLICATION:

        def rule() -> Column:
            return (
                (sf.col("index") >= 1)
                & (sf.col("term") >= 0)
                & (sf.col("size_bytes") >= 0)
                & (sf.col("msg_count") >= 0)
                & text("node")
                & need_ms("apply_ms")
                & ms("propose_ms")
                & ms("commit_ms")
            )

    elif record_type is RecordType.LATENCY:

        def rule() -> Column:
            kind, stage = sf.col("kind"), sf.col("stage")
            delayed = kind != MessageKind.PLAIN.value
            level_ok = sf.when(kind == MessageKind.LEVEL.value, sf.col("level") >= 1).otherwise(
                sf.col("level").isNull()
            )
            stored, delivered = stage == Stage.STORED.value, stage == Stage.DELIVERED.value
            return (
                text("msg_id")
                & text("topic")
                & text("node")
                & one_of("kind", MessageKind)
                & one_of("stage", Stage)
                & level_ok
                & sf.when(stored, need_ms("store_ms")).otherwise(ms("store_ms"))
                & sf.when(delayed & ~(stage == Stage.CONSUMED.value), need_ms("due_ms")).otherwise(
                    ms("due_ms")
                )
                & sf.when(delivered, need_ms("delivered_ms")).otherwise(ms("delivered_ms"))
                & sf.when(stage == Stage.CONSUMED.value, need_ms("consumed_ms")).otherwise(
                    ms("consumed_ms")
                )
            )

    else:

        def rule() -> Column:
            detail = sf.col("detail")
            return (
                need_ms("ts_ms")
                & text("node")
                & one_of("type", EventType)
                & (detail.isNull() | detail.startswith("{"))
            )

    # A null anywhere in the rule means a field failed to parse: not valid.
    return sf.coalesce(base & rule(), sf.lit(False))
