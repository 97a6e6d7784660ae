"""Fixtures of the ops tests: small synthetic logs, a local SparkSession, line helpers."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from ops.synth import SynthResult, SynthSpec, synth_logs

SMALL_ROWS = 20_000


@pytest.fixture(scope="session")
def small_logs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, SynthResult]:
    """Synthetic logs of a 3-node run with two failovers, shared read-only by the tests."""
    out = tmp_path_factory.mktemp("small-logs")
    # 200 messages a second make a run of about 40 s: long enough for three delay levels.
    result = synth_logs(out, SynthSpec(rows=SMALL_ROWS, rate_per_s=200, seed=42))
    return out, result


@pytest.fixture(scope="module")
def spark() -> Iterator[object]:
    """One local SparkSession per test module (the JVM itself is reused between modules)."""
    pytest.importorskip("pyspark")
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from ops.report import spark_session

    conf = [("spark.ui.enabled", "false"), ("spark.sql.shuffle.partitions", "4")]
    with spark_session("local[2]", conf=conf, log_level="ERROR") as session:
        yield session
