"""The catch-up port under attack, with 3 real node processes on loopback.

Each node's catch-up port (Raft port + 1000) is reachable by anyone: hostile bytes run
nothing and get no CommitLog byte, a peer without the cluster secret is refused and logged,
and connections that hog the port do not stop a wiped follower from fetching what it needs.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import pickle
import shutil
import socket
import struct
import threading
import time
import zlib
from pathlib import Path
from typing import Any

import pytest

from chronomq.aio import Client
from chronomq.cluster.process.launcher import SECRET_FILE, LocalCluster
from chronomq.raftlog import catchup
from chronomq.raftlog import catchup_proto as proto
from tests.integration.conftest import dump_logs
from tests.integration.test_replicated_log import QUEUES, TOPIC, check_exactly_once

pytestmark = pytest.mark.integration

BODY_BYTES = 1000


class _Marker:
    """Unpickled, it would create a file: proof that something ran."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return (open, (self.path, "w"))


def _catchup_port(cluster: LocalCluster, i: int) -> tuple[str, int]:
    return ("127.0.0.1", cluster.raft_port + i + 1000)


def _secret(cluster: LocalCluster) -> bytes:
    return (cluster.data_dir / SECRET_FILE).read_text().strip().encode()


def _exchange(address: tuple[str, int], payload: bytes) -> bytes:
    """Send ``payload``, then read everything until the server closes (at most 10 s)."""
    out = b""
    with socket.create_connection(address, timeout=10) as sock:
        sock.sendall(payload)
        # The server may already have refused and closed (ENOTCONN): that is an answer too.
        try:
            sock.shutdown(socket.SHUT_WR)
        except OSError as exc:
            if exc.errno != errno.ENOTCONN:
                raise
            return out
        with contextlib.suppress(ConnectionResetError):
            while chunk := sock.recv(1 << 16):
                out += chunk
    return out


async def _produce(cluster: LocalCluster, n: int, batch: int, prefix: str) -> dict[str, int]:
    """``n`` messages of ``BODY_BYTES`` in batches of ``batch`` (one Raft command each)."""
    acked: dict[str, int] = {}
    async with Client(cluster.urls, deadline_s=60) as client:
        with contextlib.suppress(Exception):  # exists already
            await client.create_topic(TOPIC, QUEUES)
        for start in range(0, n, batch):
            body = f"{prefix}-{start}-".ljust(BODY_BYTES, "x")
            msgs = [{"body": body} for _ in range(batch)]
            result = await client.produce(TOPIC, msgs, idempotency_key=f"{prefix}-{start}")
            for r in result["results"]:
                acked[r["msg_id"]] = acked.get(r["msg_id"], 0) + 1
    return acked


def _log_text(cluster: LocalCluster, i: int) -> str:
    return (cluster.node_dir(i) / "node.log").read_text(errors="replace")


def _wait(condition: Any, timeout_s: float, what: str, cluster: LocalCluster) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not within {timeout_s} s\n{dump_logs(cluster)}")
        time.sleep(0.05)


def test_hostile_bytes_run_nothing_and_get_no_commitlog_byte(
    make_cluster: Any, tmp_path: Path
) -> None:
    cluster = make_cluster(3)
    cluster.wait_leader(60)
    acked = asyncio.run(_produce(cluster, 200, 20, "before"))
    marker = tmp_path / "unpickled"
    blob = zlib.compress(pickle.dumps(_Marker(str(marker))))
    payloads = {
        "pickle": struct.pack(">I", len(blob)) + blob,
        "raw fetch": struct.pack(">8sQQ", b"CMQFETCH", 0, 1 << 30),
        "hello then forged request": proto.encode_hello(bytes(16))
        + struct.pack(">8sQQ32s", proto.REQUEST_MAGIC, 0, 1 << 30, bytes(32)),
    }
    for i in range(3):
        for name, payload in payloads.items():
            answer = _exchange(_catchup_port(cluster, i), payload)
            # A refusal, after at most the server's challenge: no CommitLog byte.
            assert answer in (b"", proto.DENIED) or (
                answer[:8] == proto.CHALLENGE_MAGIC and answer[24:] == proto.DENIED
            ), (i, name, answer[:64])
            assert b"before-" not in answer
    assert not marker.exists()
    # Every node is up and serving: the cluster takes writes and converges.
    assert all(cluster.alive(i) for i in range(3))
    acked |= asyncio.run(_produce(cluster, 200, 20, "after"))
    cluster.wait_converged(60)
    asyncio.run(check_exactly_once(cluster, acked, [0, 1, 2]))
    for i in range(3):
        _wait(
            lambda i=i: "refused catch-up connection from 127.0.0.1" in _log_text(cluster, i),
            10,
            f"node {i} to log a refusal",
            cluster,
        )


