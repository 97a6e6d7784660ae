"""Finding the nodes' log files and reading them into Spark, line by line, with validation.

Lines are read as text and parsed with ``from_json`` against :func:`chronomq.ops.schema.spark_schema`;
every line gets a status: ``ok``, ``corrupt`` (not JSON, truncated, a field of the wrong type or
missing, a broken rule of :func:`chronomq.ops.schema.spark_valid`), ``newer`` (a schema version above
ours) or ``blank``. Corrupt lines are counted and skipped; a few are kept as examples.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from chronomq.cluster.logs.schema import MAX_LINE_BYTES, SCHEMA_VERSION, MessageKind, RecordType
from chronomq.ops.schema import spark_schema, spark_valid

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame, SparkSession

OK, CORRUPT, NEWER, BLANK = "ok", "corrupt", "newer", "blank"
KINDS = tuple(k.value for k in MessageKind)
EXAMPLE_CHARS = 160
MAX_NODE_DIRS = 10_000


class ReportInputError(Exception):
    """The logs given to the report cannot be used: the operator's to fix, not a crash."""


@dataclass(frozen=True, slots=True)
class LogFiles:
    """Every log file found, by record type, with the total size of each type."""

    dirs: tuple[str, ...]
    files: Mapping[RecordType, tuple[str, ...]]
    size_bytes: Mapping[RecordType, int]

    @property
    def total_files(self) -> int:
        return sum(len(f) for f in self.files.values())


@dataclass(frozen=True, slots=True)
class LineCounts:
    """What reading one record type found."""

    files: int
    size_bytes: int
    lines: int = 0
    valid: int = 0
    corrupt: int = 0
    newer: int = 0
    blank: int = 0
    newest_version: int = 0

    def as_dict(self) -> dict[str, int]:
        return {
            "files": self.files,
            "size_bytes": self.size_bytes,
            "lines": self.lines,
            "valid": self.valid,
            "corrupt": self.corrupt,
            "newer_version": self.newer,
            "blank": self.blank,
        }


_FILE_NAME = re.compile(r"^(replication|latency|events)-(\d+)\.jsonl$")


def find_log_files(dirs: Sequence[str | os.PathLike[str]]) -> LogFiles:
    """Log files under each directory: ``DIR/<node>/<type>-<seq>.jsonl`` or ``DIR/<type>-…``.

    Raises :class:`ReportInputError` for a missing directory, or when no log file (or only empty
    ones) is found anywhere.
    """
    if not dirs:
        raise ReportInputError("no log directory given")
    found: dict[RecordType, list[str]] = {t: [] for t in RecordType}
    sizes = dict.fromkeys(RecordType, 0)
    resolved: list[str] = []
    for d in dirs:
        root = Path(d).expanduser().absolute()
        if not root.exists():
            raise ReportInputError(f"log directory not found: {root}")
        if not root.is_dir():
            raise ReportInputError(f"not a directory: {root}")
        resolved.append(str(root))
        candidates = [root]
        children = sorted(p for p in root.iterdir() if p.is_dir())
        if len(children) > MAX_NODE_DIRS:
            raise ReportInputError(f"{root} has more than {MAX_NODE_DIRS} subdirectories")
        candidates += children
        for directory in candidates:
            for path in sorted(directory.iterdir()):
                match = _FILE_NAME.match(path.name)
                if match and path.is_file():
                    record_type = RecordType(match.group(1))
                    found[record_type].append(str(path))
                    sizes[record_type] += path.stat().st_size
    if not any(found.values()):
        raise ReportInputError(
            "no chronomq log files under "
            + ", ".join(resolved)
            + " (expected files such as <dir>/<node>/latency-000001.jsonl)"
        )
    if sum(sizes.values()) == 0:
        raise ReportInputError("the log files under " + ", ".join(resolved) + " are all empty")
    return LogFiles(
        dirs=tuple(resolved),
        files={t: tuple(dict.fromkeys(f)) for t, f in found.items()},
        size_bytes=sizes,
    )


def _status(record_type: RecordType) -> Column:
    from pyspark.sql import functions as sf

    value = sf.col("value")
    return (
        sf.when(sf.trim(value) == "", sf.lit(BLANK))
        .when(sf.octet_length(value) > MAX_LINE_BYTES, sf.lit(CORRUPT))
        .when(sf.col("v") > SCHEMA_VERSION, sf.lit(NEWER))
        .when(spark_valid(record_type), sf.lit(OK))
        .otherwise(sf.lit(CORRUPT))
    )


def parse_lines(spark: SparkSession, files: Sequence[str], record_type: RecordType) -> DataFrame:
    """One row per line: the schema's fields, ``_status`` and, for corrupt lines, ``_example``."""
    from pyspark.sql import functions as sf

    schema = spark_schema(record_type)
    text = spark.read.format("text").load(list(files))
    parsed = text.select(
        "value",
        sf.col("_metadata.file_path").alias("_file"),
        sf.from_json("value", schema, {"mode": "PERMISSIVE"}).alias("_r"),
    ).select("value", "_file", "_r.*")
    status = _status(record_type)
    example = sf.concat(
        sf.regexp_replace("_file", "^file:", ""),
        sf.lit(": "),
        sf.substring("value", 1, EXAMPLE_CHARS),
    )
    return parsed.select(
        *[sf.col(f.name) for f in schema.fields],
        status.alias("_status"),
        sf.when(status == CORRUPT, example).alias("_example"),
    )


