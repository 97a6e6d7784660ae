"""The Spark report over synthetic logs, checked against figures recomputed in plain Python."""

from __future__ import annotations

import csv
import json
import math
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from chronomq.cluster.logs.schema import CorruptLine, NewerSchemaVersion, RecordType, decode
from chronomq.ops.report import ReportFailed, compute
from chronomq.ops.report_ingest import CORRUPT, OK, find_log_files, parse_lines
from chronomq.ops.synth import SynthResult
from tests.ops import expected
from tests.ops.conftest import ReportRun
from tests.ops.pngcheck import colour_counts

pytestmark = pytest.mark.spark

CHROMIUM = Path("/usr/bin/chromium")
PALETTE_RGB = [(0x1F, 0x77, 0xB4), (0xD6, 0x27, 0x28), (0x2C, 0xA0, 0x2C), (0xFF, 0x7F, 0x0E)]


@pytest.fixture(scope="module")
def report(local_report: ReportRun) -> tuple[dict[str, Any], Path]:
    summary = json.loads((local_report.out / "summary.json").read_text())
    return summary, local_report.out


@pytest.fixture(scope="module")
def truth(small_logs: tuple[Path, SynthResult]) -> dict[str, Any]:
    root = small_logs[0]
    msgs = expected.messages(root)
    return {
        "messages": msgs,
        "lateness": expected.lateness(msgs),
        "end_to_end": expected.end_to_end(msgs),
        "replication": expected.replication(root),
        "failovers": expected.failovers(root, msgs),
        "throughput": expected.throughput(msgs),
    }


def assert_stats(got: dict[str, Any], want: dict[str, Any], where: str) -> None:
    for key in ("count", "p50_ms", "p90_ms", "p99_ms", "p999_ms", "max_ms", "min_ms"):
        assert got[key] == want[key], f"{where}: {key} is {got[key]}, expected {want[key]}"
    assert math.isclose(got["mean_ms"], want["mean_ms"], abs_tol=1e-3), where


def test_lateness_percentiles_match_python(
    report: tuple[dict[str, Any], Path], truth: dict[str, Any]
) -> None:
    summary, _ = report
    rows = {r["group"]: r for r in summary["lateness_ms"]}
    want = truth["lateness"]
    assert set(rows) == set(want)
    assert {"timer", "levels (all)", "all", "level 1", "level 2"} <= set(rows)
    for group, w in want.items():
        assert_stats(rows[group], w, group)
        assert rows[group]["early_count"] == w["early_count"], group
    # The synthetic run has clock differences between nodes: some deliveries look early.
    assert rows["all"]["early_count"] > 0
    assert rows["level 1"]["delay_ms"] == 1_000 and rows["timer"]["delay_ms"] is None


def test_end_to_end_matches_python(
    report: tuple[dict[str, Any], Path], truth: dict[str, Any]
) -> None:
    rows = {r["group"]: r for r in report[0]["end_to_end_ms"]}
    assert set(rows) == set(truth["end_to_end"])
    for group, w in truth["end_to_end"].items():
        assert_stats(rows[group], w, group)


def test_replication_matches_python(
    report: tuple[dict[str, Any], Path], truth: dict[str, Any]
) -> None:
    repl = report[0]["replication"]
    want = truth["replication"]
    assert repl["commands"] == want["commands"]
    commit = {r["leader"]: r for r in repl["commit_latency_ms"]}
    assert set(commit) == set(want["commit"]) == {"n0", "n1", "n2", "all"}
    for leader, w in want["commit"].items():
        assert_stats(commit[leader], w, f"commit latency {leader}")
    lag = {r["node"]: r for r in repl["apply_lag_ms"]}
    assert set(lag) == set(want["lag"])
    for node, w in want["lag"].items():
        assert_stats(lag[node], w, f"apply lag {node}")
    # n0 was down for a while and caught up: its worst lag is seconds, the others' is not.
    assert lag["n0"]["max_ms"] > 3_000 > lag["n1"]["max_ms"]
    assert repl["follower_lines_without_leader_line"] == 0


def test_failover_windows_match_python(
    report: tuple[dict[str, Any], Path], truth: dict[str, Any]
) -> None:
    got = report[0]["failovers"]
    assert len(got) == 2
    for g, w in zip(got, truth["failovers"], strict=True):
        for key, value in w.items():
            assert g[key] == value, f"{key}: {g[key]} != {value}"
    assert got[0]["old_leader"] == "n0" and got[0]["new_leader"] == "n1"
    assert got[0]["window_ms"] >= 400 and got[0]["delivery_gap_ms"] >= 400
    changes = report[0]["leader_changes"]
    assert [(c["leader"], c["term"]) for c in changes] == [("n0", 1), ("n1", 2), ("n2", 3)]


