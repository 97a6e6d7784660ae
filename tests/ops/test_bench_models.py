"""``chronomq bench models`` end to end, small: the command times the produce path's parsing in
its own process, prints its table and writes the figures it promises (the figures themselves
are measured by hand, see the docs' benchmarks page)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_bench_models_prints_and_writes_its_figures(tmp_path: Path) -> None:
    out = tmp_path / "models.json"
    cmd = [
        sys.executable, "-m", "chronomq", "bench", "models",
        "--messages", "8", "--rounds", "2", "--out", str(out),
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    timed = ("orjson_loads_ms", "decode_ms", "parse_ms")
    assert list(result) == ["messages", "body_bytes", *timed]
    assert result["messages"] == 8 and result["body_bytes"] > 8 * 100
    assert all(isinstance(result[name], float) and result[name] >= 0 for name in timed)
    assert result["parse_ms"] > 0  # tens of microseconds even for 8 messages
    table = dict(line.split(maxsplit=1) for line in done.stdout.splitlines())
    assert table == {name: str(value) for name, value in result.items()}
    assert all(f"{name}: best of 5 x 2 rounds" in done.stderr for name in timed)
