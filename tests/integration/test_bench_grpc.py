"""``chronomq bench grpc`` end to end, small: the command runs the official client against its
own cluster, prints its table and writes the figures it promises, and every message sent is
received and acked exactly once (the rates themselves are measured by hand, see the docs' benchmarks page)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import free_port_base

pytestmark = pytest.mark.integration


def test_bench_grpc_sends_receives_and_acks_every_message(tmp_path: Path) -> None:
    http, raft = free_port_base(3, random.Random())
    out = tmp_path / "bench.json"
    cmd = [
        sys.executable, "-m", "chronomq", "bench", "grpc", "--nodes", "3",
        "--messages", "150", "--threads", "4", "--inflight", "16", "--consumers", "2",
        "--batch", "16", "--http-messages", "50",
        "--http-port", str(http), "--raft-port", str(raft),
        "--data-dir", str(tmp_path / "data"), "--out", str(out),
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["sync_sends_messages"] == result["async_sends_messages"] == 150
    assert result["sent"] == 301  # and one warm-up message
    assert result["received"] == result["acked"] == 301
    assert (result["redelivered"], result["ack_failed"], result["left_after"]) == (0, 0, 0)
    assert result["http_sends_messages"] == 50
    for phase in ("sync_sends", "async_sends", "http_sends"):
        assert result[f"{phase}_per_s"] > 0
        assert 0 < result[f"{phase}_latency_ms_p50"] <= result[f"{phase}_latency_ms_p99"]
    assert result["receive_ack_per_s"] > 0
    for phase in ("sync_sends", "async_sends", "receive_ack", "http_sends"):
        cpu = result[f"{phase}_cpu"]
        assert cpu["client_pct"] >= 0 and cpu["leader_pct"] is not None
        assert len(cpu["nodes_pct"]) == 3
        assert sum(name.endswith("(leader)") for name in cpu["nodes_pct"]) == 1
    assert "receive_ack_per_s" in done.stdout and "sync_sends_cpu" in done.stdout
