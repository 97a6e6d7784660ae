"""A node of another Raft wire version among 3 real nodes: it says so at ERROR with both
versions (and so do the others), and the cluster view and `chronomq status` show each node's
version.

The odd node is this build advertising another wire version (``CHRONOMQ_TEST_WIRE_VERSION``,
read by ``raftlog/transport.py`` for tests only). A real build of another version cannot be
used here: the test environment holds one installed chronomq, a second one (an older tag) would
need its own virtual environment and a package index to build it, and an old build would not
say anything new anyway: what is tested is what *this* build does when its peers' version
differs, on both sides of the handshake.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from chronomq.cluster.process.launcher import LocalCluster
from chronomq.raftlog import wireproto
from chronomq.raftlog.transport import TEST_WIRE_VERSION_ENV
from chronomq.version import VERSION
from tests.conftest import register_cluster
from tests.integration.conftest import start_on_free_ports

pytestmark = pytest.mark.integration

OTHER_WIRE = wireproto.VERSION + 1


def _log(cluster: LocalCluster, i: int) -> str:
    return (cluster.node_dir(i) / "node.log").read_text(errors="replace")


def _error_lines(cluster: LocalCluster, i: int) -> list[str]:
    out = []
    for line in _log(cluster, i).splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("level") == "error" and "cannot talk to Raft peer" in record.get("msg", ""):
            out.append(record["msg"])
    return out


def test_a_node_of_another_wire_version_says_so_and_the_view_shows_versions(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    def build(http: int, raft: int, attempt: int) -> LocalCluster:
        c = LocalCluster(
            3,
            tmp_path / f"mixed-{attempt}",
            http_port=http,
            raft_port=raft,
            node_env={2: {TEST_WIRE_VERSION_ENV: str(OTHER_WIRE)}},
        )
        register_cluster(request.node, c)
        return c

    cluster = start_on_free_ports(build, 3)
    try:
        leader = cluster.wait_leader(60, among=[0, 1])
        assert leader in (0, 1)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not all(_error_lines(cluster, i) for i in range(3)):
            time.sleep(0.1)
        for i in range(3):
            lines = _error_lines(cluster, i)
            assert lines, f"node {i} logged no version ERROR:\n{_log(cluster, i)[-3000:]}"
            line = lines[0]
            assert f"wire version {wireproto.VERSION}" in line, line
            assert f"wire version {OTHER_WIRE}" in line, line
            assert f"chronomq {VERSION}" in line, line
            assert "upgrade every node" in line, line
        # Said once per peer and version within a minute, however often it reconnects.
        assert len(_error_lines(cluster, 2)) <= 2

        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "chronomq.cluster",
                "status",
                "--json",
                "--url",
                cluster.http_url(leader),
            ],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert done.returncode == 0, done.stderr
        view: dict[str, Any] = json.loads(done.stdout)
        wires = {n["id"]: n.get("wire_version") for n in view["nodes"]}
        assert wires == {0: wireproto.VERSION, 1: wireproto.VERSION, 2: OTHER_WIRE}, view
        assert {n.get("version") for n in view["nodes"]} == {VERSION}
        me = next(n for n in view["nodes"] if n["id"] == leader)
        odd = me["peer_versions"].get(f"127.0.0.1:{cluster.raft_port + 2}")
        if odd is not None:  # a peer heard on an incoming connection has no address
            assert odd == {"version": VERSION, "wire_version": OTHER_WIRE, "compatible": False}

        table = subprocess.run(
            [sys.executable, "-m", "chronomq.cluster", "status", "--url", cluster.http_url(0)],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert table.returncode == 0, table.stderr
        assert "different Raft wire versions" in table.stdout, table.stdout
        assert f"{VERSION}/w{OTHER_WIRE}" in table.stdout, table.stdout
    finally:
        cluster.stop()
