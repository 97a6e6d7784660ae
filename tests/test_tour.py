"""The docs' five-minute tour, run as written against a real 3-node cluster.

The tour lies between ``<!-- tour:start -->`` and ``<!-- tour:end -->`` in docs/tutorial/tour.md;
each of its steps is an HTML comment ``<!-- tour:step NAME -->`` followed by a fenced ``sh``
block. The cluster is started with the command of the Makefile's ``run`` target (what
``make run`` runs), in a fresh directory that plays the repository's, so ``./var`` and
``$PWD/var`` mean what they mean for a reader. The blocks run through bash, in order, each
after the ``setup`` block (as in one terminal), and every step's output is checked.

What the test changes in the text, and nothing else (each must still be found in the tour):

- ports 8080..8082 become free loopback ports, for the cluster and in every command;
- ``source .venv/bin/activate`` becomes this interpreter's bin directory on the PATH;
- ``chronomq drill`` gets free ports too (its default ports may be taken on a shared machine).

Steps that need Docker are skipped.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.integration.conftest import free_port_base

ROOT = Path(__file__).resolve().parent.parent
TOUR = ROOT / "docs" / "tutorial" / "tour.md"
START, END = "<!-- tour:start -->", "<!-- tour:end -->"
STEPS = ("setup", "produce", "delay", "timer", "status", "failover", "drill", "report", "docker")
NEEDS_DOCKER = {"docker"}
TOUR_HTTP_PORT = 8080
_STEP = re.compile(r"<!-- tour:step (?P<name>[\w-]+) -->\n```sh\n(?P<code>.*?)\n```", re.S)
# Seconds each step may take before the test fails; the whole tour takes about 90 s.
STEP_TIMEOUT_S = {"drill": 240.0, "report": 240.0}
DEFAULT_STEP_TIMEOUT_S = 60.0


@dataclass(frozen=True, slots=True)
class Step:
    name: str
    code: str


def tour_steps(text: str) -> list[Step]:
    start, end = text.find(START), text.find(END)
    assert 0 <= start < end, f"{TOUR.relative_to(ROOT)} lacks the {START} ... {END} markers"
    return [Step(m["name"], m["code"]) for m in _STEP.finditer(text[start:end])]


@dataclass(frozen=True, slots=True)
class Localizer:
    """The tour's text adapted to this machine (see the module docstring)."""

    http_port: int
    bin_dir: Path
    drill_http_port: int
    drill_raft_port: int

    def replacements(self) -> list[tuple[str, str]]:
        return [
            ("source .venv/bin/activate", f'export PATH="{self.bin_dir}:$PATH"'),
            (
                "chronomq drill ",
                f"chronomq drill --http-port {self.drill_http_port} "
                f"--raft-port {self.drill_raft_port} ",
            ),
        ]

    def __call__(self, code: str) -> str:
        for old, new in self.replacements():
            code = code.replace(old, new)
        return re.sub(
            r"\b808([0-2])\b", lambda m: str(self.http_port + int(m[1])), code, flags=re.ASCII
        )


def split_output(out: str) -> tuple[list[Any], str]:
    """The JSON objects printed, and the rest of the text with each object replaced by a line
    break: curl's answers end without one, so they run into what is printed next."""
    decoder = json.JSONDecoder()
    found: list[Any] = []
    text: list[str] = []
    done = 0
    i = out.find("{")
    while i >= 0:
        try:
            obj, end = decoder.raw_decode(out, i)
        except ValueError:
            i = out.find("{", i + 1)
            continue
        found.append(obj)
        text.append(out[done:i] + "\n")
        done = end
        i = out.find("{", end)
    text.append(out[done:])
    return found, "".join(text)


def json_objects(out: str) -> list[Any]:
    return split_output(out)[0]


def table_rows(out: str, first_column: str) -> list[list[str]]:
    """The rows of every table printed whose header starts with ``first_column``."""
    rows: list[list[str]] = []
    in_table = False
    for line in split_output(out)[1].splitlines():
        cells = line.split()
        if cells and cells[0] == first_column:
            in_table = True
        elif in_table and cells and not line.startswith("next_offset"):
            rows.append(cells)
        else:
            in_table = False
    return rows


