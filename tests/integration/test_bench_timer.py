"""``chronomq bench timer`` end to end, small: the command runs, prints its table and writes
the figures it promises (the figures themselves are measured by hand, see the docs' benchmarks page)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

from .conftest import free_port_base


def test_bench_timer_runs_both_phases(tmp_path: Path) -> None:
    http, raft = free_port_base(3, random.Random())
    out = tmp_path / "bench.json"
    cmd = [
        sys.executable, "-m", "chronomq", "bench", "timer", "--nodes", "3",
        "--rate", "200", "--duration", "3", "--horizon", "3", "--burst", "3000",
        "--http-port", str(http), "--raft-port", str(raft),
        "--data-dir", str(tmp_path / "data"), "--out", str(out),
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert (result["early"], result["lost"], result["duplicated"]) == (0, 0, 0)
    assert result["delivered"] == result["produced"] == 600
    assert result["drained"] == 3000
    assert result["drain_messages_per_s"] > 0
    assert 0 < result["peak_rss_bytes"] <= result["max_node_peak_rss_bytes"]
    assert len(result["peak_rss_bytes_by_node"]) == 3
    assert result["drain_term_changes"] >= 0
    assert "drain_messages_per_s" in done.stdout and "burst: 3000 produced" in done.stderr
