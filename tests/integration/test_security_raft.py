"""The Raft port of real nodes against strangers: pickles, admin commands, wrong secrets."""

from __future__ import annotations

import asyncio
import ipaddress
import os
import pickle
import socket
import struct
import subprocess
import sys
import zlib
from pathlib import Path
from typing import Any

import pytest

from chronomq.aio import Client
from chronomq.cluster.process.launcher import SECRET_FILE, LocalCluster
from chronomq.raftlog import wireproto
from chronomq.raftlog.wireproto import Handshake, HandshakeRefused, Role, Session
from tests.integration.conftest import wait_for

pytestmark = pytest.mark.integration


class _Touch:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def _raft(cluster: LocalCluster, i: int) -> tuple[str, int]:
    return "127.0.0.1", cluster.raft_port + i


def _pysyncobj_frame(obj: Any) -> bytes:
    """A message the way pysyncobj's own connection writes it (no password)."""
    p = zlib.compress(pickle.dumps(obj, 2))
    return struct.pack("i", len(p)) + p


def _closed_by_peer(sock: socket.socket) -> bool:
    """Read until the node closes the connection; True if it did (within the timeout)."""
    try:
        while sock.recv(65536):
            pass
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    return True


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError(f"closed after {len(data)} of {n} bytes")
        data += chunk
    return data


def _handshake(sock: socket.socket, secret: bytes) -> Session:
    """Our side of the handshake as a peer, blocking. Raises HandshakeRefused when the node's
    proof does not match ``secret`` (after sending ours, which the node judges too)."""
    side = Handshake(secret, Role.INITIATOR, os.urandom(32), 1 << 24)
    sock.sendall(side.hello())
    head = _recv_exact(sock, wireproto.HELLO_BYTES)
    size = wireproto.Hello.length(head)
    assert size is not None
    sock.sendall(side.on_hello(head + _recv_exact(sock, size - len(head))))
    return side.on_proof(_recv_exact(sock, wireproto.PROOF_BYTES))


def _secret(cluster: LocalCluster) -> bytes:
    return (cluster.data_dir / SECRET_FILE).read_text().strip().encode()


async def _log_has(cluster: LocalCluster, i: int, *needles: str) -> bool:
    text = (cluster.node_dir(i) / "node.log").read_text(errors="replace")
    return any(all(n in line for n in needles) for line in text.splitlines())


async def _serves(cluster: LocalCluster, topic: str) -> None:
    """Every node is up, answers /v1/admin/cluster with three members, and a message produced
    now is committed and read back from every node."""
    for i in range(cluster.n):
        assert cluster.alive(i), f"node {i} died"
    async with Client(cluster.urls, deadline_s=30) as client:
        sent = await client.send(topic, "still serving")
        for i in range(cluster.n):
            url = cluster.http_url(i)
            view = await client.cluster(url=url)  # raises unless 200
            assert [n["id"] for n in view["nodes"]] == [0, 1, 2], view

            async def arrived(url: str = url) -> bool:
                page = await client.pull(topic, sent["queue"], sent["offset"], url=url)
                return any(m["msg_id"] == sent["msg_id"] for m in page["messages"])

            await wait_for(arrived, 30, f"the message on node {i}", cluster)


def test_a_pickle_sent_to_the_raft_port_runs_nothing(make_cluster: Any, tmp_path: Path) -> None:
    cluster = make_cluster(3)
    cluster.wait_leader(60)
    marker = tmp_path / "pwned"
    for i in range(cluster.n):
        with socket.create_connection(_raft(cluster, i), timeout=10) as s:
            s.sendall(_pysyncobj_frame(_Touch(marker)))
            assert _closed_by_peer(s), f"node {i} kept the connection open"

    async def go() -> None:
        await _serves(cluster, "after-pickle")
        assert not marker.exists(), "the pickle ran in a node"
        for i in range(cluster.n):
            await wait_for(
                lambda i=i: _log_has(cluster, i, "refused Raft connection", "not a chronomq"),
                10,
                f"node {i} logging the refusal",
                cluster,
            )

    asyncio.run(go())


def test_pysyncobj_admin_remove_changes_no_membership(make_cluster: Any) -> None:
    cluster = make_cluster(3)
    leader = cluster.wait_leader(60)
    victim = f"127.0.0.1:{cluster.raft_port + (leader + 1) % 3}"
    leader_addr = f"127.0.0.1:{cluster.raft_port + leader}"
    # pysyncobj's own admin tool, in a process of its own (nothing of ours patched in).
    admin = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from pysyncobj.syncobj_admin import executeAdminCommand as run; "
            "print(run(sys.argv[1:]))",
            "-conn",
            leader_addr,
            "-remove",
            victim,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "SUCCESS" not in admin.stdout, admin.stdout
    # The same command from a peer that holds the secret: refused after the handshake.
    with socket.create_connection(_raft(cluster, leader), timeout=10) as sock:
        session = _handshake(sock, _secret(cluster))
        flags, payload = wireproto.encode_payload(["remove", victim])
        sock.sendall(wireproto.encode_frame(session, payload, flags))
        assert _closed_by_peer(sock)
    with socket.create_connection(_raft(cluster, leader), timeout=10) as raw:
        raw.sendall(_pysyncobj_frame(["remove", victim]))
        assert _closed_by_peer(raw)

    async def go() -> None:
        await wait_for(
            lambda: _log_has(cluster, leader, "refused Raft connection", "admin command 'remove'"),
            10,
            "the refusal of the authenticated remove",
            cluster,
        )
        # Committed after the attempts: a removal would be applied by now.
        await _serves(cluster, "after-remove")

    asyncio.run(go())


def test_a_peer_with_a_wrong_secret_is_refused_and_logged(make_cluster: Any) -> None:
    cluster = make_cluster(3)
    cluster.wait_leader(60)
    with socket.create_connection(_raft(cluster, 1), timeout=10) as sock:
        port = sock.getsockname()[1]
        with pytest.raises(HandshakeRefused, match="cluster secret"):
            _handshake(sock, b"a wrong secret of some length")
        assert _closed_by_peer(sock)

    async def go() -> None:
        await wait_for(
            lambda: _log_has(
                cluster, 1, f"refused Raft connection from 127.0.0.1:{port}", "cluster secret"
            ),
            10,
            "node 1 logging the wrong secret",
            cluster,
        )
        await _serves(cluster, "after-wrong-secret")

    asyncio.run(go())


def _listeners(port: int) -> list[str]:
    """Local addresses listening on ``port`` (from /proc/net/tcp and tcp6; not with
    socket.inet_ntop, which pysyncobj replaces)."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            next(f)
            for line in f:
                fields = line.split()
                local, state = fields[1], fields[3]
                host_hex, port_hex = local.rsplit(":", 1)
                if state == "0A" and int(port_hex, 16) == port:
                    raw = bytes.fromhex(host_hex)  # 32-bit words in host byte order
                    words = b"".join(raw[k : k + 4][::-1] for k in range(0, len(raw), 4))
                    found.append(str(ipaddress.ip_address(words)))
    return found


def test_raft_listens_on_raft_host_only(make_cluster: Any) -> None:
    cluster = make_cluster(3)
    cluster.wait_leader(60)
    for i in range(cluster.n):
        assert _listeners(cluster.raft_port + i) == ["127.0.0.1"], i
