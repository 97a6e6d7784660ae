"""``chronomq report``: replication and latency report of a cluster's logs, computed with PySpark.

Reads every node's logs (see :mod:`chronomq.cluster.logs.schema`), and writes into ``--out``:

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
import functools
import os
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import orjson

from chronomq.cluster.logs.schema import SCHEMA_VERSION, RecordType
from chronomq.ops import report_tables as rt
from chronomq.ops.report_ingest import (
    LineCounts,
    LogFiles,
    ReportInputError,
    find_log_files,
    read_messages,
    read_small,
)
from chronomq.ops.sparkengine import (
    DEFAULT_DRIVER_MEMORY,
    DEFAULT_MASTER,
    EngineError,
    is_spark_error,
    spark_error_summary,
    spark_session,
)
from chronomq.ops.sparkprogress import SparkProgress

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

APP_NAME = "chronomq-report"
PARALLEL_JOBS = 4

EXIT_OK, EXIT_SPARK_FAILED, EXIT_BAD_INPUT, EXIT_INTERRUPTED = 0, 1, 2, 130


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


def in_parallel(*calls: Callable[[], Any]) -> list[Any]:
    """Run independent Spark actions side by side: small jobs are mostly waiting on overhead."""
    if len(calls) <= 1:
        return [call() for call in calls]
    with ThreadPoolExecutor(PARALLEL_JOBS, thread_name_prefix="report-job") as pool:
        futures = [pool.submit(call) for call in calls]
        return [f.result() for f in futures]


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
        event_table, changes, drops = rt.Table("events", (), []), None, 0
        if read.rows is not None:
            rows = read.rows
            event_table, changes, drops = in_parallel(
                lambda: rt.events(rows),
                lambda: rt.leader_changes(rows),
                lambda: rt.writer_drops(rows),
            )

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

        phase("figures", "lateness, end-to-end latency, throughput, replication")
        totals = rt.totals(messages) if messages is not None else None
        bucket_s = rt.bucket_seconds(
            totals.first_ms if totals else None, totals.last_ms if totals else None
        )
        jobs: dict[str, Callable[[], Any]] = {}
        if messages is not None:
            msgs = messages
            jobs["lateness"] = lambda: rt.lateness(msgs)
            jobs["end_to_end"] = lambda: rt.end_to_end(msgs)
            jobs["lateness_histogram"] = lambda: rt.lateness_histogram(msgs)
            jobs["throughput"] = lambda: rt.throughput(msgs, bucket_s)
        if repl_df is not None:
            cmds = rt.commands(repl_df).cache()
            followers = rt.follower_applies(repl_df, cmds).cache()
            cached += [cmds, followers]
            jobs["commit_latency"] = lambda: rt.commit_latency(cmds)
            jobs["apply_lag"] = lambda: rt.apply_lag(followers)
            jobs["apply_lag_over_time"] = lambda: rt.apply_lag_over_time(followers, bucket_s)
            jobs["terms"] = lambda: rt.terms(cmds)
        results = dict(zip(jobs, in_parallel(*jobs.values()), strict=True))
        replication: dict[str, Any] = {"commands": 0}
        term_table = results.get("terms", rt.Table("terms", (), []))
        if repl_df is not None:
            lag, unmatched = results["apply_lag"]
            tables += [results["commit_latency"], lag, results["apply_lag_over_time"], term_table]
            replication = {
                "commands": sum(r["commands"] for r in term_table.records()),
                "commit_latency_ms": results["commit_latency"].records(),
                "apply_lag_ms": lag.records(),
                "follower_lines_without_leader_line": unmatched,
            }
        latency_summary: dict[str, Any] = {}
        if messages is not None and totals is not None:
            tables += [results[n] for n in ("lateness", "lateness_histogram", "end_to_end")]
            tables.append(results["throughput"])
            latency_summary = {
                "messages": totals.as_dict(),
                "lateness_ms": results["lateness"].records(),
                "end_to_end_ms": results["end_to_end"].records(),
                "throughput": _throughput_summary(results["throughput"], totals),
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
            "events": counts[RecordType.EVENTS].valid,
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

    def write(table: rt.Table) -> None:
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

    in_parallel(*[functools.partial(write, table) for table in tables])


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
    from chronomq.ops.report_html import render

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
            options.master,
            options.conf,
            options.driver_memory,
            options.spark_log_level,
            app_name=APP_NAME,
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
    except (ReportFailed, EngineError) as exc:
        return fail(str(exc), exc.exit_code)
    except KeyboardInterrupt:
        return fail("interrupted", EXIT_INTERRUPTED)
    except Exception as exc:
        if is_spark_error(exc):
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
