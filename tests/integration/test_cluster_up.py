"""`chronomq cluster up` (what `make run` runs), graceful SIGTERM and the bearer token."""

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

from tests.integration.conftest import free_port_base

pytestmark = pytest.mark.integration


def get(url: str, timeout_s: float = 2.0) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:  # noqa: S310 - loopback
            raw = r.read()
            return r.status, json.loads(raw) if raw.startswith((b"{", b"[")) else raw.decode()
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def post(url: str, body: Any, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), method="POST", headers=headers or {}
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
        "cluster",
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
    env = {**os.environ, "CHRONOMQ_AUTH_TOKEN": "s3cret"}
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
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
            for path in (
                "/healthz",
                "/readyz",
                "/v1/admin/node",
                "/v1/admin/cluster",
                "/metrics",
                "/openapi.json",
            ):
                status, _ = get(url + path)
                assert status == 200, (url, path)
        # Writes need the token; reads do not.
        status, body = post(urls[1] + "/v1/topics/t/messages", {"messages": [{"body": "x"}]})
        assert status == 401 and body["error"] == "unauthorized"
        status, body = post(
            urls[1] + "/v1/topics/t/messages",
            {"messages": [{"body": "x"}]},
            {"Authorization": "Bearer s3cret"},
        )
        assert status == 200, body
        status, cfg = get(urls[0] + "/v1/admin/config")
        assert status == 401
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
