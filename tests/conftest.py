"""Suite-wide hooks: a failing test that started clusters reports their nodes' last log lines."""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from chronomq.cluster.process.launcher import LocalCluster


def _session_seed() -> int:
    """One random seed per test run, the same in every process of it (pytest-xdist's workers
    collect separately and must see the same test ids); ``CHRONOMQ_TEST_SEED`` sets it."""
    given = os.environ.get("CHRONOMQ_TEST_SEED") or os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if given:
        return random.Random(given).randrange(2**32)
    return random.randrange(2**32)


SESSION_SEED = _session_seed()


def random_seed(name: str) -> int:
    """A seed for a randomized case that is new on every run (a failing one names it in its
    test id), derived from :data:`SESSION_SEED` and ``name``."""
    return random.Random(f"{SESSION_SEED}:{name}").randrange(2**32)


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
