"""``chronomq drill --faults power-cut``: every node's data directory on a power-cut mount.

Needs root and FUSE (``/dev/fuse``, libfuse 3, mfusepy); skips saying which is missing.
``.ci/run`` installs fuse3 on CI, where it runs as root.
"""

from __future__ import annotations

import json
import random
import subprocess
from pathlib import Path

import pytest

from chronomq.ops.drill.history import read_history
from chronomq.ops.drill.powercut.mount import available
from tests.integration.test_drill import drill_cmd, leftover_nodes

_OK, _WHY = available()
pytestmark = [pytest.mark.integration, pytest.mark.skipif(not _OK, reason=_WHY)]


def _mounts_under(path: Path) -> list[str]:
    with open("/proc/self/mounts", encoding="utf-8") as f:
        return [line for line in f if str(path) in line]


def test_power_cuts_of_the_leader_a_minority_and_every_node(tmp_path: Path) -> None:
    """At least five cuts (leader, minority, all, in turn) under flush=sync lose, repeat, hasten
    and invent nothing: each is reported with what the disks dropped; the cluster comes back and
    the replicas converge; nothing is left mounted or running."""
    seed = random.randrange(1, 10**6)
    # A cut costs 8-15 s here (restarts, and the cut of every node an election); 75 s of
    # workload makes 6-8 of them, about two minutes in all.
    cmd = drill_cmd(tmp_path, "power-cut", 75, seed)
    cmd += ["--hold", "1", "--rate", "60", "--set", "flush=sync"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400, check=False)
    detail = f"seed {seed}\n{proc.stdout}\n{proc.stderr[-4000:]}"
    # flush=sync acknowledges only what every majority's disk holds: a cut may drop only
    # what was not acknowledged, so anything else is a safety violation (exit 1).
    assert proc.returncode == 0, detail
    result = json.loads((tmp_path / "drill.json").read_text())
    assert not result.get("aborted"), detail
    assert result["faults_run"] and set(result["faults_run"]) == {"power-cut"}, detail
    for name in ("lost", "duplicated", "early", "unexpected"):
        assert result[name] == 0, f"{name}: {detail}"
    assert result["acknowledged"] > 1000, detail
    assert result["replicas_converged"] is True, detail
    assert result["final_read"] is True, detail
    cuts = [f for f in result["faults"] if f["fault"] == "power-cut"]
    assert len(cuts) >= 5, detail
    assert [f["scope"] for f in cuts][:5] == ["leader", "minority", "all", "leader", "minority"]
    assert cuts[2]["nodes"] == [0, 1, 2], detail
    for f in cuts:
        assert f["lost"] == 0 and f.get("gone", 0) == 0, f
    summary = result["power_cut_summary"]
    assert summary["cuts"] == len(cuts) and summary["async_bound_ms"] == 500, detail
    assert summary["lost"] == sum(f["lost"] for f in cuts), detail
    assert len(result["power_cuts"]) == len(cuts), detail
    for cut in result["power_cuts"]:
        assert sorted(cut["cut"]) == [str(n) for n in cut["nodes"]], cut
    assert "power cuts lost" in proc.stdout, detail
    ends = [
        r
        for r in read_history(tmp_path / "run" / "history.jsonl")
        if r.get("op") == "fault" and r.get("type") == "end"
    ]
    assert len(ends) == len(cuts), detail
    assert not leftover_nodes(tmp_path / "run")
    assert not _mounts_under(tmp_path), _mounts_under(tmp_path)