def counts_from(rows: Sequence[tuple[str, int, int]], files: int, size_bytes: int) -> LineCounts:
    """``rows`` holds (status, lines, newest version seen) per status."""
    by_status = {status: lines for status, lines, _ in rows}
    newest = max((v or 0 for status, _, v in rows if status == NEWER), default=0)
    return LineCounts(
        files=files,
        size_bytes=size_bytes,
        lines=sum(by_status.values()),
        valid=by_status.get(OK, 0),
        corrupt=by_status.get(CORRUPT, 0),
        newer=by_status.get(NEWER, 0),
        blank=by_status.get(BLANK, 0),
        newest_version=newest,
    )


def corrupt_examples(parsed: DataFrame, limit: int = 3) -> list[str]:
    """A few corrupt lines (file: start of line), found without scanning everything if early."""
    from pyspark.sql import functions as sf

    rows = parsed.where(sf.col("_status") == CORRUPT).select("_example").limit(limit).collect()
    return sorted(r["_example"] for r in rows)


@dataclass(frozen=True, slots=True)
class ReadResult:
    """Valid rows (None when there are no files), what reading found, and what to unpersist."""

    rows: DataFrame | None
    counts: LineCounts
    examples: list[str]
    cached: DataFrame | None = None


def read_small(spark: SparkSession, logs: LogFiles, record_type: RecordType) -> ReadResult:
    """Valid rows (cached), counts and corrupt examples of a record type that fits in memory."""
    from pyspark import StorageLevel
    from pyspark.sql import functions as sf

    files = logs.files[record_type]
    if not files:
        return ReadResult(None, LineCounts(files=0, size_bytes=0), [])
    parsed = parse_lines(spark, files, record_type).persist(StorageLevel.MEMORY_AND_DISK)
    stats = (
        parsed.groupBy("_status")
        .agg(sf.count(sf.lit(1)).alias("n"), sf.max("v").alias("v"))
        .collect()
    )
    counts = counts_from(
        [(r["_status"], r["n"], r["v"]) for r in stats], len(files), logs.size_bytes[record_type]
    )
    examples = corrupt_examples(parsed) if counts.corrupt else []
    names = [f.name for f in spark_schema(record_type).fields]
    valid = parsed.where(sf.col("_status") == OK).select(*names)
    return ReadResult(valid, counts, examples, parsed)


MESSAGE_COLUMNS = (
    "kind",
    "level",
    "store_ms",
    "due_ms",
    "delivered_ms",
    "consumed_ms",
    "stores",
    "deliveries",
    "consumes",
)


def read_messages(spark: SparkSession, logs: LogFiles) -> ReadResult:
    """Latency lines merged into one row per message (cached), line counts, corrupt examples.

    One pass over the text: lines are grouped by (status, msg_id) with the id blanked for lines
    that are not ``ok``, so the same shuffle both merges the stages of each message and counts
    the bad lines. The merged rows keep the earliest of each timestamp and count the stages seen.
    """
    from pyspark import StorageLevel
    from pyspark.sql import functions as sf

    files = logs.files[RecordType.LATENCY]
    if not files:
        return ReadResult(None, LineCounts(files=0, size_bytes=0), [])
    parsed = parse_lines(spark, files, RecordType.LATENCY)
    ok = sf.col("_status") == OK
    stage = sf.col("stage")
    # Strings in aggregation buffers would force a sort-based aggregation of every line: the
    # kind is carried as its index in KINDS and corrupt examples are fetched separately.
    kind_code = sf.when(sf.col("kind") == KINDS[0], 0)
    for code, name in enumerate(KINDS[1:], start=1):
        kind_code = kind_code.when(sf.col("kind") == name, code)

    def stages(name: str) -> Column:
        return sf.count(sf.when(stage == name, 1)).cast("int")

    merged = (
        parsed.groupBy("_status", sf.when(ok, sf.col("msg_id")).alias("_key"))
        .agg(
            sf.count(sf.lit(1)).alias("_lines"),
            sf.max("v").alias("_v"),
            sf.max(kind_code).alias("_kind"),
            sf.max("level").cast("int").alias("level"),
            sf.min("store_ms").alias("store_ms"),
            sf.min("due_ms").alias("due_ms"),
            sf.min("delivered_ms").alias("delivered_ms"),
            sf.min("consumed_ms").alias("consumed_ms"),
            stages("stored").alias("stores"),
            stages("delivered").alias("deliveries"),
            stages("consumed").alias("consumes"),
        )
        .drop("_key")
        .persist(StorageLevel.MEMORY_AND_DISK)
    )
    stats = merged.groupBy("_status").agg(sf.sum("_lines").alias("n"), sf.max("_v").alias("v"))
    counts = counts_from(
        [(r["_status"], int(r["n"]), r["v"]) for r in stats.collect()],
        len(files),
        logs.size_bytes[RecordType.LATENCY],
    )
    examples = corrupt_examples(parsed) if counts.corrupt else []
    kind = sf.element_at(sf.array(*[sf.lit(k) for k in KINDS]), sf.col("_kind") + 1)
    messages = (
        merged.where(sf.col("_status") == OK).withColumn("kind", kind).select(*MESSAGE_COLUMNS)
    )
    return ReadResult(messages, counts, examples, merged)
