"""Real multi-process clusters on loopback for integration tests."""

from __future__ import annotations

import asyncio
import random
import signal
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from chronomq.cluster.process.launcher import LocalCluster
from tests.conftest import node_logs, register_cluster
from tests.integration import spec_check
from tests.ports import bindable, ephemeral_ports, worker_slice

HTTP_PORTS = range(10000, 19000)
"""Where test clusters' HTTP ports (and their gRPC ports, HTTP + 100) are chosen."""
RAFT_PORTS = range(20000, 31000)
"""Where test clusters' Raft ports (and their catch-up ports, Raft + 1000) are chosen."""
_handed_out: set[int] = set()
"""Every port :func:`free_port_base` gave out in this process: a cluster whose node is down
leaves its ports free, and another cluster of the same test must not take them."""


def free_port_base(nodes: int, rng: random.Random) -> tuple[int, int]:
    """An HTTP base and a Raft base such that every port a cluster needs is free, in this
    test process's share of the ranges, and not given out before in this process.

    Ports lie outside the kernel's ephemeral range (32768-60999 by default) where it leaves
    room: a port in that range can be taken by some outgoing connection (a peer's, even)
    while a node is down or before it binds, and the node then cannot listen.
    """
    ephemeral = ephemeral_ports()
    https = worker_slice(HTTP_PORTS, 100 + nodes)
    rafts = worker_slice(RAFT_PORTS, 1000 + nodes)
    for attempt in range(400):
        http = rng.choice(https)
        raft = rng.choice(rafts)
        ports = (
            [http + i for i in range(nodes)]
            + [http + 100 + i for i in range(nodes)]  # gRPC: HTTP + 100 by default
            + [raft + i for i in range(nodes)]
            + [raft + 1000 + i for i in range(nodes)]
        )
        if attempt < 200 and any(p in ephemeral or p in _handed_out for p in ports):
            continue  # the kernel's range covers these, or a cluster here had them: others first
        if all(bindable(p) for p in ports):
            _handed_out.update(ports)
            return http, raft
    raise RuntimeError("no free port range found")


PORT_ATTEMPTS = 3
"""Port ranges a test cluster tries when one of its ports was taken before a node bound it."""


def _port_taken(cluster: LocalCluster, timeout_s: float = 60.0) -> int | None:
    """Wait until every started node answers; the node that exited instead because one of its
    ports was taken (status 2, "cannot listen" in its log), if one did. Another machine's
    process (CI runners are shared) can take a port between the check and the bind."""
    deadline = time.monotonic() + timeout_s
    waiting = set(cluster.procs)
    while waiting and time.monotonic() < deadline:
        for i in sorted(waiting):
            p = cluster.procs[i]
            if p.poll() is not None:
                text = (cluster.node_dir(i) / "node.log").read_text(errors="replace")
                if p.returncode == 2 and "cannot listen" in text:
                    return i
                waiting.discard(i)  # exited for another reason: the test will say so
            elif cluster.node_status(i, timeout_s=1.0) is not None:
                waiting.discard(i)
        time.sleep(0.05)
    return None


def start_on_free_ports(build: Callable[[int, int, int], LocalCluster], nodes: int) -> LocalCluster:
    """``build(http_port, raft_port, attempt)`` a cluster on free ports and start it; on a port
    taken meanwhile, stop it and start another on other ports."""
    rng = random.Random()
    for attempt in range(PORT_ATTEMPTS):
        http, raft = free_port_base(nodes, rng)
        c = build(http, raft, attempt)
        c.start()
        taken = _port_taken(c)
        if taken is None or attempt == PORT_ATTEMPTS - 1:
            return c
        print(f"node {taken}'s port was taken before it listened; trying other ports")
        c.stop()
    raise AssertionError("unreachable")


class StartedClusters:
    """The clusters one test starts (stopped after it, their logs in its failure report)."""

    def __init__(self, tmp_path: Path, item: pytest.Item) -> None:
        self.tmp_path = tmp_path
        self.item = item
        self.started: list[LocalCluster] = []

    def start(
        self, name: str, nodes: int, settings: dict[str, Any], initial: int | None = None
    ) -> LocalCluster:
        def build(http: int, raft: int, attempt: int) -> LocalCluster:
            c = LocalCluster(
                nodes,
                self.tmp_path / (name if attempt == 0 else f"{name}-{attempt}"),
                http_port=http,
                raft_port=raft,
                settings=settings,
                initial=initial,
            )
            self.started.append(c)
            register_cluster(self.item, c)
            return c

        return start_on_free_ports(build, nodes)

    def stop(self) -> None:
        for c in self.started:
            c.stop()


@pytest.fixture
def make_cluster(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Any]:
    clusters = StartedClusters(tmp_path, request.node)
    made = 0

    def make(nodes: int = 3, **settings: Any) -> LocalCluster:
        nonlocal made
        made += 1
        return clusters.start(f"cluster-{made - 1}", nodes, settings)

    yield make
    clusters.stop()


def dump_logs(cluster: LocalCluster) -> str:
    return node_logs(cluster, 30)


@pytest.fixture
def make_joinable_cluster(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Any]:
    """A cluster of ``initial`` running nodes plus nodes configured to join it later."""
    clusters = StartedClusters(tmp_path, request.node)

    def make(nodes: int, initial: int, **settings: Any) -> LocalCluster:
        return clusters.start("joinable", nodes, settings, initial)

    yield make
    clusters.stop()


async def wait_for(
    predicate: Callable[[], Awaitable[Any]],
    timeout_s: float,
    what: str,
    cluster: LocalCluster | None = None,
) -> Any:
    """Await ``predicate`` every 50 ms until it returns something truthy, and return that;
    fail naming ``what`` (with the nodes' last log lines when ``cluster`` is given)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = await predicate()
        if value:
            return value
        await asyncio.sleep(0.05)
    logs = f"\n{dump_logs(cluster)}" if cluster is not None else ""
    raise AssertionError(f"{what} not within {timeout_s} s{logs}")


async def pull_applied(
    client: Any, topic: str, queue: int, offset: int, max_messages: int, **kw: Any
) -> list[dict[str, Any]]:
    """The messages a pull returns, or none while the node asked (any node: a follower) has
    not applied the topic's creation yet (404 ``unknown_topic``): for ``wait_for`` loops that
    read right after a write created the topic."""
    from chronomq.errors import ApiError

    try:
        page = await client.pull(topic, queue, offset, max_messages, **kw)
    except ApiError as exc:
        if exc.status == 404:
            return []
        raise
    return list(page["messages"])


@pytest.fixture(autouse=True)
def answers_fit_the_spec() -> Iterator[None]:
    """Every JSON answer a test receives through aiohttp fits /openapi.json (see spec_check)."""
    with spec_check.watch() as found:
        yield
    assert not found, "answers outside /openapi.json:\n" + "\n".join(sorted(set(found))[:20])


def stop_signals_blocked_and_ignored() -> None:
    """A ``preexec_fn``: the child begins with SIGINT and SIGTERM blocked and SIGINT ignored,
    as a process started in the background by a CI runner may (a drill started so ran on
    through every Ctrl-C: the signal stayed pending). Commands that stop on Ctrl-C must take
    their signals back."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    signal.signal(signal.SIGINT, signal.SIG_IGN)
