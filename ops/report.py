"""``chronomq report``: replication and latency report of a cluster's logs, computed with PySpark.

Reads every node's logs (see :mod:`ops.schema`), and writes into ``--out``:

- ``report.html``: one self-contained page (inline SVG charts), readable offline;
- ``summary.json``: the figures, a function of the input logs only (two runs over the same
  logs, locally or on a cluster, give the same file);
- ``run.json``: how the run went (engine, timings, corrupt line examples);
- ``csv/<table>.csv`` and ``parquet/<table>/``: every table of the report.

Engines: ``--master local[*]`` (default), ``spark://host:port`` (standalone cluster, client
mode: this process is the driver) or ``sc://host:port`` (Spark Connect; needs the
``pyspark[connect]`` extras). On a cluster the executors read the logs and write the Parquet
tables, so both paths must be on storage every executor sees at the same path.
"""

from __future__ import annotations

import contextlib
import csv
import os
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO
from urllib.parse import urlsplit

import orjson

from ops import report_tables as rt
from ops.report_ingest import (
    LineCounts,
    LogFiles,
    ReportInputError,
    find_log_files,
    read_messages,
    read_small,
)
from ops.schema import SCHEMA_VERSION, RecordType
from ops.sparkprogress import SparkProgress

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

DEFAULT_MASTER = "local[*]"
DEFAULT_DRIVER_MEMORY = "2g"
APP_NAME = "chronomq-report"

EXIT_OK, EXIT_SPARK_FAILED, EXIT_BAD_INPUT, EXIT_INTERRUPTED = 0, 1, 2, 130

_LOG4J2 = """\
status = error
rootLogger.level = {level}
rootLogger.appenderRef.stderr.ref = stderr
appender.stderr.type = Console
appender.stderr.name = stderr
appender.stderr.target = SYSTEM_ERR
appender.stderr.layout.type = PatternLayout
appender.stderr.layout.pattern = spark %p %c{{1}}: %m%n%ex{{6}}
# PySpark drivers count as a shell: Spark then sets the root level to the shell's level.
logger.repl.name = org.apache.spark.repl.Main
logger.repl.level = {level}
logger.native.name = org.apache.hadoop.util.NativeCodeLoader
logger.native.level = error
logger.utils.name = org.apache.spark.util.Utils
logger.utils.level = error
logger.plan.name = org.apache.spark.sql.catalyst.util.SparkStringUtils
logger.plan.level = error
logger.blockmanager.name = org.apache.spark.storage.BlockManager
logger.blockmanager.level = error
logger.cache.name = org.apache.spark.sql.execution.CacheManager
logger.cache.level = error
logger.jersey.name = org.glassfish.jersey
logger.jersey.level = off
logger.jetty.name = org.sparkproject.jetty
logger.jetty.level = error
"""


class ReportFailed(Exception):
    """The report cannot be produced; ``exit_code`` says whose problem it is."""

    def __init__(self, message: str, exit_code: int = EXIT_BAD_INPUT) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@dataclass(frozen=True, slots=True)
class ReportOptions:
    logs: tuple[str, ...]
    out: str
    master: str = DEFAULT_MASTER
    conf: tuple[tuple[str, str], ...] = ()
    driver_memory: str = DEFAULT_DRIVER_MEMORY
    skip_newer: bool = False
    progress: bool = True
    spark_log_level: str = "WARN"
    title: str = "chronomq report"


@dataclass(slots=True)
class ReportData:
    """Everything computed: the summary, the tables, and what the run saw on the way."""

    summary: dict[str, Any]
    tables: list[rt.Table]
    examples: dict[str, list[str]] = field(default_factory=dict)
    phases_s: dict[str, float] = field(default_factory=dict)


# --- engine ---------------------------------------------------------------------------------


def check_master(master: str, timeout_s: float = 5.0) -> None:
    """Fail fast, with a plain message, when a cluster master cannot be reached at all."""
    if master.startswith("local"):
        return
    url = urlsplit(master)
    if url.scheme not in ("spark", "sc"):
        raise ReportFailed(
            f"unsupported --master {master!r}: use local[N], spark://host:port or sc://host:port"
        )
    host = url.hostname or "localhost"
    port = url.port or (7077 if url.scheme == "spark" else 15002)
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            pass
    except OSError as exc:
        kind = "Spark master" if url.scheme == "spark" else "Spark Connect server"
        raise ReportFailed(
            f"cannot reach the {kind} at {host}:{port}: {exc}", EXIT_SPARK_FAILED
        ) from None


