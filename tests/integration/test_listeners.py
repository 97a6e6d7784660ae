"""Every listener of a node binds the address its config names, never all interfaces."""

from __future__ import annotations

import re
import shutil
import subprocess
from typing import Any

import pytest

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
