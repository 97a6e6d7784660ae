"""Fixtures of the ops tests: small synthetic logs, a local SparkSession, a report run."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from chronomq.ops.synth import SynthResult, SynthSpec, synth_logs

SMALL_ROWS = 20_000
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def small_logs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, SynthResult]:
    """Synthetic logs of a 3-node run with two failovers, shared read-only by the tests."""
    out = tmp_path_factory.mktemp("small-logs")
    # 200 messages a second make a run of about 40 s: long enough for three delay levels.
    result = synth_logs(out, SynthSpec(rows=SMALL_ROWS, rate_per_s=200, seed=42))
    return out, result


@pytest.fixture(scope="module")
def spark() -> Iterator[Any]:
    """One local SparkSession per test module (the JVM itself is reused between modules)."""
    pytest.importorskip("pyspark")
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from chronomq.ops.sparkengine import spark_session

    conf = [("spark.ui.enabled", "false"), ("spark.sql.shuffle.partitions", "4")]
    with spark_session("local[2]", conf=conf, log_level="ERROR") as session:
        yield session


def cli_report(logs: Path, out: Path, master: str, *extra: str) -> subprocess.CompletedProcess[str]:
    """``chronomq report`` in a process of its own, as an operator runs it."""
    env = dict(os.environ, SPARK_LOCAL_IP="127.0.0.1", PYTHONPATH=str(REPO))
    command = [
        sys.executable,
        "-m",
        "chronomq.ops.cli",
        "report",
        "--logs",
        str(logs),
        "--out",
        str(out),
    ]
    command += ["--master", master, "--driver-memory", "1g", *extra]
    return subprocess.run(
        command, env=env, cwd=REPO, capture_output=True, text=True, timeout=600, check=False
    )


@dataclass(frozen=True)
class ReportRun:
    out: Path
    process: subprocess.CompletedProcess[str]


@pytest.fixture(scope="session")
def local_report(
    small_logs: tuple[Path, SynthResult], tmp_path_factory: pytest.TempPathFactory
) -> ReportRun:
    """The report of the small logs on local[2], through the command line, run once."""
    pytest.importorskip("pyspark")
    out = tmp_path_factory.mktemp("local-report")
    process = cli_report(small_logs[0], out, "local[2]")
    assert process.returncode == 0, process.stderr
    return ReportRun(out, process)