def make_run_command(bin_dir: Path, http_port: int, raft_port: int) -> list[str]:
    """The Makefile's ``run`` recipe with this machine's ports."""
    makefile = (ROOT / "Makefile").read_text()
    found = re.search(r"^run:.*\n\t(?P<line>.+)$", makefile, re.M)
    assert found, "the Makefile has no run target"
    line = found["line"].replace("$(BIN)/", f"{bin_dir}/")
    line, n_http = re.subn(r"--http-port \d+", f"--http-port {http_port}", line)
    line, n_raft = re.subn(r"--raft-port \d+", f"--raft-port {raft_port}", line)
    assert n_http == n_raft == 1, f"make run's command changed: {found['line']}"
    return shlex.split(line)


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=2) as r:  # noqa: S310 - loopback URLs we built
        return json.loads(r.read())


class RunningCluster:
    """``make run``'s command as a process, its output lines read on a thread."""

    def __init__(self, command: list[str], cwd: Path, env: dict[str, str]) -> None:
        self.cwd = cwd
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.seen: list[str] = []
        self.proc = subprocess.Popen(
            command,
            cwd=cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
        )
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                break
            if line is None:
                break
            self.seen.append(line)
            if line.startswith("ready"):
                return
        raise TimeoutError(f"make run's cluster not ready in {timeout_s} s: {self.seen}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # Ctrl-C: it stops every node
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        # A node whose parent was killed outright would outlive it: end those, by pid.
        left = subprocess.run(
            ["pgrep", "-f", f"{self.cwd}/var/node-"], capture_output=True, text=True, check=False
        ).stdout.split()
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)

    def node_logs(self) -> str:
        out = []
        for log in sorted((self.cwd / "var").glob("node-*/node.log")):
            tail = log.read_text(errors="replace").splitlines()[-20:]
            out.append(f"--- {log.parent.name} ---\n" + "\n".join(tail))
        return "\n".join(out)


def test_the_tour_has_every_step_in_order() -> None:
    steps = tour_steps(TOUR.read_text())
    assert [s.name for s in steps] == list(STEPS)
    assert all(s.code.strip() for s in steps)


def test_localizing_changes_ports_and_paths_only() -> None:
    local = Localizer(21000, Path("/opt/venv/bin"), 22000, 23000)
    assert local("curl -s localhost:8082/x http://127.0.0.1:8080 18080 80801") == (
        "curl -s localhost:21002/x http://127.0.0.1:21000 18080 80801"
    )
    assert local("source .venv/bin/activate") == 'export PATH="/opt/venv/bin:$PATH"'
    assert local("chronomq drill --nodes 3") == (
        "chronomq drill --http-port 22000 --raft-port 23000 --nodes 3"
    )
    # Every change is one the tour needs; a tour edit that drops one makes this fail.
    tour = "\n".join(s.code for s in tour_steps(TOUR.read_text()))
    for old, _new in local.replacements():
        assert old in tour, f"the tour no longer contains {old!r}: update the test"
    assert f"localhost:{TOUR_HTTP_PORT}" in tour


def test_output_is_split_when_answers_run_together() -> None:
    out = '{"a":1}{"b":{"c":[2]}}MSG_ID  QUEUE\nab12  0\n{"d":"}"}\n'
    objects, text = split_output(out)
    assert objects == [{"a": 1}, {"b": {"c": [2]}}, {"d": "}"}]
    assert table_rows(out, "MSG_ID") == [["ab12", "0"]]
    assert text.split() == ["MSG_ID", "QUEUE", "ab12", "0"]


