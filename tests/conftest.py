"""Suite-wide hooks: a failing test that started clusters reports their nodes' last log lines."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from chronomq.cluster.launcher import LocalCluster

CLUSTERS = pytest.StashKey[list[LocalCluster]]()
"""The clusters a test started (fixtures register them on the test item)."""

LOG_LINES = 60


def node_logs(cluster: LocalCluster, lines: int = LOG_LINES) -> str:
    """The last ``lines`` lines of every node's log."""
    out = []
    for i in range(cluster.n):
        log: Path = cluster.node_dir(i) / "node.log"
        if log.exists():
            tail = log.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"--- node {i} ({log}) ---\n" + "\n".join(tail))
    return "\n".join(out)


def register_cluster(item: pytest.Item, cluster: LocalCluster) -> None:
    item.stash.setdefault(CLUSTERS, []).append(cluster)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[Any]:
    outcome = yield
    report = outcome.get_result()
    if report.when == "call" and report.failed:
        for n, cluster in enumerate(item.stash.get(CLUSTERS, [])):
            report.sections.append((f"node logs, cluster {n}", node_logs(cluster)))
