"""The node's file-descriptor budget: raise the soft open-file limit, then share it out.

At start a node raises its soft ``RLIMIT_NOFILE`` to the hard limit (:func:`raise_soft_limit`,
the one place that touches it) and divides what it got (:func:`plan`)::

    +---------------------------+---------------------------+--------------------------+
    | ConsumeQueue handle cache | HTTP connections          | the rest: CommitLog      |
    | CACHE_SHARE (40 %)        | CONNECTION_SHARE (40 %),  | segments, Raft and       |
    |                           | or max_http_connections   | catch-up sockets, logs,  |
    |                           | when that is lower        | snapshots, Python itself |
    +---------------------------+---------------------------+--------------------------+

The cache evicts before it opens past its share, and the connection guard refuses (or
displaces) connections past its own, so a node short of descriptors sheds handles and
clients instead of failing an ``open`` at apply. Pure arithmetic apart from the two
``resource`` calls, so the sharing is tested without changing the test process's limits.
"""

from __future__ import annotations

import contextlib
import resource
from dataclasses import dataclass

CACHE_SHARE = 0.40
CONNECTION_SHARE = 0.40
#: Descriptors kept out of both shares whatever the limit (Raft peers, segments, logs).
MIN_RESERVED_FDS = 64
#: Floors that keep a node usable under a tiny limit (it then warns).
MIN_CACHE_FILES = 16
MIN_CONNECTIONS = 16
#: More cached handles than this buy nothing measurable and cost kernel memory.
MAX_CACHE_FILES = 65_536
#: What an unlimited (RLIM_INFINITY) limit is counted as.
UNLIMITED_FDS = 1_048_576


@dataclass(frozen=True, slots=True)
class FdBudget:
    """How a node shares its open-file limit."""

    limit: int  # the soft limit in force after raising it
    cache_files: int  # ConsumeQueue handles kept open at most
    http_connections: int  # HTTP connections served at once
    reserved: int  # left for everything else
    cramped: bool  # the limit is too low for the floors: the node runs, but warns

    def describe(self) -> str:
        return (
            f"open files {self.limit}: ConsumeQueue cache {self.cache_files}, "
            f"HTTP connections {self.http_connections}, other {self.reserved}"
        )


def plan(limit: int, max_http_connections: int) -> FdBudget:
    """Share ``limit`` descriptors; ``max_http_connections`` (the config key) caps the HTTP
    share from above, never raises it."""
    limit = max(1, min(limit, UNLIMITED_FDS))
    cache = min(int(limit * CACHE_SHARE), MAX_CACHE_FILES)
    connections = min(int(limit * CONNECTION_SHARE), max_http_connections)
    cramped = False
    if limit - cache - connections < MIN_RESERVED_FDS:
        # Small limits: the reserve comes first, then the two shares split what is left.
        spare = max(0, limit - MIN_RESERVED_FDS)
        cache = min(cache, spare // 2)
        connections = min(connections, spare - cache)
    if cache < MIN_CACHE_FILES or connections < min(MIN_CONNECTIONS, max_http_connections):
        cramped = True
        cache = max(cache, MIN_CACHE_FILES)
        connections = max(connections, min(MIN_CONNECTIONS, max_http_connections))
    return FdBudget(
        limit=limit,
        cache_files=cache,
        http_connections=connections,
        reserved=limit - cache - connections,
        cramped=cramped,
    )


def raise_soft_limit() -> tuple[int, int]:
    """Raise the soft open-file limit to the hard one where the OS lets us; return the
    (soft, hard) limits in force afterwards, RLIM_INFINITY counted as :data:`UNLIMITED_FDS`."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
    if soft != hard and hard == resource.RLIM_INFINITY:
        # Some systems refuse an infinite soft limit; take a large finite one.
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (UNLIMITED_FDS, hard))
            soft = UNLIMITED_FDS

    def count(n: int) -> int:
        return UNLIMITED_FDS if n == resource.RLIM_INFINITY else n

    return count(soft), count(hard)