@pytest.mark.integration
@pytest.mark.spark
@pytest.mark.timeout(600)
def test_the_tour_runs_as_written(tmp_path: Path) -> None:
    pytest.importorskip("pyspark")
    for tool in ("bash", "curl", "jq", "pkill"):
        if shutil.which(tool) is None:
            pytest.skip(f"the tour needs {tool}")
    rng = random.Random()
    http, raft = free_port_base(3, rng)
    drill_http, drill_raft = free_port_base(3, rng)
    bin_dir = Path(sys.executable).parent
    assert (bin_dir / "chronomq").exists(), f"chronomq is not installed next to {sys.executable}"
    local = Localizer(http, bin_dir, drill_http, drill_raft)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHRONOMQ_")}
    env["SPARK_LOCAL_IP"] = "127.0.0.1"
    steps = tour_steps(TOUR.read_text())
    prelude = local(steps[0].code)
    urls = [f"http://127.0.0.1:{http + i}" for i in range(3)]

    cluster = RunningCluster(make_run_command(bin_dir, http, raft), tmp_path, env)
    outputs: dict[str, str] = {}
    try:
        cluster.wait_ready(60)
        wait_settled(urls, 30)
        for step in steps[1:]:
            if step.name in NEEDS_DOCKER:
                continue
            old_leader = leader_of(urls) if step.name == "failover" else None
            script = f"set -euo pipefail\n{prelude}\n{local(step.code)}\n"
            proc = subprocess.run(
                ["bash", "-c", script],
                cwd=tmp_path,
                env=env,
                capture_output=True,
                text=True,
                timeout=STEP_TIMEOUT_S.get(step.name, DEFAULT_STEP_TIMEOUT_S),
                check=False,
            )
            detail = (
                f"step {step.name!r} exited {proc.returncode}\n--- stdout\n{proc.stdout}\n"
                f"--- stderr\n{proc.stderr[-4000:]}\n{cluster.node_logs()}"
            )
            assert proc.returncode == 0, detail
            outputs[step.name] = proc.stdout
            CHECKS[step.name](proc.stdout, tmp_path, old_leader, detail)
    finally:
        cluster.stop()
    assert set(outputs) == set(STEPS) - {"setup"} - NEEDS_DOCKER


def wait_settled(urls: list[str], timeout_s: float) -> None:
    """Wait until every node names the same leader in the same term and that leader has
    confirmed its leadership: `ready` can come while a node that joined late forces a new
    term, and a reader's first curl would then meet a 503."""
    deadline = time.monotonic() + timeout_s
    seen: list[Any] = []
    while time.monotonic() < deadline:
        seen = []
        for url in urls:
            try:
                seen.append(get_json(f"{url}/v1/admin/node"))
            except OSError:
                seen.append(None)
        views = {(n["leader"], n["term"]) for n in seen if n is not None}
        if None not in seen and len(views) == 1:
            leader = next(iter(views))[0]
            if leader is not None and seen[leader]["role"] == "leader":
                return
        time.sleep(0.05)
    raise TimeoutError(f"the cluster did not settle on one leader in {timeout_s} s: {seen}")


def leader_of(urls: list[str]) -> int:
    """The leader as the first node that answers sees it."""
    for url in urls:
        try:
            view = get_json(f"{url}/v1/admin/cluster")
        except OSError:
            continue
        if view.get("leader") is not None:
            return int(view["leader"])
    raise AssertionError(f"no node of {urls} names a leader")


# ---------------------------------------------------------------------- per-step checks


def check_produce(out: str, cwd: Path, _leader: int | None, detail: str) -> None:
    answers = json_objects(out)
    assert len(answers) >= 2, detail
    topic, produced = answers[:2]
    assert topic.get("topic") == "orders" and len(topic["queues"]) == 1, detail
    assert produced.get("results", [{}])[0].get("topic") == "orders", detail
    assert produced["results"][0]["offset"] == 0, detail
    cli_produced = table_rows(out, "MSG_ID")[0]
    assert cli_produced[1:4] == ["orders", "0", "1"], detail  # topic, queue, offset
    assert "order 42 created" in out and "order 43 created" in out, detail
    assert "next_offset: 2" in out, detail


def check_delay(out: str, cwd: Path, _leader: int | None, detail: str) -> None:
    answers = json_objects(out)
    assert len(answers) >= 2, detail
    produced, pulled = answers[:2]
    placed = produced.get("results", [{}])[0]
    assert placed.get("topic") == "SCHEDULE_TOPIC_XXXX" and placed["delay_level"] == 2, detail
    assert len(pulled.get("messages", [])) == 1, detail
    [message] = pulled["messages"]
    assert message["msg_id"] == placed["msg_id"], detail  # the same message, delivered
    assert message["topic"] == "orders" and message["offset"] == 2, detail
    assert message["store_ms"] >= placed["deliver_ms"], detail  # never early
    cli_produced = table_rows(out, "MSG_ID")[0]
    assert cli_produced[1:3] == ["SCHEDULE_TOPIC_XXXX", "0"], detail  # level 1 waits in queue 0
    assert "order 43 times out" in out and "next_offset: 4" in out, detail