@contextlib.contextmanager
def spark_session(
    master: str = DEFAULT_MASTER,
    conf: Sequence[tuple[str, str]] = (),
    driver_memory: str = DEFAULT_DRIVER_MEMORY,
    log_level: str = "WARN",
) -> Iterator[SparkSession]:
    """A SparkSession for the report, quiet unless something is wrong; stopped at the end."""
    check_master(master)
    if master.startswith("sc://"):
        try:
            from pyspark.sql.connect.session import SparkSession as ConnectSession  # noqa: F401
        except ImportError as exc:
            raise ReportFailed(
                f"Spark Connect needs extra packages ({exc.name} is missing): "
                "pip install 'pyspark[connect]'",
                EXIT_SPARK_FAILED,
            ) from None
    from pyspark.sql import SparkSession

    builder: Any = SparkSession.builder
    settings = dict(conf)
    log_dir = tempfile.mkdtemp(prefix="chronomq-report-")
    try:
        if master.startswith("sc://"):
            builder = builder.remote(master)
        else:
            log_file = Path(log_dir) / "log4j2.properties"
            log_file.write_text(_LOG4J2.format(level=log_level.lower()))
            options = settings.get("spark.driver.extraJavaOptions", "")
            settings["spark.driver.extraJavaOptions"] = (
                f"{options} -Dlog4j2.configurationFile=file:{log_file}".strip()
            )
            settings.setdefault("spark.driver.memory", driver_memory)
            settings.setdefault("spark.ui.showConsoleProgress", "false")
            settings.setdefault(
                "spark.sql.shuffle.partitions", "16" if master.startswith("local") else "64"
            )
            builder = builder.master(master)
        settings.setdefault("spark.sql.session.timeZone", "UTC")
        builder = builder.appName(APP_NAME)
        for key, value in settings.items():
            builder = builder.config(key, value)
        try:
            spark = builder.getOrCreate()
        except Exception as exc:
            if _is_spark_error(exc):
                raise ReportFailed(
                    f"could not start Spark on {master}: {spark_error_summary(exc)}",
                    EXIT_SPARK_FAILED,
                ) from None
            raise
        try:
            yield spark
        finally:
            spark.stop()
    finally:
        shutil.rmtree(log_dir, ignore_errors=True)


def _is_spark_error(exc: BaseException) -> bool:
    module = type(exc).__module__ or ""
    return module.startswith(("pyspark", "py4j"))


def spark_error_summary(exc: BaseException, max_lines: int = 3) -> str:
    """A few readable lines for a Spark/Py4J exception, without the JVM stack trace."""
    java = getattr(exc, "java_exception", None)
    if java is not None:
        try:
            text = str(java.toString())
        except Exception:
            text = str(exc)
    else:
        text = str(exc)
    lines = [
        line.strip()
        for line in text.splitlines()
        if line.strip() and not line.lstrip().startswith(("at ", "...", "JVM stacktrace"))
    ]
    return " / ".join(lines[:max_lines]) or type(exc).__name__


# --- the job --------------------------------------------------------------------------------


def _newer_message(record_type: RecordType, counts: LineCounts) -> str:
    return (
        f"{counts.newer:,} {record_type} log lines have schema version {counts.newest_version}; "
        f"this chronomq reads versions up to {SCHEMA_VERSION}. Upgrade chronomq to read them, "
        "or pass --skip-newer to report without those lines."
    )


def _check(
    record_type: RecordType,
    counts: LineCounts,
    skip_newer: bool,
    progress: SparkProgress,
) -> None:
    if counts.newer and not skip_newer:
        raise ReportFailed(_newer_message(record_type, counts))
    if counts.newer:
        progress.note(f"warning: skipped {_newer_message(record_type, counts).split(';')[0]}")
    if counts.corrupt:
        progress.note(
            f"warning: {counts.corrupt:,} corrupt or truncated {record_type} lines skipped "
            f"(of {counts.lines:,})"
        )


