"""Settings of one node's replicated log."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

_MIB = 1024**2


def default_max_pending_bytes() -> int:
    """min(64 MiB, 1/16 of the machine's memory), at least 16 MiB: what produce may hold.

    Memory is one bound; the other is time: what is held must commit well within
    ``commit_timeout_ms``. Large messages commit at 10-20 MiB/s on a 2-core machine (one
    4 MiB command on the wire at a time), so 64 MiB is a few seconds of queue.
    """
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 64 * _MIB
    return max(16 * _MIB, min(64 * _MIB, ram // 16))


def host_port(address: str) -> tuple[str, int]:
    """``"host:port"`` as ``(host, port)`` (an IPv6 host keeps its brackets)."""
    host, _, port = address.rpartition(":")
    return host, int(port)


@dataclass(frozen=True, slots=True)
class RaftPeer:
    """Another member: its Raft address and its catch-up (CommitLog fetch) address."""

    raft: str
    fetch: str


@dataclass(frozen=True, slots=True)
class RaftConfig:
    data_dir: str
    raft_address: str  # host:port this node's Raft listens on
    fetch_address: str  # host:port of this node's catch-up server
    peers: tuple[RaftPeer, ...] = ()
    flush: str = "async"  # "async" | "sync"
    #: ``flush="async"``: how often the journal and the CommitLog are synced (RocketMQ's
    #: flushIntervalCommitLog); what a power cut of every node at once may lose.
    flush_interval_ms: int = 500
    commitlog_segment_bytes: int = 128 * 1024 * 1024
    max_message_bytes: int = 4 * 1024 * 1024
    # Group commit.
    batch_max_messages: int = 512
    batch_max_bytes: int = 1024 * 1024
    max_inflight_commands: int = 64
    max_pending_messages: int = 200_000
    max_pending_bytes: int = field(default_factory=default_max_pending_bytes)
    commit_timeout_ms: int = 10_000
    idempotency_window_batches: int = 20_000  # internal batches' keys, by count
    idempotency_window_s: int = 600  # clients' keys, by the commands' propose times
    idempotency_max_keys: int = 100_000  # clients' keys held at most
    default_topic_queues: int = 4
    # Bounds on growth and open files (see raftlog.store.TopicLimits; equal on every node).
    max_topics: int = 10_000
    max_queues: int = 80_000
    max_open_cq_files: int = 512
    # pysyncobj.
    append_entries_period_ms: int = 50
    append_entries_use_batch: bool = False
    append_entries_batch_bytes: int = 4 * 1024 * 1024
    wire_compression_level: int = 0
    raft_min_timeout_ms: int = 1000
    raft_max_timeout_ms: int = 2000
    raft_leader_lost_ms: int = 100  # a closed leader connection: pre-vote after this (0: off)
    connection_timeout_ms: int = 60_000
    connection_retry_ms: int = 250  # a peer that restarted is reached again within this
    leader_fallback_timeout_ms: int = 3_000
    log_compaction_min_entries: int = 1_000
    log_compaction_min_time_s: int = 60
    log_compaction_max_bytes: int = 32 * 1024 * 1024
    # Leadership: a leader that has not committed for this long stops its leader-only work.
    leader_lease_ms: int = 1_500
    catchup_deadline_s: int = 300
    # Every Raft and catch-up connection proves knowledge of this key (HMAC); empty on
    # loopback-only clusters that were given none.
    cluster_secret: bytes = b""
    extra: dict[str, object] = field(default_factory=dict)
