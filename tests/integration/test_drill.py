"""``chronomq drill`` end to end: a short drill is safe, and Ctrl-C leaves nothing behind."""

from __future__ import annotations

import ctypes
import json
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from chronomq.ops.drill import netns
from chronomq.ops.drill.history import read_history
from chronomq.ops.drill.interrupt import HOLD_PHASE_ENV
from tests.integration.conftest import free_port_base, stop_signals_blocked_and_ignored

pytestmark = pytest.mark.integration


def drill_cmd(
    tmp_path: Path, faults: str, duration: int, seed: int, nodes: int = 3, *extra: str
) -> list[str]:
    http, raft = free_port_base(nodes, random.Random())
    return [
        sys.executable,
        "-m",
        "chronomq",
        "drill",
        "--nodes",
        str(nodes),
        "--faults",
        faults,
        "--duration",
        str(duration),
        "--seed",
        str(seed),
        "--out",
        str(tmp_path / "drill.json"),
        "--out-dir",
        str(tmp_path / "run"),
        "--http-port",
        str(http),
        "--raft-port",
        str(raft),
        *extra,
    ]


def leftover_nodes(out_dir: Path) -> list[str]:
    found = subprocess.run(
        ["pgrep", "-af", str(out_dir)], capture_output=True, text=True, check=False
    ).stdout
    return [line for line in found.splitlines() if "cluster node" in line]


