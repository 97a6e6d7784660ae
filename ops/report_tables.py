"""The report's figures, computed with Spark from the merged messages and replication lines.

Every function takes DataFrames and returns a :class:`Table` of plain Python values, small enough
for the driver: per group, per node or per time bucket, never per message. Percentiles are exact
(Spark's ``percentile``: linear interpolation between the two closest ranks).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from chronomq.cluster.logs.schema import EventType, MessageKind

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame

PERCENTILES = (0.5, 0.9, 0.99, 0.999)
PCT_NAMES = ("p50_ms", "p90_ms", "p99_ms", "p999_ms")
MAX_BUCKETS = 100_000
"""Rows of a time series table at most; longer runs use buckets wider than one second."""
MAX_FAILOVERS = 64
MAX_EVENTS = 10_000

LATENESS_EDGES_MS = (0, 10, 20, 50, 100, 200, 500, 1_000, 2_000, 5_000)


@dataclass(frozen=True, slots=True)
class Table:
    """A small result table: ``columns`` are (name, type) with type long/double/string/boolean."""

    name: str
    columns: tuple[tuple[str, str], ...]
    rows: list[tuple[Any, ...]]

    def records(self) -> list[dict[str, Any]]:
        names = [c for c, _ in self.columns]
        return [dict(zip(names, row, strict=True)) for row in self.rows]


def _num(value: Any) -> Any:
    """Spark doubles that are whole numbers stay floats; NaN becomes None (JSON has no NaN)."""
    if isinstance(value, float) and math.isnan(value):
        return None
    return value


def _stats_aggs(value: Column) -> list[Column]:
    from pyspark.sql import functions as sf

    return [
        sf.count(value).alias("count"),
        sf.percentile(value, list(PERCENTILES)).alias("_pcts"),
        sf.max(value).alias("max_ms"),
        sf.min(value).alias("min_ms"),
        sf.avg(value).alias("mean_ms"),
    ]


_STATS_COLUMNS = (
    ("count", "long"),
    *[(n, "double") for n in PCT_NAMES],
    ("max_ms", "long"),
    ("min_ms", "long"),
    ("mean_ms", "double"),
)


def _stats_values(row: Any) -> tuple[Any, ...]:
    pcts = row["_pcts"] or [None] * len(PERCENTILES)
    mean = row["mean_ms"]
    return (
        row["count"],
        *[_num(p) for p in pcts],
        row["max_ms"],
        row["min_ms"],
        None if mean is None else round(mean, 3),
    )


def _level_label(kind: str | None, level: int | None, gid: int) -> str:
    if gid == 3:
        return "all"
    if kind == MessageKind.LEVEL.value:
        return f"level {level}" if gid == 0 else "levels (all)"
    return str(kind)


def _group_order(kind: str | None, level: int | None, gid: int) -> tuple[int, int]:
    rank = {MessageKind.LEVEL.value: 0, MessageKind.TIMER.value: 2, MessageKind.PLAIN.value: 3}
    if gid == 3:
        return (9, 0)
    if kind == MessageKind.LEVEL.value and gid == 1:
        return (1, 0)
    return (rank.get(str(kind), 8), level or 0)


def _by_kind_and_level(df: DataFrame, value: Column, extra: Sequence[Column]) -> list[Any]:
    """Rows of ``rollup(kind, level)``: each level, each kind, and everything together."""
    from pyspark.sql import functions as sf

    rows = (
        df.rollup("kind", "level")
        .agg(sf.grouping_id().alias("_gid"), *_stats_aggs(value), *extra)
        .collect()
    )
    keep = [
        r
        for r in rows
        if r["_gid"] in (1, 3) or (r["_gid"] == 0 and r["kind"] == MessageKind.LEVEL.value)
    ]
    return sorted(keep, key=lambda r: _group_order(r["kind"], r["level"], r["_gid"]))


def lateness(messages: DataFrame) -> Table:
    """Delivery lateness (delivered - due) per delay level, for all levels, timers, and all."""
    from pyspark.sql import functions as sf

    delayed = messages.where(sf.col("kind") != MessageKind.PLAIN.value)
    late = sf.col("delivered_ms") - sf.col("due_ms")
    delay = sf.col("due_ms") - sf.col("store_ms")
    extra = [
        sf.count(sf.lit(1)).alias("messages"),
        sf.count(sf.when(late < 0, 1)).alias("early_count"),
        sf.min(delay).alias("delay_min_ms"),
        sf.max(delay).alias("delay_max_ms"),
    ]
    rows = []
    for r in _by_kind_and_level(delayed, late, extra):
        gid = r["_gid"]
        label = _level_label(r["kind"], r["level"], gid)
        undelivered = r["messages"] - r["count"]
        level = r["level"] if gid == 0 else None
        delay_ms = r["delay_min_ms"] if r["delay_min_ms"] == r["delay_max_ms"] else None
        kind = r["kind"] if gid != 3 else None
        rows.append(
            (label, kind, level, delay_ms, r["messages"], undelivered, r["early_count"])
            + _stats_values(r)
        )
    columns = (
        ("group", "string"),
        ("kind", "string"),
        ("level", "long"),
        ("delay_ms", "long"),
        ("messages", "long"),
        ("undelivered", "long"),
        ("early_count", "long"),
        *_STATS_COLUMNS,
    )
    return Table("lateness", columns, rows)


def end_to_end(messages: DataFrame) -> Table:
    """End-to-end latency: consumed - due (due = stored for plain messages)."""
    from pyspark.sql import functions as sf

    consumed = messages.where(sf.col("consumed_ms").isNotNull())
    e2e = sf.col("consumed_ms") - sf.coalesce(sf.col("due_ms"), sf.col("store_ms"))
    rows = []
    for r in _by_kind_and_level(consumed, e2e, []):
        gid = r["_gid"]
        label = _level_label(r["kind"], r["level"], gid)
        level = r["level"] if gid == 0 else None
        kind = r["kind"] if gid != 3 else None
        rows.append((label, kind, level) + _stats_values(r))
    columns = (("group", "string"), ("kind", "string"), ("level", "long"), *_STATS_COLUMNS)
    return Table("end_to_end", columns, rows)


def lateness_histogram(messages: DataFrame) -> Table:
    """How many deliveries fell in each lateness bucket, for levels and for timers."""
    from pyspark.sql import functions as sf

    late = sf.col("delivered_ms") - sf.col("due_ms")
    bucket = sf.when(late < 0, -1)
    for i, edge in enumerate(LATENESS_EDGES_MS[1:]):
        bucket = bucket.when(late < edge, i)
    bucket = bucket.otherwise(len(LATENESS_EDGES_MS) - 1)
    rows = (
        messages.where(sf.col("delivered_ms").isNotNull() & sf.col("due_ms").isNotNull())
        .groupBy("kind", bucket.alias("bucket"))
        .count()
        .collect()
    )
    out = []
    for r in sorted(rows, key=lambda r: (r["kind"], r["bucket"])):
        b = r["bucket"]
        lo = None if b < 0 else LATENESS_EDGES_MS[b]
        hi = 0 if b < 0 else (LATENESS_EDGES_MS[b + 1] if b + 1 < len(LATENESS_EDGES_MS) else None)
        out.append((r["kind"], lo, hi, r["count"]))
    columns = (("kind", "string"), ("from_ms", "long"), ("to_ms", "long"), ("count", "long"))
    return Table("lateness_histogram", columns, out)


@dataclass(frozen=True, slots=True)
class Totals:
    messages: int
    by_kind: dict[str, int]
    delivered: int
    consumed: int
    undelivered: int
    duplicate_deliveries: int
    without_stored_line: int
    first_ms: int | None
    last_ms: int | None

    def as_dict(self) -> dict[str, Any]:
        return {
            "messages": self.messages,
            "by_kind": self.by_kind,
            "delivered": self.delivered,
            "consumed": self.consumed,
            "undelivered": self.undelivered,
            "duplicate_deliveries": self.duplicate_deliveries,
            "without_stored_line": self.without_stored_line,
            "first_ms": self.first_ms,
            "last_ms": self.last_ms,
        }


def totals(messages: DataFrame) -> Totals:
    from pyspark.sql import functions as sf

    ts = ["store_ms", "due_ms", "delivered_ms", "consumed_ms"]
    delayed = sf.col("kind") != MessageKind.PLAIN.value
    r = messages.agg(
        sf.count(sf.lit(1)).alias("messages"),
        *[
            sf.count(sf.when(sf.col("kind") == k.value, 1)).alias(f"k_{k.value}")
            for k in MessageKind
        ],
        sf.count("delivered_ms").alias("delivered"),
        sf.count("consumed_ms").alias("consumed"),
        sf.count(sf.when(delayed & sf.col("delivered_ms").isNull(), 1)).alias("undelivered"),
        sf.sum(sf.greatest(sf.col("deliveries") - 1, sf.lit(0))).alias("dups"),
        sf.count(sf.when(sf.col("stores") == 0, 1)).alias("no_stored"),
        sf.min(sf.least(*[sf.col(c) for c in ts])).alias("first_ms"),
        sf.max(sf.greatest(*[sf.col(c) for c in ts])).alias("last_ms"),
    ).collect()[0]
    return Totals(
        messages=r["messages"],
        by_kind={k.value: r[f"k_{k.value}"] for k in MessageKind},
        delivered=r["delivered"],
        consumed=r["consumed"],
        undelivered=r["undelivered"],
        duplicate_deliveries=int(r["dups"] or 0),
        without_stored_line=r["no_stored"],
        first_ms=r["first_ms"],
        last_ms=r["last_ms"],
    )


def bucket_seconds(first_ms: int | None, last_ms: int | None) -> int:
    """Width of time-series buckets: one second unless that would exceed MAX_BUCKETS rows."""
    if first_ms is None or last_ms is None:
        return 1
    return max(1, math.ceil((last_ms - first_ms) / 1000 / MAX_BUCKETS))


def throughput(messages: DataFrame, bucket_s: int) -> Table:
    """Messages produced, delivered and consumed per bucket (per second unless the run is long)."""
    from pyspark.sql import functions as sf

    width_ms = bucket_s * 1000

    def bucket(col: str) -> Column:
        return (sf.floor(sf.col(col) / width_ms) * bucket_s).cast("long")

    what = ("produced", "delivered", "consumed")
    cols = ("store_ms", "delivered_ms", "consumed_ms")
    exploded = messages.select(
        sf.explode(
            sf.array(
                *[sf.struct(sf.lit(i).alias("w"), bucket(c).alias("s")) for i, c in enumerate(cols)]
            )
        ).alias("e")
    ).where(sf.col("e.s").isNotNull())
    rows = (
        exploded.groupBy(sf.col("e.s").alias("s"))
        .agg(*[sf.count(sf.when(sf.col("e.w") == i, 1)).alias(w) for i, w in enumerate(what)])
        .orderBy("s")
        .collect()
    )
    out = [(r["s"], bucket_s, r["produced"], r["delivered"], r["consumed"]) for r in rows]
    columns = (
        ("second", "long"),
        ("bucket_s", "long"),
        ("produced", "long"),
        ("delivered", "long"),
        ("consumed", "long"),
    )
    return Table("throughput", columns, out)


# --- replication ------------------------------------------------------------------------------


def commands(replication: DataFrame) -> DataFrame:
    """One row per committed index from the leader's line: term, leader, propose and commit."""
    from pyspark.sql import functions as sf

    return (
        replication.where(sf.col("propose_ms").isNotNull())
        .groupBy("index")
        .agg(
            sf.min("term").alias("term"),
            sf.min("node").alias("leader"),
            sf.min("propose_ms").alias("propose_ms"),
            sf.min("commit_ms").alias("commit_ms"),
            sf.max("size_bytes").alias("size_bytes"),
            sf.max("msg_count").alias("msg_count"),
        )
    )


