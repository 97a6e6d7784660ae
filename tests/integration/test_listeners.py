"""Every listener of a node binds the address its config names, never all interfaces."""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from chronomq.cluster.process.launcher import LocalCluster
from chronomq.cluster.process.server import RAFT_BIND_TIMEOUT_S
from tests.integration.conftest import start_on_free_ports

pytestmark = pytest.mark.integration


def _listening(pid: int) -> set[str]:
    """``host:port`` of every listening TCP socket of process ``pid``."""
    out = subprocess.run(
        ["ss", "-H", "-l", "-t", "-n", "-p"], capture_output=True, text=True, check=True
    ).stdout
    found = set()
    for line in out.splitlines():
        if re.search(rf"pid={pid},", line):
            # grpcio binds an IPv4 address on a dual-stack socket: [::ffff:127.0.0.1]:port is
            # 127.0.0.1:port, reachable through that address only.
            found.add(re.sub(r"^\[::ffff:([0-9.]+)\]", r"\1", line.split()[3]))
    return found


@pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss (iproute2)")
def test_every_listener_binds_the_configured_host(make_cluster: Any) -> None:
    cluster = make_cluster(3)
    cluster.wait_leader(60)
    for i in range(cluster.n):
        expected = {
            f"127.0.0.1:{cluster.http_port + i}",
            f"127.0.0.1:{cluster.raft_port + i}",
            f"127.0.0.1:{cluster.raft_port + i + 1000}",
            cluster.grpc_address(i),
        }
        assert _listening(cluster.procs[i].pid) == expected, f"node {i}"


# (the setting, node 2's port of it from the HTTP and Raft bases, and what node 2 then logs).
# pysyncobj retries a failed Raft bind forever without a word: the node would serve HTTP while
# no peer can reach it, and never learn a leader. A taken catch-up port (Raft + 1000) exited 1
# with asyncio's bare error. Each error names the address and the setting that gives it.
TAKEN_PORTS: list[tuple[str, Callable[[int, int], int], str]] = [
    ("raft_port", lambda http, raft: raft + 2, "cannot listen for Raft on 127.0.0.1:{port}"),
    (
        "fetch_port",
        lambda http, raft: raft + 1002,
        "cannot listen for catch-up on 127.0.0.1:{port}",
    ),
    ("http_port", lambda http, raft: http + 2, "cannot listen for HTTP on 127.0.0.1:{port}"),
    ("grpc_port", lambda http, raft: http + 102, "cannot listen on 127.0.0.1:{port}"),
]


@pytest.mark.parametrize(
    ("setting", "port_of", "said"), TAKEN_PORTS, ids=[t[0] for t in TAKEN_PORTS]
)
def test_a_node_whose_port_is_taken_stops_and_says_why(
    tmp_path: Path, setting: str, port_of: Callable[[int, int], int], said: str
) -> None:
    """A node whose Raft, catch-up, HTTP or gRPC port is taken exits (status 2) naming the
    address and the setting; the test clusters then start again on other ports."""
    clusters: list[LocalCluster] = []
    with socket.socket() as squatter:

        def build(http: int, raft: int, attempt: int) -> LocalCluster:
            if attempt == 0:  # someone takes node 2's port first
                squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                squatter.bind(("127.0.0.1", port_of(http, raft)))
                squatter.listen()
            c = LocalCluster(3, tmp_path / f"c{attempt}", http_port=http, raft_port=raft)
            clusters.append(c)
            return c

        try:
            cluster = start_on_free_ports(build, 3)
            first = clusters[0]
            assert len(clusters) == 2 and cluster is clusters[1]
            assert first.procs[2].returncode == 2
            log = (first.node_dir(2) / "node.log").read_text()
            port = port_of(first.http_port, first.raft_port)
            assert said.format(port=port) in log, log[-2000:]
            assert f"{setting} ({port})" in log, log[-2000:]
            if setting != "grpc_port":  # grpcio says only that it could not bind
                assert "Address already in use" in log, log[-2000:]
            if setting == "raft_port":
                assert f"(tried for {RAFT_BIND_TIMEOUT_S:.0f} s)" in log
            cluster.wait_leader(60)
            cluster.wait_all_know_leader(30)
        finally:
            for c in clusters:
                c.stop()