def compute(
    spark: SparkSession,
    logs: LogFiles,
    *,
    skip_newer: bool = False,
    progress: SparkProgress | None = None,
) -> ReportData:
    """All the Spark work of the report, on an existing session."""
    progress = progress or SparkProgress(None, enabled=False)
    phases: dict[str, float] = {}
    counts: dict[RecordType, LineCounts] = {}
    examples: dict[str, list[str]] = {}
    tables: list[rt.Table] = []
    cached: list[DataFrame] = []

    def phase(name: str, detail: str = "") -> None:
        phases[name] = time.monotonic()
        progress.phase(name, detail)

    def size(record_type: RecordType) -> str:
        n, b = len(logs.files[record_type]), logs.size_bytes[record_type]
        return f"{n} files, {b / 1e6:,.1f} MB"

    try:
        phase("events", size(RecordType.EVENTS))
        read = read_small(spark, logs, RecordType.EVENTS)
        counts[RecordType.EVENTS], examples["events"] = read.counts, read.examples
        if read.cached is not None:
            cached.append(read.cached)
        _check(RecordType.EVENTS, read.counts, skip_newer, progress)
        event_table, event_total, changes, drops = rt.Table("events", (), []), 0, None, 0
        if read.rows is not None:
            event_table, event_total = rt.events(read.rows)
            changes = rt.leader_changes(read.rows)
            drops = rt.writer_drops(read.rows)

        phase("replication", size(RecordType.REPLICATION))
        read = read_small(spark, logs, RecordType.REPLICATION)
        counts[RecordType.REPLICATION], examples["replication"] = read.counts, read.examples
        if read.cached is not None:
            cached.append(read.cached)
        _check(RecordType.REPLICATION, read.counts, skip_newer, progress)
        repl_df = read.rows

        phase("latency", size(RecordType.LATENCY) + ", merging the stages of each message")
        read = read_messages(spark, logs)
        counts[RecordType.LATENCY], examples["latency"] = read.counts, read.examples
        if read.cached is not None:
            cached.append(read.cached)
        _check(RecordType.LATENCY, read.counts, skip_newer, progress)
        messages = read.rows
        if not any(c.valid for c in counts.values()):
            lines = sum(c.lines for c in counts.values())
            raise ReportFailed(
                f"no valid log records in {', '.join(logs.dirs)}: {lines:,} lines read, "
                + ", ".join(f"{c.corrupt:,} corrupt {t}" for t, c in counts.items() if c.corrupt)
                if lines
                else f"the logs in {', '.join(logs.dirs)} hold no lines"
            )

        totals = rt.totals(messages) if messages is not None else None
        bucket_s = rt.bucket_seconds(
            totals.first_ms if totals else None, totals.last_ms if totals else None
        )
        replication: dict[str, Any] = {"commands": 0}
        term_table = rt.Table("terms", (), [])
        if repl_df is not None:
            phase("replication latency and apply lag")
            cmds = rt.commands(repl_df).cache()
            cached.append(cmds)
            commit = rt.commit_latency(cmds)
            followers = rt.follower_applies(repl_df, cmds).cache()
            cached.append(followers)
            lag, unmatched = rt.apply_lag(followers)
            lag_time = rt.apply_lag_over_time(followers, bucket_s)
            term_table = rt.terms(cmds)
            tables += [commit, lag, lag_time, term_table]
            replication = {
                "commands": sum(r["commands"] for r in term_table.records()),
                "commit_latency_ms": commit.records(),
                "apply_lag_ms": lag.records(),
                "follower_lines_without_leader_line": unmatched,
            }

        latency_summary: dict[str, Any] = {}
        if messages is not None and totals is not None:
            phase("delivery lateness and end-to-end latency")
            late = rt.lateness(messages)
            e2e = rt.end_to_end(messages)
            hist = rt.lateness_histogram(messages)
            phase("throughput")
            tput = rt.throughput(messages, bucket_s)
            tables += [late, hist, e2e, tput]
            latency_summary = {
                "messages": totals.as_dict(),
                "lateness_ms": late.records(),
                "end_to_end_ms": e2e.records(),
                "throughput": _throughput_summary(tput, totals),
            }
        phase("failover windows")
        fail = rt.failovers(term_table, messages)
        tables.append(fail)
        if changes is not None:
            tables.append(changes)
        tables.append(event_table)
        inputs = rt.Table(
            "inputs",
            (
                ("type", "string"),
                *[(k, "long") for k in LineCounts(0, 0).as_dict()],
            ),
            [(str(t), *counts[t].as_dict().values()) for t in RecordType],
        )
        tables.append(inputs)
        summary: dict[str, Any] = {
            "schema_version": SCHEMA_VERSION,
            "inputs": {str(t): counts[t].as_dict() for t in RecordType},
            "time_range_ms": {
                "first": totals.first_ms if totals else None,
                "last": totals.last_ms if totals else None,
            },
            **latency_summary,
            "replication": replication,
            "failovers": fail.records(),
            "leader_changes": changes.records() if changes is not None else [],
            "events": event_total,
            "writer_dropped_records": drops,
        }
    finally:
        for df in cached:
            with contextlib.suppress(Exception):
                df.unpersist()
    end = time.monotonic()
    starts = sorted(phases.items(), key=lambda kv: kv[1])
    durations = {
        name: round((starts[i + 1][1] if i + 1 < len(starts) else end) - t, 3)
        for i, (name, t) in enumerate(starts)
    }
    return ReportData(summary=summary, tables=tables, examples=examples, phases_s=durations)