def check_timer(out: str, cwd: Path, _leader: int | None, detail: str) -> None:
    answers = json_objects(out)
    assert len(answers) >= 3, detail
    produced, pulled, cancelled = answers[:3]
    placed = produced.get("results", [{}])[0]
    assert placed.get("topic") == "rmq_sys_wheel_timer", detail
    assert len(pulled.get("messages", [])) == 1, detail
    [message] = pulled["messages"]
    assert message["msg_id"] == placed["msg_id"] and message["offset"] == 4, detail
    assert message["properties"]["TIMER_OUT_MS"] == str(placed["deliver_ms"]), detail
    assert message["store_ms"] >= placed["deliver_ms"], detail
    assert cancelled["status"] == "cancelled", detail
    [cli_cancel] = table_rows(out, "MSG_ID")[-1:]
    assert cli_cancel[1] == "cancelled", detail


def check_status(out: str, cwd: Path, _leader: int | None, detail: str) -> None:
    found = re.search(r"^leader: node (\d+)\s+term: (\d+)$", out, re.M)
    assert found, detail
    rows = table_rows(out, "ID")
    assert [r[0] for r in rows] == ["0", "1", "2"], detail
    assert sorted(r[1] for r in rows) == ["follower", "follower", "leader"], detail
    [view] = json_objects(out)[-1:]
    assert view == {"leader": int(found[1]), "term": int(found[2])}, detail


def check_failover(out: str, cwd: Path, old_leader: int | None, detail: str) -> None:
    assert old_leader is not None
    found = re.search(r"^leader: node (\d+)", out, re.M)
    assert found and int(found[1]) != old_leader, f"old leader {old_leader}\n{detail}"
    rows = {r[0]: r for r in table_rows(out, "ID")}
    assert rows[str(old_leader)][1] == "unknown" and "False" in rows[str(old_leader)], detail
    assert rows[found[1]][1] == "leader", detail
    dead = subprocess.run(
        ["pgrep", "-f", f"{cwd}/var/node-{old_leader}/node.toml"], capture_output=True, check=False
    )
    assert dead.returncode == 1, "the old leader's process still runs"


def check_drill(out: str, cwd: Path, _leader: int | None, detail: str) -> None:
    for name in ("lost", "duplicated", "early", "unexpected", "cancelled_delivered"):
        assert re.search(rf"^{name}\s+0$", out, re.M), f"{name}\n{detail}"
    assert re.search(r"^replicas converged\s+True$", out, re.M), detail
    assert re.search(r"^kill-leader\s+1\s", out, re.M), detail
    result = json.loads((cwd / "drill.json").read_text())
    # What ran, which on a slow machine may be a prefix of the plan; kill-leader ran (above).
    assert "kill-leader" in result["faults_run"], detail
    assert set(result["faults_run"]) <= set(result["faults_planned"]), detail
    assert set(result["faults_planned"]) == {"kill-leader", "pause-leader"}, detail
    assert result["acknowledged"] > 0 and result["lost"] == 0, detail
    assert list((cwd / "drill" / "logs").glob("n*/latency-*.jsonl")), detail


def check_report(out: str, cwd: Path, _leader: int | None, detail: str) -> None:
    report = cwd / "report"
    assert (report / "report.html").stat().st_size > 0, detail
    summary = json.loads((report / "summary.json").read_text())
    assert summary, detail
    assert re.search(r"^delivery lateness\s", out, re.M), detail
    assert re.search(r"^timer\s+\d", out, re.M), detail
    assert re.search(r"^report: .*/report/report\.html$", out, re.M), detail


CHECKS = {
    "produce": check_produce,
    "delay": check_delay,
    "timer": check_timer,
    "status": check_status,
    "failover": check_failover,
    "drill": check_drill,
    "report": check_report,
}
