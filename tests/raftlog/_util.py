"""Builders shared by the raftlog tests: records, commands, ports and deadlines."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from chronomq.raftlog import command as cmdcodec
from chronomq.raftlog import record
from chronomq.raftlog.config import RaftConfig, RaftPeer
from tests.ports import bindable, ephemeral_ports, worker_slice

STORE_MS = 1_700_000_000_000


def msg_id(n: int) -> bytes:
    return n.to_bytes(16, "big")


def rec(
    topic: str,
    queue_id: int,
    body: bytes,
    n: int = 0,
    *,
    tags_code: int = 0,
    properties: Mapping[str, str] | None = None,
) -> bytes:
    """One encoded record with a message id derived from ``n``."""
    return bytes(
        record.encode(
            topic=topic,
            queue_id=queue_id,
            msg_id=msg_id(n),
            body=body,
            properties=properties or {},
            born_ms=STORE_MS + n,
            store_ms=STORE_MS + n,
            tags_code=tags_code,
        )
    )


@dataclass
class B:
    """A batch to put in a command: messages as (topic, queue, body, id number)."""

    key: str
    messages: Sequence[tuple[str, int, bytes, int]] = ()
    expect: Mapping[str, cmdcodec.Scalar] | None = None
    updates: Mapping[str, cmdcodec.Scalar] | None = None
    creates: Mapping[str, int] | None = None
    tags_code: int = 0


def command(batches: Sequence[B], propose_ms: int = STORE_MS) -> bytes:
    """Encode an APPEND command the way the group committer does."""
    topics: list[str] = []
    index: dict[str, int] = {}
    metas: list[tuple[int, int, int]] = []
    parts: list[bytes] = []
    for b in batches:
        for topic, qid, body, n in b.messages:
            data = rec(topic, qid, body, n, tags_code=b.tags_code)
            i = index.setdefault(topic, len(topics))
            if i == len(topics):
                topics.append(topic)
            metas.append((i, qid, len(data)))
            parts.append(data)
    cmd = cmdcodec.Command(
        kind=cmdcodec.Kind.APPEND,
        propose_ms=propose_ms,
        batches=tuple(
            cmdcodec.Batch(b.key, len(b.messages), b.expect, b.updates, b.creates) for b in batches
        ),
        topics=tuple(topics),
        messages=tuple(metas),
        blob=b"".join(parts),
    )
    return cmdcodec.encode(cmd)


def barrier(propose_ms: int = STORE_MS) -> bytes:
    return cmdcodec.encode(cmdcodec.Command(cmdcodec.Kind.BARRIER, propose_ms))


def commitlog_bytes(directory: Path) -> bytes:
    """Every CommitLog segment file of ``directory``, in order, concatenated."""
    names = sorted(p for p in directory.iterdir() if p.name.isdigit())
    return b"".join(p.read_bytes() for p in names)


def tree_bytes(directory: Path) -> dict[str, bytes]:
    """Relative path -> contents of every file under ``directory``."""
    return {
        str(p.relative_to(directory)): p.read_bytes()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


UNIT_PORTS = range(61100, 65500)
"""Where in-process tests choose ports: above the kernel's default ephemeral range
(32768-60999) and apart from the integration tests' ranges (tests/integration/conftest.py)."""
_given: set[int] = set()


def free_port() -> int:
    """A port free now, in this pytest-xdist worker's share of :data:`UNIT_PORTS`, not given
    out before in this process.

    Not a port from ``bind(("127.0.0.1", 0))``: that one is in the ephemeral range, where any
    outgoing connection (the other worker's clusters make thousands) may take it before the
    node binds it; pysyncobj then retries the bind every second, silently, and the group has
    a member its peers cannot reach (in a fresh-clone run an in-process failover test waited
    20 s for a leader, and a loop of it beside drills took 67 s once)."""
    ports = worker_slice(UNIT_PORTS, 0)
    ephemeral = ephemeral_ports()
    # A kernel whose ephemeral range covers ours: any port of ours; all given out: again.
    for checking_ephemeral, forget in ((True, False), (False, False), (False, True)):
        if forget:
            _given.clear()
        for port in ports:
            if port in _given or (checking_ephemeral and port in ephemeral):
                continue
            if bindable(port):
                _given.add(port)
                return port
    raise RuntimeError(f"no free port left in {ports}")


def wait_until(
    condition: Callable[[], bool], timeout_s: float = 10.0, what: str = "condition"
) -> None:
    """Poll ``condition`` until it holds; fail with ``what`` when the deadline passes."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.005)


def segment_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if p.name.isdigit() and len(p.name) == 20)


def file_size(path: Path) -> int:
    return os.stat(path).st_size


def trio_configs(base: Path, **over: Any) -> list[RaftConfig]:
    """Configs of a three-node group on loopback, data under ``base/n<i>``, with elections
    fast enough for in-process tests."""
    raft = [f"127.0.0.1:{free_port()}" for _ in range(3)]
    fetch = [f"127.0.0.1:{free_port()}" for _ in range(3)]
    fields: dict[str, Any] = {
        "raft_min_timeout_ms": 400,
        "raft_max_timeout_ms": 800,
        "append_entries_period_ms": 20,
        "leader_lease_ms": 1_000,
        **over,
    }
    return [
        RaftConfig(
            data_dir=str(base / f"n{i}"),
            raft_address=raft[i],
            fetch_address=fetch[i],
            peers=tuple(RaftPeer(raft[j], fetch[j]) for j in range(3) if j != i),
            **fields,
        )
        for i in range(3)
    ]