def commit_latency(cmds: DataFrame) -> Table:
    """commit - propose on the leader, per leader node and overall."""
    from pyspark.sql import functions as sf

    value = sf.col("commit_ms") - sf.col("propose_ms")
    rows = (
        cmds.rollup("leader")
        .agg(
            sf.grouping_id().alias("_gid"),
            *_stats_aggs(value),
            sf.sum("msg_count").alias("messages"),
            sf.sum("size_bytes").alias("size_bytes"),
        )
        .collect()
    )
    out = [
        ("all" if r["_gid"] else r["leader"], r["messages"], r["size_bytes"]) + _stats_values(r)
        for r in sorted(rows, key=lambda r: (r["_gid"], r["leader"] or ""))
    ]
    columns = (("leader", "string"), ("messages", "long"), ("size_bytes", "long"), *_STATS_COLUMNS)
    return Table("commit_latency", columns, out)


def follower_applies(replication: DataFrame, cmds: DataFrame) -> DataFrame:
    """Each node's first apply of each index joined to the leader's commit; lag_ms may be null."""
    from pyspark.sql import functions as sf

    applies = replication.groupBy("index", "node").agg(sf.min("apply_ms").alias("apply_ms"))
    joined = applies.join(cmds.select("index", "leader", "commit_ms"), "index", "left")
    return joined.where(sf.col("leader").isNull() | (sf.col("node") != sf.col("leader"))).select(
        "index",
        "node",
        "commit_ms",
        (sf.col("apply_ms") - sf.col("commit_ms")).alias("lag_ms"),
    )


