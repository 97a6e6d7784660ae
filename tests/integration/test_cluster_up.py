"""`chronomq cluster up` (what `make run` runs), graceful SIGTERM, the bearer token on every
route but the probes, and secrets kept off command lines and out of readable files."""

from __future__ import annotations

import json
import os
import random
import select
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.integration.conftest import free_port_base, stop_signals_blocked_and_ignored
from tests.ports import bindable

pytestmark = pytest.mark.integration


TOKEN = "s3cret-token-for-cluster-up"


def get(url: str, timeout_s: float = 2.0, token: str | None = None) -> tuple[int, Any]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        req = urllib.request.Request(url, headers=headers)
        with urllib.request.urlopen(req, timeout=timeout_s) as r:  # noqa: S310 - loopback
            raw = r.read()
            return r.status, json.loads(raw) if raw.startswith((b"{", b"[")) else raw.decode()
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def post(url: str, body: Any, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    req = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    try:
        with urllib.request.urlopen(req, timeout=15) as r:  # noqa: S310 - loopback
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_cluster_up_prints_urls_and_ready_then_stops_cleanly(tmp_path: Path) -> None:
    http, raft = free_port_base(3, random.Random())
    cmd = [
        sys.executable,
        "-m",
        "chronomq",
        "cluster",
        "up",
        "--nodes",
        "3",
        "--http-port",
        str(http),
        "--raft-port",
        str(raft),
        "--data-dir",
        str(tmp_path / "var"),
    ]
    env = {**os.environ, "CHRONOMQ_AUTH_TOKEN": TOKEN}
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        preexec_fn=stop_signals_blocked_and_ignored,
    )
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line.rstrip())
            if line.startswith("ready"):
                break
        assert any(line.startswith("ready") for line in lines), lines
        urls = [f"http://127.0.0.1:{http + i}" for i in range(3)]
        for i, url in enumerate(urls):
            assert any(line.startswith(f"node {i}") and url in line for line in lines), lines
        for url in urls:
            for path in ("/healthz", "/readyz"):
                status, _ = get(url + path)
                assert status == 200, (url, path)
            # Every other route needs the token, reads included.
            for path in ("/v1/admin/node", "/v1/admin/cluster", "/metrics", "/openapi.json"):
                status, body = get(url + path)
                assert status == 401 and body["field"] == "Authorization", (url, path, body)
                status, _ = get(url + path, token=TOKEN)
                assert status == 200, (url, path)
        status, body = post(urls[1] + "/v1/topics/t/messages", {"messages": [{"body": "x"}]})
        assert status == 401 and body["error"] == "unauthorized"
        # Through a follower: it forwards to the leader with its own token.
        status, body = post(
            urls[1] + "/v1/topics/t/messages",
            {"messages": [{"body": "x"}]},
            {"Authorization": f"Bearer {TOKEN}"},
        )
        assert status == 200, body
        status, _ = get(urls[2] + "/v1/topics/t/queues/0/messages")
        assert status == 401
        status, cfg = get(urls[0] + "/v1/admin/config", token=TOKEN)
        assert status == 200 and cfg["config"]["auth_token"] == "***"
        _check_secrets_stay_private(proc.pid, tmp_path / "var")
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            rc = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert rc == 0
    for i in range(3):
        log = (tmp_path / "var" / f"node-{i}" / "node.log").read_text()
        assert '"msg":"stopped"' in log, f"node {i} did not stop gracefully"


def _check_secrets_stay_private(up_pid: int, data_dir: Path) -> None:
    """No secret on a command line `ps` shows; the files holding one are 0600."""
    secret = (data_dir / "cluster.secret").read_text().strip()
    assert len(secret) >= 16
    out = subprocess.run(
        ["ps", "-o", "args=", "--ppid", str(up_pid)], capture_output=True, text=True, check=True
    ).stdout
    nodes = [line for line in out.splitlines() if " node --config " in line]
    assert len(nodes) == 3, out
    own = subprocess.run(
        ["ps", "-o", "args=", "-p", str(up_pid)], capture_output=True, text=True, check=True
    ).stdout
    for line in [*nodes, own]:
        assert TOKEN not in line and secret not in line, line
    private = [data_dir / "cluster.secret"] + [
        data_dir / f"node-{i}" / "node.toml" for i in range(3)
    ]
    for path in private:
        assert path.stat().st_mode & 0o777 == 0o600, (path, oct(path.stat().st_mode))