def test_throughput_and_totals_match_python(
    report: tuple[dict[str, Any], Path], truth: dict[str, Any]
) -> None:
    summary, out = report
    msgs = truth["messages"]
    totals = summary["messages"]
    assert totals["messages"] == len(msgs)
    assert totals["delivered"] == sum(1 for m in msgs.values() if m.get("delivered_ms"))
    assert totals["consumed"] == sum(1 for m in msgs.values() if m.get("consumed_ms"))
    assert totals["duplicate_deliveries"] == 0
    with (out / "csv" / "throughput.csv").open() as f:
        rows = list(csv.DictReader(f))
    for what, counter in truth["throughput"].items():
        got = {int(r["second"]): int(r[what]) for r in rows if int(r[what])}
        assert got == dict(counter), what
        assert summary["throughput"][what]["total"] == sum(counter.values())


def test_outputs_are_written(report: tuple[dict[str, Any], Path], spark: Any) -> None:
    summary, out = report
    assert json.loads((out / "summary.json").read_text()) == json.loads(json.dumps(summary))
    run = json.loads((out / "run.json").read_text())
    assert run["lines"] == sum(v["lines"] for v in summary["inputs"].values())
    assert summary["inputs"]["latency"]["valid"] == summary["inputs"]["latency"]["lines"]
    tables = ["lateness", "end_to_end", "throughput", "commit_latency", "apply_lag"]
    tables += ["apply_lag_over_time", "failovers", "events", "inputs", "lateness_histogram"]
    for name in tables:
        with (out / "csv" / f"{name}.csv").open() as f:
            csv_rows = list(csv.reader(f))
        parquet = spark.read.parquet(str(out / "parquet" / name))
        assert parquet.columns == csv_rows[0], name
        assert parquet.count() == len(csv_rows) - 1, name
    page = (out / "report.html").read_text()
    assert page.count("<svg") >= 4
    # Self-contained: nothing to fetch (the only URL is the SVG namespace).
    assert not re.search(r"""(src|href)\s*=|url\(|@import|<script""", page)
    assert set(re.findall(r"https?://[^\s\"'<>]+", page)) == {"http://www.w3.org/2000/svg"}


def test_report_renders_in_headless_chromium(
    report: tuple[dict[str, Any], Path], tmp_path: Path
) -> None:
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} is not installed (apt-get install chromium)")
    shot = tmp_path / "report.png"
    command = [
        str(CHROMIUM),
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--proxy-server=http://127.0.0.1:9",  # no network: any fetch would fail
        f"--user-data-dir={tmp_path / 'profile'}",
        f"--screenshot={shot}",
        "--window-size=1000,2400",
        (report[1] / "report.html").as_uri(),
    ]
    subprocess.run(command, check=True, capture_output=True, timeout=120)
    counts = colour_counts(shot.read_bytes())
    total = sum(counts.values())
    white = counts[(255, 255, 255)]
    assert total == 1000 * 2400
    assert (total - white) / total > 0.05, "the screenshot is (nearly) blank"
    drawn = [c for c in PALETTE_RGB if counts[c] > 500]
    assert len(drawn) >= 3, f"chart colours missing from the screenshot: {counts.most_common(8)}"


# --- bad input ----------------------------------------------------------------------------