def apply_lag(followers: DataFrame) -> tuple[Table, int]:
    """Per follower node: apply - leader's commit. Also the follower lines without a leader line."""
    from pyspark.sql import functions as sf

    rows = (
        followers.groupBy("node")
        .agg(*_stats_aggs(sf.col("lag_ms")), sf.count(sf.lit(1)).alias("lines"))
        .orderBy("node")
        .collect()
    )
    unmatched = sum(r["lines"] - r["count"] for r in rows)
    out = [(r["node"],) + _stats_values(r) for r in rows]
    return Table("apply_lag", (("node", "string"), *_STATS_COLUMNS), out), unmatched


def apply_lag_over_time(followers: DataFrame, bucket_s: int) -> Table:
    """Per follower and time bucket of the commit: p50, p99 and max of the apply lag."""
    from pyspark.sql import functions as sf

    width_ms = bucket_s * 1000
    rows = (
        followers.where(sf.col("lag_ms").isNotNull())
        .groupBy(
            (sf.floor(sf.col("commit_ms") / width_ms) * bucket_s).cast("long").alias("s"), "node"
        )
        .agg(
            sf.count(sf.lit(1)).alias("count"),
            sf.percentile("lag_ms", [0.5, 0.99]).alias("p"),
            sf.max("lag_ms").alias("max_ms"),
        )
        .orderBy("s", "node")
        .collect()
    )
    out = [
        (r["s"], bucket_s, r["node"], r["count"], _num(r["p"][0]), _num(r["p"][1]), r["max_ms"])
        for r in rows
    ]
    columns = (
        ("second", "long"),
        ("bucket_s", "long"),
        ("node", "string"),
        ("count", "long"),
        ("p50_ms", "double"),
        ("p99_ms", "double"),
        ("max_ms", "long"),
    )
    return Table("apply_lag_over_time", columns, out)