def test_short_drill_loses_repeats_and_invents_nothing(tmp_path: Path) -> None:
    faults = ["kill-leader", "kill-follower", "pause-leader"]
    if netns.available()[0]:
        faults.append("partition-leader")
    seed = random.randrange(1, 10**6)
    proc = subprocess.run(
        drill_cmd(tmp_path, ",".join(faults), 45, seed),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    detail = f"seed {seed}\n{proc.stdout}\n{proc.stderr[-4000:]}"
    assert proc.returncode == 0, detail
    result = json.loads((tmp_path / "drill.json").read_text())
    for name in ("lost", "duplicated", "early", "unexpected", "cancelled_delivered"):
        assert result[name] == 0, f"{name}: {detail}"
    assert result["acknowledged"] > 500, detail
    assert result["replicas_converged"] is True and not result.get("aborted"), detail
    # Judge the faults that ran (the history's), not the plan: a slow machine may end the
    # drill's time before the last planned fault.
    started = [
        r["fault"]
        for r in read_history(tmp_path / "run" / "history.jsonl")
        if r.get("op") == "fault" and r.get("type") == "start"
    ]
    assert started and result["faults_run"] == started, detail
    assert set(started) <= set(faults), detail
    assert result["faults_run"] == result["faults_planned"][: len(started)], detail
    if "kill-leader" in started:
        assert result["rto_s"]["kill-leader"]["n"] >= 1, detail
    # The logs are where the report reads them.
    assert (tmp_path / "run" / "history.jsonl").exists()
    assert list((tmp_path / "run" / "logs" / "drill").glob("events-*.jsonl")), detail
    assert not leftover_nodes(tmp_path / "run")


def test_churn_drill_moves_the_leadership_and_a_member_safely(tmp_path: Path) -> None:
    """transfer-leader and membership on 3 nodes, 30 s: nothing lost or repeated, and every
    transfer and membership change is in the history with its answer."""
    seed = random.randrange(1, 10**6)
    proc = subprocess.run(
        drill_cmd(tmp_path, "transfer-leader,membership", 30, seed),
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    detail = f"seed {seed}\n{proc.stdout}\n{proc.stderr[-4000:]}"
    assert proc.returncode == 0, detail
    assert "[drill] fault transfer-leader" in proc.stderr, detail
    assert "[drill] fault membership" in proc.stderr, detail
    result = json.loads((tmp_path / "drill.json").read_text())
    for name in ("lost", "duplicated", "early", "unexpected", "cancelled_delivered"):
        assert result[name] == 0, f"{name}: {detail}"
    assert result["replicas_converged"] is True and not result.get("aborted"), detail
    assert sorted(result["faults_run"]) == ["membership", "transfer-leader"], detail
    assert {f["fault"] for f in result["faults"]} == {"membership", "transfer-leader"}, detail
    for name in ("membership", "transfer-leader"):
        assert result["rto_s"][name]["n"] >= 1, detail
        assert result["produce_rto_s"][name]["n"] >= 1, detail
        assert result["leaderless_s"][name]["n"] >= 1, detail
    steps = [
        r
        for r in read_history(tmp_path / "run" / "history.jsonl")
        if r.get("op") == "fault" and r.get("type") == "disruption"
    ]
    transfers = [r for r in steps if r["fault"] == "transfer-leader"]
    assert 3 <= len(transfers) <= 5, detail
    for t in transfers:
        # 200 once moved; 409/504, with the reason, when it did not.
        assert t["status"] in (200, 409, 504), t
        if t["status"] == 200:
            assert t["moved"] and t["claimed_leader"] == t["new_leader"], t
        if t["status"] in (409, 504):
            assert t["error"], t
    changes = [r for r in steps if r["fault"] == "membership"]
    assert [r["step"] for r in changes] == ["remove", "add"], detail
    for r in changes:
        # 404 (remove) and 409 member_exists (add) only after an attempt whose answer was lost.
        assert r["status"] in (200, 201) or (r["retries"] and r["status"] in (404, 409)), r
    # A removed node that keeps running answers 410 removed_from_cluster: no finding.
    assert result["findings"] == [], detail
    assert not leftover_nodes(tmp_path / "run")


def test_a_drill_whose_faults_could_not_run_is_not_safe(tmp_path: Path) -> None:
    """Partition faults need the ``ip`` and ``nft`` commands: with neither on the PATH the
    drill runs none of them, says which and why, exits 2 and its JSON's ``safe`` is false;
    ``--allow-skip`` accepts a drill that runs only some of its faults (exit 0, ``safe``
    still false for the one that did not run)."""
    bare = tmp_path / "bin"  # a PATH without ip and nft (the drill finds them with which)
    bare.mkdir()
    env = {**os.environ, "PATH": str(bare)}
    seed = random.randrange(1, 10**6)
    none = tmp_path / "none"
    proc = subprocess.run(
        drill_cmd(none, "partition-leader", 6, seed),
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
        env=env,
    )
    detail = f"seed {seed}\n{proc.stdout}\n{proc.stderr[-4000:]}"
    assert proc.returncode == 2, detail
    result = json.loads((none / "drill.json").read_text())
    assert result["faults_run"] == [] and result["safe"] is False, detail
    why = result["faults_not_run"]["partition-leader"]
    assert "partition faults need" in why, detail
    assert f"fault not run: partition-leader: {why}" in proc.stdout, detail
    assert "FAULTS NOT RUN" in proc.stderr and "partition-leader" in proc.stderr, detail
    assert not leftover_nodes(none / "run")

    some = tmp_path / "some"
    proc = subprocess.run(
        drill_cmd(some, "kill-leader,partition-leader", 8, seed, 3, "--allow-skip"),
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
        env=env,
    )
    detail = f"seed {seed}\n{proc.stdout}\n{proc.stderr[-4000:]}"
    assert proc.returncode == 0, detail
    result = json.loads((some / "drill.json").read_text())
    assert result["faults_run"] == ["kill-leader"] and result["lost"] == 0, detail
    assert list(result["faults_not_run"]) == ["partition-leader"], detail
    assert result["safe"] is False, detail
    assert "allowed by --allow-skip" in proc.stderr, detail
    assert not leftover_nodes(some / "run")


def test_grpc_drill_with_the_official_client_through_a_leader_kill(tmp_path: Path) -> None:
    """``--client grpc``: the official Producer sends plain, timer and delay-level messages,
    SimpleConsumers receive and ack them, one leader is killed. Nothing lost, acked twice,
    early or invented; the messages left unacked on purpose come back (redelivered)."""
    seed = random.randrange(1, 10**6)
    proc = subprocess.run(
        drill_cmd(tmp_path, "kill-leader", 25, seed, 3, "--client", "grpc"),
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    detail = f"seed {seed}\n{proc.stdout}\n{proc.stderr[-4000:]}"
    assert proc.returncode == 0, detail
    result = json.loads((tmp_path / "drill.json").read_text())
    for name in ("lost", "duplicated", "early", "unexpected", "cancelled_delivered"):
        assert result[name] == 0, f"{name}: {detail}"
    assert (result["client"], result["delivery"]) == ("grpc", "pop"), detail
    assert result["acknowledged"] > 300, detail
    assert result["unacked"] == 0, detail
    assert result["redelivered"] >= 1, detail
    assert result["replicas_converged"] is True and not result.get("aborted"), detail
    # 25 s leaves room for one or two kills (a slow machine may end the time before the second).
    assert result["faults_run"] in (["kill-leader"], ["kill-leader"] * 2), detail
    assert result["rto_s"]["kill-leader"]["n"] == len(result["faults_run"]), detail
    history = list(read_history(tmp_path / "run" / "history.jsonl"))
    kinds = {
        r["token"]: r["kind"] for r in history if r["op"] == "produce" and r["type"] == "invoke"
    }
    received = {r["token"] for r in history if r["op"] == "consume"}
    assert {kinds[t] for t in received} == {"plain", "level", "timer"}, detail
    assert any(r["op"] == "ack" and r["type"] == "ok" for r in history), detail
    assert not leftover_nodes(tmp_path / "run")


class RunningDrill:
    """A drill started in the background (with its stop signals blocked and ignored, see
    :func:`stop_signals_blocked_and_ignored`), its stderr read on a thread."""

    def __init__(
        self, tmp_path: Path, faults: str, duration: int, hold_phase: str, *extra: str
    ) -> None:
        self.tmp_path = tmp_path
        env = {**os.environ, HOLD_PHASE_ENV: hold_phase}
        self.proc = subprocess.Popen(
            drill_cmd(tmp_path, faults, duration, 1, 3, *extra),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            preexec_fn=stop_signals_blocked_and_ignored,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.put(line)
        self.lines.put(None)

    def _lines(self, timeout_s: float) -> Iterator[str]:
        """The stderr lines that come within ``timeout_s``, until the drill closes it."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                return
            if line is None:
                return
            yield line

    def wait_for(self, text: str, timeout_s: float) -> None:
        for line in self._lines(timeout_s):
            self.seen.append(line)
            if text in line:
                return
        self.proc.kill()
        raise AssertionError(f"no {text!r} from the drill:\n{''.join(self.seen)}")

    def finish(self, timeout_s: float) -> tuple[float, str, str]:
        """Wait for the drill to exit: the seconds it took, its stdout and its stderr."""
        started = time.monotonic()
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise
        took = time.monotonic() - started
        assert self.proc.stdout is not None
        out = self.proc.stdout.read()
        return took, out, "".join([*self.seen, *self._lines(5)])

    def assert_nothing_left(self, detail: str) -> None:
        assert not leftover_nodes(self.tmp_path / "run"), detail
        if netns.available()[0]:
            left = netns.Network(3, tag=str(self.proc.pid % 100000)).leftovers()
            assert not left, f"{left}\n{detail}"
        mounts = Path("/proc/mounts").read_text()
        assert str(self.tmp_path / "run") not in mounts, detail


def signal_another_thread(pid: int, sig: int) -> int:
    """Send ``sig`` to a thread of ``pid`` other than its main thread (one that does not block
    it), as the kernel may when it hands a process's signal to any of its threads; the
    thread's id."""
    for task in sorted(Path(f"/proc/{pid}/task").iterdir(), key=lambda d: int(d.name)):
        tid = int(task.name)
        if tid == pid:
            continue
        status = (task / "status").read_text()
        blocked = int(status.split("SigBlk:")[1].split()[0], 16)
        if not blocked & (1 << (sig - 1)):
            libc = ctypes.CDLL(None, use_errno=True)
            assert libc.tgkill(pid, tid, sig) == 0, os.strerror(ctypes.get_errno())
            return tid
    raise AssertionError(f"no thread of {pid} but its main one takes signal {sig}")


# (phase the drill is held in when the signal comes, the faults it runs, the signal, the
# client). "partition-leader held": the leader is cut off (root: namespaces and nftables);
# "kill-leader held": the leader is down; "healing": the killed leader is being started again;
# with the official gRPC client, its receives are pending when it is shut down.
INTERRUPTED_PHASES = [
    ("warm-up", "kill-leader", signal.SIGTERM, "http", "process"),
    ("partition-leader held", "partition-leader", signal.SIGINT, "http", "process"),
    ("kill-leader held", "kill-leader", signal.SIGINT, "http", "process"),
    ("healing", "kill-leader", signal.SIGINT, "http", "process"),
    ("draining", "kill-leader", signal.SIGINT, "http", "process"),
    ("draining", "kill-leader", signal.SIGINT, "grpc", "process"),
    ("checking", "kill-leader", signal.SIGINT, "http", "process"),
    # The kernel may hand a process's signal to any thread: while the event loop runs (the
    # loop's task is cancelled) and while the main thread sleeps outside it (it is asked to
    # raise KeyboardInterrupt).
    ("warm-up", "kill-leader", signal.SIGINT, "http", "another thread"),
    ("checking", "kill-leader", signal.SIGINT, "http", "another thread"),
]


@pytest.mark.parametrize(("phase", "faults", "sig", "client", "to"), INTERRUPTED_PHASES)
def test_ctrl_c_stops_the_drill_in_every_phase(
    tmp_path: Path, phase: str, faults: str, sig: signal.Signals, client: str, to: str
) -> None:
    """Ctrl-C (SIGTERM alike) in each phase: the drill exits 128 + the signal without needing
    its watchdog (which would exit 9 s after the signal), leaves no node, namespace, link or
    mount behind, and keeps the history and a partial report that names the phase."""
    if "partition" in faults and not netns.available()[0]:
        pytest.skip(netns.available()[1])
    drill = RunningDrill(tmp_path, faults, 8, phase, "--client", client)
    drill.wait_for(f"[drill] phase {phase}", 120)
    if to == "process":
        drill.proc.send_signal(sig)
    else:
        signal_another_thread(drill.proc.pid, sig)
    took, out, err = drill.finish(60)
    detail = f"exited {took:.1f} s after {sig.name}\n{out}\n{err[-4000:]}"
    assert drill.proc.returncode == 128 + sig, detail
    assert f"interrupted during {phase}" in err, detail
    assert "still stopping" not in err, detail
    assert "Traceback" not in err, detail
    drill.assert_nothing_left(detail)
    assert (tmp_path / "run" / "history.jsonl").exists(), detail
    assert f"interrupted during {phase}" in out, detail
    report = json.loads((tmp_path / "drill.json").read_text())
    assert report["interrupted"]["phase"] == phase, detail
    assert report["interrupted"]["signal"] == sig, detail
    # The report judged what the history held, except when the signal stopped the checker.
    assert report["interrupted"]["checked"] == (phase != "checking"), detail
    if phase not in ("warm-up", "checking"):
        assert report["produced"] > 0, detail


@pytest.mark.parametrize("to", ["process", "another thread"])
def test_a_second_ctrl_c_exits_at_once(tmp_path: Path, to: str) -> None:
    """A second Ctrl-C while the first one's clean-up runs (held there by the test) kills the
    nodes and removes the namespaces without waiting for it, and the drill exits 130; also
    when the kernel hands the signal to a thread other than the main one, which a Python
    handler alone did not see while the main thread slept (it exited 9 s later, by the
    watchdog)."""
    faults = "partition-leader" if netns.available()[0] else "kill-leader"
    drill = RunningDrill(tmp_path, faults, 8, "stopping")
    drill.wait_for(f"[drill] fault {faults}", 120)
    drill.proc.send_signal(signal.SIGINT)
    drill.wait_for("[drill] phase stopping", 30)
    if to == "process":
        drill.proc.send_signal(signal.SIGINT)
    else:
        signal_another_thread(drill.proc.pid, signal.SIGINT)
    took, out, err = drill.finish(60)
    detail = f"exited {took:.1f} s after the second Ctrl-C\n{out}\n{err[-4000:]}"
    assert drill.proc.returncode == 130, detail
    assert "interrupted again: nodes killed" in err, detail
    # The nodes were SIGKILLed without being waited for: give the kernel a moment to reap.
    deadline = time.monotonic() + 10
    while leftover_nodes(tmp_path / "run") and time.monotonic() < deadline:
        time.sleep(0.1)
    drill.assert_nothing_left(detail)
