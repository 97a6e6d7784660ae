"""Prometheus metrics of pop consumption, in the form ``cluster/node/disk.py`` uses: the caller's
registry and a list of collectors run before each scrape (``cluster.httpapi.api.create_app`` calls
``install_metrics(registry, collectors, broker.pop)``). Consumer-group lag, pop included, is
:class:`chronomq.cluster.node.metrics.GroupLagCollector`'s."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from chronomq.pop.service import PopService

#: What apply counts (:class:`chronomq.pop.machine.PopStats`), exported with these labels.
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

    def collect() -> None:
        inflight, revived = held_messages(service)
        held.labels("inflight").set(inflight)
        held.labels("revived").set(revived)
        behind.set(service.stats()["revive_behind"])

    collectors.append(collect)
    registry.register(_AppliedCounter(service))


class _AppliedCounter:
    """``chronomq_pop_applied_total{what}``: what pop apply did on this node since start."""

    def __init__(self, service: PopService) -> None:
        self._service = service

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily

        family = CounterMetricFamily(
            "chronomq_pop_applied",
            "What pop apply did on this node since start, by outcome",
            labels=["what"],
        )
        counts = self._service.machine.stats.counts
        for what in APPLIED:
            family.add_metric([what], counts.get(what, 0))
        yield family