def copy_logs(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_corrupt_truncated_and_newer_lines_are_counted_and_skipped(
    spark: Any,
    small_logs: tuple[Path, SynthResult],
    report: tuple[dict[str, Any], Path],
    tmp_path: Path,
) -> None:
    clean = report[0]
    logs = copy_logs(small_logs[0], tmp_path / "logs")
    with (logs / "n1" / "latency-000001.jsonl").open("ab") as f:
        f.write(b"\n   \n")  # blank lines are not errors
        f.write(b'{"v":1,"t":"latency","msg_id":"X","kind":"timer"}\n')  # fields missing
        f.write(b"\x00\x00\x00\x00 not json at all\n")
        f.write(b'{"v":2,"t":"latency","msg_id":"Z","renamed_field":1}\n')  # newer schema
        f.write(b'{"v":1,"t":"latency","msg_id":"Y","topic":"t","kind":"plain","st')  # torn
    with (logs / "n2" / "replication-000001.jsonl").open("ab") as f:
        f.write(b'{"v":1,"t":"replication","index":"seven"}\n')
    data = compute(spark, find_log_files([logs]), skip_newer=True)
    inputs = data.summary["inputs"]
    assert inputs["latency"]["corrupt"] == 3 and inputs["latency"]["blank"] == 2
    assert inputs["latency"]["newer_version"] == 1
    assert inputs["replication"]["corrupt"] == 1
    assert inputs["latency"]["valid"] == clean["inputs"]["latency"]["valid"]
    for key in ("lateness_ms", "end_to_end_ms", "replication", "failovers", "messages"):
        assert data.summary[key] == clean[key], key
    examples = data.examples["latency"]
    assert examples and all("latency-000001.jsonl: " in e for e in examples)


def test_newer_schema_version_stops_with_a_clear_message(spark: Any, tmp_path: Path) -> None:
    (tmp_path / "n0").mkdir()
    good = b'{"v":1,"t":"events","ts_ms":1,"node":"n0","type":"service_start"}\n'
    newer = b'{"v":3,"t":"events","when":"2030-01-01","what":"renamed"}\n'
    (tmp_path / "n0" / "events-000001.jsonl").write_bytes(good + newer + newer)
    with pytest.raises(ReportFailed) as caught:
        compute(spark, find_log_files([tmp_path]))
    message = str(caught.value)
    assert "2 events log lines have schema version 3" in message
    assert "reads versions up to 1" in message and "--skip-newer" in message
    assert caught.value.exit_code == 2


def test_logs_with_no_valid_line_are_refused(spark: Any, tmp_path: Path) -> None:
    (tmp_path / "n0").mkdir()
    (tmp_path / "n0" / "latency-000001.jsonl").write_bytes(b"garbage\n{}\n")
    with pytest.raises(ReportFailed, match="no valid log records"):
        compute(spark, find_log_files([tmp_path]))


LINES = [
    b'{"v":1,"t":"latency","msg_id":"a","topic":"t","kind":"plain","stage":"stored",'
    b'"node":"n0","store_ms":1}',
    b'{"v":1,"t":"latency","msg_id":"a","topic":"t","kind":"level","level":2,'
    b'"stage":"delivered","node":"n0","store_ms":1,"due_ms":5,"delivered_ms":6}',
    b'{"v":1,"t":"latency","msg_id":"a","topic":"t","kind":"level","stage":"stored",'
    b'"node":"n0","store_ms":1,"due_ms":5}',
    b'{"v":1,"t":"latency","msg_id":"a","topic":"t","kind":"plain","level":1,'
    b'"stage":"stored","node":"n0","store_ms":1}',
    b'{"v":1,"t":"latency","msg_id":"a","topic":"t","kind":"timer","stage":"stored",'
    b'"node":"n0","store_ms":1}',
    b'{"v":1,"t":"latency","msg_id":"a","topic":"t","kind":"timer","stage":"consumed",'
    b'"node":"n0","consumed_ms":9}',
    b'{"v":1,"t":"latency","msg_id":"a","topic":"t","kind":"plain","stage":"delivered",'
    b'"node":"n0"}',
    b'{"v":1,"t":"latency","msg_id":"","topic":"t","kind":"plain","stage":"stored",'
    b'"node":"n0","store_ms":1}',
    b'{"v":1,"t":"latency","msg_id":"a","topic":"t","kind":"plain","stage":"stored",'
    b'"node":"n0","store_ms":-1}',
    b'{"v":1,"t":"latency","msg_id":"a","topic":"t","kind":"plain","stage":"stored",'
    b'"node":"n0","store_ms":1.5}',
    b'{"v":1,"t":"latency","msg_id":"a","topic":"t","kind":"plain","stage":"stored",'
    b'"node":"n0","store_ms":"1"}',
    b'{"v":1,"t":"latency","msg_id":"a","topic":"t","kind":"weird","stage":"stored",'
    b'"node":"n0","store_ms":1}',
    b'{"v":1,"t":"events","ts_ms":1,"node":"n0","type":"service_start"}',
    b'{"v":1.0,"t":"latency"}',
    b'{"v":1,"t":"latency","msg_id":"a","topic":"t","kind":"plain","stage":"stored",'
    b'"node":"n0","store_ms":1,"extra":{"x":[1,2]}}',
    b'{"v":1,"t":"latency","msg_id":"a","topic":"t","kind":"plain","stage":"stored","node":"n0"',
    b"[]",
    b"null",
]


def test_spark_validation_agrees_with_the_python_decoder(spark: Any, tmp_path: Path) -> None:
    path = tmp_path / "latency-000001.jsonl"
    path.write_bytes(b"\n".join(LINES) + b"\n")
    got = [r["_status"] for r in parse_lines(spark, [str(path)], RecordType.LATENCY).collect()]
    want = []
    for line in LINES:
        try:
            decode(line, expect=RecordType.LATENCY)
            want.append(OK)
        except NewerSchemaVersion:
            want.append("newer")
        except CorruptLine:
            want.append(CORRUPT)
    assert got == want
    assert want.count(OK) == 4
