"""Choosing loopback ports for test nodes: outside the kernel's ephemeral range where it leaves
room, and in this pytest-xdist worker's share (tests/integration/conftest.py for clusters of
node processes, tests/raftlog/_util.py for in-process Raft groups)."""

from __future__ import annotations

import os
import socket
from pathlib import Path


def bindable(port: int) -> bool:
    """True when ``127.0.0.1:port`` can be bound now."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def ephemeral_ports() -> range:
    """The kernel's ephemeral range (outgoing connections take their local port from it)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return range(int(low), int(high) + 1)
    except (OSError, ValueError):
        return range(32768, 61000)


def worker_slice(ports: range, reach: int) -> range:
    """The bases this pytest-xdist worker chooses from, so that no port a base reaches (up to
    ``base + reach``) lies in another worker's share. Without it, one worker's cluster took a
    Raft port that was another's catch-up port while that node was down (a power cut), and
    the node could not listen again when it restarted."""
    name = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1))
    index = int(name[2:]) % count if name.startswith("gw") and name[2:].isdigit() else 0
    share = len(ports) // count
    low = ports.start + index * share
    return range(low, low + share - reach)