def test_a_peer_with_the_wrong_secret_is_refused_and_logged(make_cluster: Any) -> None:
    cluster = make_cluster(3)
    cluster.wait_leader(60)
    asyncio.run(_produce(cluster, 100, 20, "m"))
    length = int(cluster.wait_converged(60)["length"])
    address = _catchup_port(cluster, 1)
    with pytest.raises(proto.Refused):
        catchup.fetch_from(
            address,
            0,
            length,
            lambda at, data: pytest.fail("the node sent CommitLog bytes"),
            secret=b"not the cluster secret, but long enough",
        )
    _wait(
        lambda: (
            "MAC does not verify" in _log_text(cluster, 1)
            and "refused catch-up connection from 127.0.0.1" in _log_text(cluster, 1)
        ),
        10,
        "node 1 to log the refusal",
        cluster,
    )
    # With the cluster's secret the same request is served.
    got = catchup.fetch_bytes(address, 0, length, secret=_secret(cluster))
    assert len(got) == length


class _Hog:
    """Holds up to ``per_port`` connections to each port, sending one byte of a hello every
    ``drip_s`` and never finishing a handshake; reopens whatever the server closes."""

    def __init__(self, ports: list[tuple[str, int]], per_port: int, drip_s: float = 2.0):
        self._ports = ports
        self._per_port = per_port
        self._drip_s = drip_s
        self._stop = threading.Event()
        self.opened = 0
        self._thread = threading.Thread(target=self._run, name="hog", daemon=True)

    def __enter__(self) -> _Hog:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        conns: dict[tuple[str, int], list[tuple[socket.socket, int]]] = {p: [] for p in self._ports}
        hello = proto.encode_hello(bytes(16))
        last_drip = time.monotonic()
        try:
            while not self._stop.is_set():
                for port, held in conns.items():
                    while len(held) < self._per_port and not self._stop.is_set():
                        try:
                            s = socket.create_connection(port, timeout=1)
                        except OSError:
                            break
                        s.setblocking(False)
                        held.append((s, 0))
                        self.opened += 1
                drip = time.monotonic() - last_drip >= self._drip_s
                if drip:
                    last_drip = time.monotonic()
                for port, held in conns.items():
                    alive = []
                    for s, sent in held:
                        try:
                            if s.recv(1 << 16) == b"":  # closed by the server
                                s.close()
                                continue
                        except BlockingIOError:
                            pass
                        except OSError:
                            s.close()
                            continue
                        if drip and sent < len(hello) - 1:
                            try:
                                s.send(hello[sent : sent + 1])
                                sent += 1
                            except OSError:
                                s.close()
                                continue
                        alive.append((s, sent))
                    conns[port] = alive
                self._stop.wait(0.1)
        finally:
            for held in conns.values():
                for s, _ in held:
                    s.close()


def test_connections_hogging_every_port_do_not_stop_a_wiped_follower(
    make_cluster: Any,
) -> None:
    cluster = make_cluster(3, log_compaction_min_entries=20)
    leader = cluster.wait_leader(60)
    follower = next(i for i in range(3) if i != leader)
    ports = [_catchup_port(cluster, i) for i in range(3)]
    try:
        acked = asyncio.run(_produce(cluster, 4000, 20, "a"))  # ~4 MB in 200 commands
        cluster.wait_converged(120)
        cluster.kill(follower)
        shutil.rmtree(cluster.node_dir(follower) / "data")
        acked |= asyncio.run(_produce(cluster, 1000, 20, "b"))
        with _Hog(ports, per_port=48) as hog:
            _wait(lambda: hog.opened >= 3 * 48, 30, "the hog to hold every port", cluster)
            cluster.start(follower)
            digest = cluster.wait_converged(180)
            assert int(digest["length"]) > 4_000_000
            assert hog.opened > 3 * 48  # the servers kept dropping its connections
        text = _log_text(cluster, follower)
        assert "fetched CommitLog [0," in text  # it restored a thin snapshot and fetched
        asyncio.run(check_exactly_once(cluster, acked, [follower]))
        assert all(cluster.alive(i) for i in range(3))
    except Exception:
        print(dump_logs(cluster))
        raise