def _throughput_summary(table: rt.Table, totals: rt.Totals) -> dict[str, Any]:
    rows = table.records()
    span_s = (
        max(1.0, (totals.last_ms - totals.first_ms) / 1000)
        if totals.first_ms is not None and totals.last_ms is not None
        else 1.0
    )
    out: dict[str, Any] = {"bucket_s": rows[0]["bucket_s"] if rows else 1}
    for what in ("produced", "delivered", "consumed"):
        total = sum(r[what] for r in rows)
        peak = max((r[what] / r["bucket_s"] for r in rows), default=0)
        out[what] = {"total": total, "peak_per_s": peak, "mean_per_s": round(total / span_s, 1)}
    return out


# --- outputs --------------------------------------------------------------------------------


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _csv_value(value: Any) -> Any:
    if isinstance(value, bool):
        return "true" if value else "false"
    return "" if value is None else value


def write_tables(spark: SparkSession | None, tables: Sequence[rt.Table], out: Path) -> None:
    """``csv/<name>.csv`` written here, ``parquet/<name>/`` written by Spark (when given)."""
    csv_dir = out / "csv"
    csv_dir.mkdir(parents=True, exist_ok=True)
    for table in tables:
        tmp = csv_dir / f".{table.name}.csv.tmp"
        with tmp.open("w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow([name for name, _ in table.columns])
            writer.writerows([_csv_value(v) for v in row] for row in table.rows)
        os.replace(tmp, csv_dir / f"{table.name}.csv")
    if spark is None:
        return
    from pyspark.sql import types as st

    types = {
        "long": st.LongType(),
        "double": st.DoubleType(),
        "string": st.StringType(),
        "boolean": st.BooleanType(),
    }
    for table in tables:
        schema = st.StructType([st.StructField(n, types[t], True) for n, t in table.columns])
        rows = [
            tuple(
                float(v) if t == "double" and v is not None else v
                for v, (_, t) in zip(row, table.columns, strict=True)
            )
            for row in table.rows
        ]
        df = spark.createDataFrame(rows, schema)
        df.coalesce(1).write.mode("overwrite").parquet(str(out / "parquet" / table.name))


def json_bytes(value: Any) -> bytes:
    return orjson.dumps(value, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS) + b"\n"


def run_report(
    spark: SparkSession,
    log_dirs: Sequence[str | os.PathLike[str]],
    out_dir: str | os.PathLike[str],
    *,
    skip_newer: bool = False,
    progress: SparkProgress | None = None,
    master: str | None = None,
    title: str = "chronomq report",
) -> dict[str, Any]:
    """Compute the report on ``spark`` and write every output; returns the summary."""
    from ops.report_html import render

    started = time.monotonic()
    logs = find_log_files(log_dirs)
    out = Path(out_dir).absolute()
    out.mkdir(parents=True, exist_ok=True)
    progress = progress or SparkProgress(None, enabled=False)
    data = compute(spark, logs, skip_newer=skip_newer, progress=progress)
    progress.phase("writing", str(out))
    write_tables(spark, data.tables, out)
    elapsed = time.monotonic() - started
    lines = sum(v["lines"] for v in data.summary["inputs"].values())
    run = {
        "master": master or spark.conf.get("spark.master", None),
        "spark_version": spark.version,
        "logs": list(logs.dirs),
        "out": str(out),
        "elapsed_s": round(elapsed, 3),
        "lines": lines,
        "lines_per_s": round(lines / max(elapsed, 1e-9)),
        "phases_s": data.phases_s,
        "corrupt_examples": data.examples,
        "generated_at_ms": time.time_ns() // 1_000_000,
    }
    _write_atomic(out / "run.json", json_bytes(run))
    _write_atomic(out / "report.html", render(data, run, title=title).encode())
    _write_atomic(out / "summary.json", json_bytes(data.summary))
    return data.summary


def report_main(options: ReportOptions, stream: TextIO | None = None) -> int:
    """The command: build the engine, run, print where the report is. Returns an exit code."""
    err = stream if stream is not None else sys.stderr

    def fail(message: str, code: int) -> int:
        err.write(f"chronomq report: error: {message}\n")
        return code

    try:
        find_log_files(options.logs)  # a bad path fails before Spark starts
        with spark_session(
            options.master, options.conf, options.driver_memory, options.spark_log_level
        ) as spark:
            progress = SparkProgress(spark, stream=err, enabled=options.progress)
            with progress:
                try:
                    summary = run_report(
                        spark,
                        options.logs,
                        options.out,
                        skip_newer=options.skip_newer,
                        progress=progress,
                        master=options.master,
                        title=options.title,
                    )
                except KeyboardInterrupt:
                    with contextlib.suppress(Exception):
                        spark.sparkContext.cancelAllJobs()
                    raise
    except ReportInputError as exc:
        return fail(str(exc), EXIT_BAD_INPUT)
    except ReportFailed as exc:
        return fail(str(exc), exc.exit_code)
    except KeyboardInterrupt:
        return fail("interrupted", EXIT_INTERRUPTED)
    except Exception as exc:
        if _is_spark_error(exc):
            return fail(f"Spark failed: {spark_error_summary(exc)}", EXIT_SPARK_FAILED)
        raise
    out = Path(options.out).absolute()
    _print_summary(summary, out, stream if stream is not None else sys.stdout)
    return EXIT_OK


def _print_summary(summary: dict[str, Any], out: Path, stream: TextIO) -> None:
    def ms(value: Any) -> str:
        return "-" if value is None else f"{value:,.1f}"

    rows = summary.get("lateness_ms", [])
    if rows:
        stream.write(
            f"{'delivery lateness':<18} {'count':>10} {'p50':>8} {'p90':>8} {'p99':>8} "
            f"{'p99.9':>8} {'max':>8} {'early':>7}\n"
        )
        for r in rows:
            stream.write(
                f"{r['group']:<18} {r['count']:>10,} {ms(r['p50_ms']):>8} {ms(r['p90_ms']):>8} "
                f"{ms(r['p99_ms']):>8} {ms(r['p999_ms']):>8} {ms(r['max_ms']):>8} "
                f"{r['early_count']:>7,}\n"
            )
    for f in summary.get("failovers", []):
        stream.write(
            f"failover term {f['old_term']}->{f['new_term']} ({f['old_leader']}->"
            f"{f['new_leader']}): no commits for {f['window_ms']:,} ms, delivery gap "
            f"{ms(f['delivery_gap_ms'])} ms\n"
        )
    bad = {t: c["corrupt"] for t, c in summary["inputs"].items() if c["corrupt"]}
    if bad:
        stream.write(
            "corrupt lines skipped: " + ", ".join(f"{t} {n:,}" for t, n in bad.items()) + "\n"
        )
    stream.write(f"report: {out / 'report.html'}\nsummary: {out / 'summary.json'}\n")