def terms(cmds: DataFrame) -> Table:
    """Per Raft term: its leader, how many commands it committed, first and last commit."""
    from pyspark.sql import functions as sf

    rows = (
        cmds.groupBy("term")
        .agg(
            sf.min("leader").alias("leader"),
            sf.count(sf.lit(1)).alias("commands"),
            sf.min("commit_ms").alias("first_commit_ms"),
            sf.max("commit_ms").alias("last_commit_ms"),
        )
        .orderBy("term")
        .collect()
    )
    out = [
        (r["term"], r["leader"], r["commands"], r["first_commit_ms"], r["last_commit_ms"])
        for r in rows
    ]
    columns = (
        ("term", "long"),
        ("leader", "string"),
        ("commands", "long"),
        ("first_commit_ms", "long"),
        ("last_commit_ms", "long"),
    )
    return Table("terms", columns, out)


def failovers(term_table: Table, messages: DataFrame | None) -> Table:
    """Each change of term: the commit gap and the delivery gap around it.

    ``window_ms`` runs from the old leader's last commit to the new leader's first. The delivery
    gap runs from the last delivery at or before the old leader's last commit to the first one
    after it. Messages that fell due inside the window are counted with their worst lateness.
    """
    from pyspark.sql import functions as sf

    terms_ = [r for r in term_table.records() if r["first_commit_ms"] is not None]
    windows = [
        (old, new) for old, new in zip(terms_, terms_[1:], strict=False) if old["last_commit_ms"]
    ][:MAX_FAILOVERS]
    gaps: list[tuple[Any, ...]] = [(None, None, 0, None)] * len(windows)
    if windows and messages is not None:
        d, due = sf.col("delivered_ms"), sf.col("due_ms")
        aggs = []
        for i, (old, new) in enumerate(windows):
            a, b = old["last_commit_ms"], new["first_commit_ms"]
            inside = (due > a) & (due <= b)
            aggs += [
                sf.max(sf.when(d <= a, d)).alias(f"before{i}"),
                sf.min(sf.when(d > a, d)).alias(f"after{i}"),
                sf.count(sf.when(inside, 1)).alias(f"due{i}"),
                sf.max(sf.when(inside, d - due)).alias(f"late{i}"),
            ]
        r = messages.agg(*aggs).collect()[0]
        gaps = [
            (r[f"before{i}"], r[f"after{i}"], r[f"due{i}"], r[f"late{i}"])
            for i in range(len(windows))
        ]
    out = []
    for (old, new), (before, after, due_n, late) in zip(windows, gaps, strict=True):
        gap = after - before if before is not None and after is not None else None
        out.append(
            (
                old["term"],
                new["term"],
                old["leader"],
                new["leader"],
                old["last_commit_ms"],
                new["first_commit_ms"],
                new["first_commit_ms"] - old["last_commit_ms"],
                before,
                after,
                gap,
                due_n,
                late,
            )
        )
    columns = (
        ("old_term", "long"),
        ("new_term", "long"),
        ("old_leader", "string"),
        ("new_leader", "string"),
        ("old_last_commit_ms", "long"),
        ("new_first_commit_ms", "long"),
        ("window_ms", "long"),
        ("last_delivery_before_ms", "long"),
        ("first_delivery_after_ms", "long"),
        ("delivery_gap_ms", "long"),
        ("due_in_window", "long"),
        ("max_lateness_due_in_window_ms", "long"),
    )
    return Table("failovers", columns, out)


