"""A local cluster asks its nodes how they are over HTTP; whatever else answers at a node's port
(a server of another protocol that took the port, nothing at all) reads as "no node there"."""

from __future__ import annotations

import socket
import threading
from pathlib import Path

from chronomq.cluster.process.launcher import LocalCluster

# What an HTTP/2 (gRPC) server sends first: a SETTINGS frame, which HTTP/1.1 cannot parse.
H2_SETTINGS = bytes.fromhex("000006040000000000000300000064")


def test_a_port_held_by_another_protocol_reads_as_no_node(tmp_path: Path) -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]

        def answer() -> None:
            conn, _ = server.accept()
            with conn:
                conn.recv(65536)
                conn.sendall(H2_SETTINGS)

        thread = threading.Thread(target=answer, daemon=True)
        thread.start()
        cluster = LocalCluster(1, tmp_path, http_port=port, raft_port=port + 1)
        assert cluster.node_status(0, timeout_s=5.0) is None
        thread.join(5)


def test_a_port_with_nothing_reads_as_no_node(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: connections are refused
        cluster = LocalCluster(1, tmp_path, http_port=port, raft_port=port + 1)
        assert cluster.node_status(0) is None
