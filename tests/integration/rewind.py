"""A log that loses its newest entries on every node at once, by hand, on stopped nodes.

Under ``flush = async`` a power cut of every node may take the entries appended since the last
sync from every journal, and with them what no snapshot covers in the CommitLog and the
ConsumeQueues (raftlog/journal.py, raftlog/store.py). The cluster then comes back with a
shorter log, and the offsets the lost messages held are written again by new ones. These
helpers do exactly that to a cluster whose nodes were all SIGKILLed (the page cache keeps
everything a SIGKILL leaves, so the loss is made by hand), without a power-cut filesystem.
"""

from __future__ import annotations

import os
from pathlib import Path

from chronomq.cluster.process.launcher import LocalCluster
from chronomq.raftlog.journal import read_file

#: Settings under which the journal holds every entry (no snapshot compacts it) and nothing
#: is synced before the flusher runs.
SETTINGS = {"flush": "async", "log_compaction_min_entries": 1_000_000}


def journal_path(cluster: LocalCluster, i: int) -> Path:
    return cluster.node_dir(i) / "data" / "raft" / "journal"


def last_index(cluster: LocalCluster, i: int) -> int:
    """The index of the newest entry in node ``i``'s journal (read while it runs)."""
    got = read_file(str(journal_path(cluster, i)))
    assert got is not None and got.entries, f"node {i}: no journal entry"
    return int(got.entries[-1][1])


def rewind_every_node(cluster: LocalCluster, keep_index: int) -> int:
    """On every (stopped) node, drop the journal entries after ``keep_index`` and every
    CommitLog and ConsumeQueue byte (no snapshot covers them: :data:`SETTINGS`); the node
    rebuilds them from its journal on start. Returns how many entries the nodes dropped."""
    dropped = 0
    for i in range(cluster.n):
        data = cluster.node_dir(i) / "data"
        assert not (data / "raft" / "snapshot").exists(), f"node {i} took a snapshot"
        journal = journal_path(cluster, i)
        got = read_file(str(journal))
        assert got is not None
        cut = next((k for k, e in enumerate(got.entries) if e[1] > keep_index), None)
        if cut is not None:
            os.truncate(journal, got.offsets[cut])
            dropped += len(got.entries) - cut
        (data / "raft" / "journal.commit").unlink(missing_ok=True)  # a hint, never synced
        for seg in (data / "commitlog").iterdir():
            if seg.name.isdigit():
                seg.unlink()
        for cq in (data / "consumequeue").rglob("*"):
            if cq.is_file():
                os.truncate(cq, 0)
    return dropped
