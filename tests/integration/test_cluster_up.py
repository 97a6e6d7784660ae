"""`chronomq cluster up` (what `make run` runs), graceful SIGTERM, the bearer token on every
route but the probes, and secrets kept off command lines and out of readable files."""

from __future__ import annotations

import json
import os
import random
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