def _up(tmp_path: Path, *ports: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "chronomq",
        "cluster",
        "up",
        "--nodes",
        "3",
        *ports,
        "--data-dir",
        str(tmp_path / "var"),
    ]


def _node_pid(config: Path) -> int:
    """The pid of the node process started with ``config`` (found in /proc)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            args = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if str(config).encode() in args:
            return int(entry.name)
    raise AssertionError(f"no process runs {config}")


def test_clashing_ports_are_refused_before_anything_starts(tmp_path: Path) -> None:
    """Given ports that clash (gRPC on the Raft ports; HTTP and Raft blocks overlapping) are
    refused naming both settings, by ``cluster up`` and by a benchmark that starts its own
    cluster, with no node started and no traceback."""
    http, raft = free_port_base(3, random.Random())
    cases = [
        (
            _up(
                tmp_path,
                "--http-port",
                str(http),
                "--raft-port",
                str(raft),
                "--grpc-port",
                str(raft),
            ),
            "chronomq cluster up",
            ("grpc_port", "raft_port"),
        ),
        (
            _up(tmp_path, "--http-port", str(http), "--raft-port", str(http + 2)),
            "chronomq cluster up",
            ("raft_port", "http_port"),
        ),
        (
            [
                sys.executable,
                "-m",
                "chronomq",
                "bench",
                "produce",
                "--http",
                "--nodes",
                "3",
                "--http-port",
                str(http),
                "--raft-port",
                str(http + 1),
                "--messages",
                "10",
                "--data-dir",
                str(tmp_path / "bench"),
            ],
            "chronomq bench produce",
            ("raft_port", "http_port"),
        ),
    ]
    for cmd, who, settings in cases:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
        out = done.stdout + done.stderr
        assert done.returncode == 2, out
        assert "Traceback" not in out, out
        assert f"{who}: bad configuration:" in done.stderr, out
        first, second = settings
        assert done.stderr.index(first) < done.stderr.index(second), out
    assert not list(tmp_path.rglob("node.log"))


def test_derived_ports_never_clash_and_a_killed_node_is_named(tmp_path: Path) -> None:
    """``--raft-port`` at ``--http-port + 100``, where gRPC's default used to be: the gRPC
    ports move on instead of clashing, the cluster comes up; a node then killed with SIGKILL
    (as the out-of-memory killer does) is reported by name of the signal."""
    rng = random.Random()
    for _ in range(50):
        http, _ = free_port_base(3, rng)
        ports = [http + k + i for k in (0, 100, 200, 1100) for i in range(3)]
        if all(bindable(p) for p in ports):
            break
    else:
        raise AssertionError("no free ports for the cluster")
    proc = subprocess.Popen(
        _up(tmp_path, "--http-port", str(http), "--raft-port", str(http + 100)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=stop_signals_blocked_and_ignored,
    )
    try:
        assert proc.stdout is not None and proc.stderr is not None
        lines: list[str] = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line.rstrip())
            if line.startswith("ready"):
                break
        assert any(line.startswith("ready") for line in lines), (lines, proc.stderr.read())
        assert f"grpc 127.0.0.1:{http + 200}" in lines[0], lines
        os.kill(_node_pid(tmp_path / "var" / "node-1" / "node.toml"), signal.SIGKILL)
        ready, _, _ = select.select([proc.stderr], [], [], 30)
        assert ready, "cluster up said nothing of the killed node within 30 s"
        said = proc.stderr.readline()
        assert said.startswith("chronomq cluster up: node 1 was killed by SIGKILL"), said
        assert "out-of-memory" in said and "node-1/node.log" in said, said
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
