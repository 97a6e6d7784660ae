"""Every listener of a node binds the address its config names, never all interfaces."""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
from pathlib import Path
from typing import Any

import pytest

from chronomq.cluster.launcher import LocalCluster
from chronomq.cluster.server import RAFT_BIND_TIMEOUT_S
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


def test_a_node_whose_raft_port_is_taken_stops_and_says_why(tmp_path: Path) -> None:
    """pysyncobj retries a failed bind forever without a word: the node would serve HTTP
    while no peer can reach it, and never learn a leader. It exits (status 2) naming the
    address instead, as it does for a taken HTTP or gRPC port; the test clusters then start
    again on other ports."""
    clusters: list[LocalCluster] = []
    with socket.socket() as squatter:

        def build(http: int, raft: int, attempt: int) -> LocalCluster:
            if attempt == 0:  # someone takes node 2's Raft port first
                squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                squatter.bind(("127.0.0.1", raft + 2))
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
            raft = first.raft_port + 2
            assert f"cannot listen for Raft on 127.0.0.1:{raft}" in log
            assert "Address already in use" in log
            assert f"(tried for {RAFT_BIND_TIMEOUT_S:.0f} s)" in log
            cluster.wait_leader(60)
            cluster.wait_all_know_leader(30)
        finally:
            for c in clusters:
                c.stop()


def test_a_node_whose_catch_up_port_is_taken_stops_and_says_why(tmp_path: Path) -> None:
    """A taken catch-up port (Raft + 1000) stops the node with status 2, naming the address,
    as a taken Raft, HTTP or gRPC port does (it had exited 1 with asyncio's bare error); the
    test clusters then start again on other ports."""
    clusters: list[LocalCluster] = []
    with socket.socket() as squatter:

        def build(http: int, raft: int, attempt: int) -> LocalCluster:
            if attempt == 0:  # someone takes node 2's catch-up port first
                squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                squatter.bind(("127.0.0.1", raft + 1002))
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
            fetch = first.raft_port + 1002
            assert f"cannot listen for catch-up on 127.0.0.1:{fetch}" in log, log[-2000:]
            assert "Address already in use" in log
            cluster.wait_leader(60)
            cluster.wait_all_know_leader(30)
        finally:
            for c in clusters:
                c.stop()