# --- events -----------------------------------------------------------------------------------


def events(event_rows: DataFrame) -> Table:
    """The events in time order (at most MAX_EVENTS of them)."""
    from pyspark.sql import functions as sf

    rows = (
        event_rows.orderBy("ts_ms", "node", "type", "detail")
        .limit(MAX_EVENTS)
        .select("ts_ms", "node", "type", sf.coalesce("detail", sf.lit("{}")).alias("detail"))
        .collect()
    )
    out = [(r["ts_ms"], r["node"], r["type"], r["detail"]) for r in rows]
    columns = (("ts_ms", "long"), ("node", "string"), ("type", "string"), ("detail", "string"))
    return Table("events", columns, out)


def leader_changes(event_rows: DataFrame) -> Table:
    """Leader changes from the events: the earliest report of each (term, leader)."""
    from pyspark.sql import functions as sf

    rows = (
        event_rows.where(sf.col("type") == EventType.LEADER_CHANGE.value)
        .select(
            "ts_ms",
            "node",
            sf.get_json_object("detail", "$.leader").alias("leader"),
            sf.get_json_object("detail", "$.term").cast("long").alias("term"),
        )
        .groupBy("term", "leader")
        .agg(sf.min("ts_ms").alias("ts_ms"), sf.min_by("node", "ts_ms").alias("reported_by"))
        .orderBy("ts_ms", "term", "leader")
        .limit(MAX_EVENTS)
        .collect()
    )
    out = [(r["ts_ms"], r["leader"], r["term"], r["reported_by"]) for r in rows]
    columns = (("ts_ms", "long"), ("leader", "string"), ("term", "long"), ("reported_by", "string"))
    return Table("leader_changes", columns, out)


def writer_drops(event_rows: DataFrame) -> int:
    """Records the nodes' log writers dropped because their buffer was full."""
    from pyspark.sql import functions as sf

    dropped = sf.get_json_object("detail", "$.dropped").cast("long")
    r = event_rows.where(sf.col("type") == EventType.LOG_DROP.value).agg(sf.sum(dropped)).collect()
    return int(r[0][0] or 0)
