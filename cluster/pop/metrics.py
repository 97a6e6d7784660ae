"""Prometheus gauges of pop consumption, in the form ``cluster/disk.py`` uses: the caller's
registry and a list of collectors run before each scrape. (Wiring it into ``/metrics`` is the
HTTP app's: ``install_metrics(registry, collectors, broker.pop)``.)"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from cluster.pop.service import PopService

#: What apply counts (:class:`cluster.pop.machine.PopStats`), exported with these labels.
APPLIED = (
    "popped",
    "ack",
    "chg",
    "dlq",
    "revived",
    "rearmed",
    "dead",
    "stale",
    "malformed",
    "invalid",
    "dropped_by_retention",
    "dead_letter_missing",
    "state_unreadable",
)


def held_messages(service: PopService) -> tuple[int, int]:
    """(in flight, revived and waiting) over every group and queue, as committed here."""
    inflight = revived = 0
    for group, topic, queue in service.machine.queue_keys():
        st = service.machine.queue_state(group, topic, queue)
        inflight += len(st.inflight)
        revived += len(st.revived)
    return inflight, revived


def install_metrics(
    registry: Any, collectors: list[Callable[[], None]], service: PopService
) -> None:
    from prometheus_client import Gauge

    held = Gauge(
        "chronomq_pop_held_messages",
        "Messages handed out and not acked (inflight) or revived and not handed out again",
        ["state"],
        registry=registry,
    )
    behind = Gauge(
        "chronomq_pop_revive_behind",
        "Checkpoints the timer delivered that no revive command has read yet",
        registry=registry,
    )
    applied = Gauge(
        "chronomq_pop_applied",
        "What pop apply did on this node since start, by outcome",
        ["what"],
        registry=registry,
    )

    def collect() -> None:
        inflight, revived = held_messages(service)
        held.labels("inflight").set(inflight)
        held.labels("revived").set(revived)
        stats = service.stats()
        behind.set(stats["revive_behind"])
        counts = service.machine.stats.counts
        for what in APPLIED:
            applied.labels(what).set(counts.get(what, 0))

    collectors.append(collect)
