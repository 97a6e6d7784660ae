"""Prometheus collectors of one node that read state kept elsewhere: Raft counters and
replication lag, consumer-group lag, and the histogram of how late delayed messages arrive.

Running totals are counters (``_total``), durations are in seconds, and every label set is
bounded: peers by the cluster's size, delivery kinds by two, consumer-group queues by
:data:`GROUP_LAG_SERIES`. The collectors read when ``/metrics`` is scraped; the lateness
histogram is observed by the schedule and timer services as they deliver
(:func:`chronomq.cluster.node.services.start_services` wires it).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Final

from prometheus_client import Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from chronomq.cluster.node.offsets import GROUP_OFFSET_PREFIX

if TYPE_CHECKING:
    from chronomq.cluster.node.broker import Broker

GROUP_LAG_SERIES: Final = 100
"""Most (group, topic, queue) series of ``chronomq_group_lag_messages``: the largest lags."""

LATENESS_BUCKETS_S: Final = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    300.0,
    1800.0,
)

KIND_LEVEL: Final = "level"
KIND_TIMER: Final = "timer"

DeliveredItem = tuple[str, str, int, int]
"""(msg_id hex, real topic, store_ms, due_ms), as the schedule and timer services report."""


class DeliveryLateness:
    """``chronomq_delivery_lateness_seconds{kind}``: delivered minus due, per delivered delayed
    message (``kind`` ``level`` or ``timer``). Observed on the leader's service threads; the
    histogram is registered on the app's registry by :func:`register`."""

    def __init__(self) -> None:
        self.histogram = Histogram(
            "chronomq_delivery_lateness_seconds",
            "How late delayed messages were written back to their real topic (delivered - due)",
            ["kind"],
            buckets=LATENESS_BUCKETS_S,
            registry=None,
        )
        # Both series exist from the start, so a dashboard shows 0 rather than nothing.
        self._children = {k: self.histogram.labels(kind=k) for k in (KIND_LEVEL, KIND_TIMER)}

    def observe(self, kind: str, items: Sequence[DeliveredItem], delivered_ms: int) -> None:
        child = self._children[kind]
        for _msg_id, _topic, _store_ms, due_ms in items:
            # Never early by design; a clock step back must not make a negative observation.
            child.observe(max(0, delivered_ms - due_ms) / 1000)


class RaftCollector:
    """Counters and lag of this node's Raft group.

    - ``chronomq_raft_slow_ticks_total``: ticks over half the shortest election timeout;
    - ``chronomq_raft_leader_changes_total``: leaders this node came to know after another (the
      first one it learns at start does not count);
    - ``chronomq_raft_replication_lag_entries{peer}``: on the leader only, committed entries
      each follower does not hold yet (commit index minus its match index).
    """

    def __init__(self, broker: Broker) -> None:
        self._broker = broker

    def collect(self) -> Iterator[Metric]:
        broker = self._broker
        st = broker.raftlog.status()
        yield CounterMetricFamily(
            "chronomq_raft_slow_ticks",
            "Raft ticks longer than half the shortest election timeout, since start",
            value=st["slow_ticks"],
        )
        yield CounterMetricFamily(
            "chronomq_raft_leader_changes",
            "Leader changes this node has seen since start",
            value=broker.leader_changes_total,
        )
        lag = GaugeMetricFamily(
            "chronomq_raft_replication_lag_entries",
            "Committed entries a follower does not hold yet (on the leader, per follower)",
            labels=["peer"],
        )
        if st["role"] == "leader":
            commit = int(st["commit_index"])
            for address, match in sorted(st["match_index"].items()):
                node = broker.node_id_of(address)
                lag.add_metric([address if node is None else str(node)], max(0, commit - match))
        yield lag


def group_lags(
    kv_items: Iterable[tuple[str, Any]],
    pop_queues: Iterable[tuple[str, str, int, int]],
    max_offset: Callable[[str, int], int],
    prefix: str,
) -> dict[tuple[str, str, int], int]:
    """Lag per (group, topic, queue): messages past a group's committed offset, and for pop
    consumption past its cursor plus those handed out and not acked (``pop_queues`` gives
    (group, topic, queue, cursor - held)). Where both exist the larger lag counts."""
    lags: dict[tuple[str, str, int], int] = {}
    for key, value in kv_items:
        if not key.startswith(prefix) or not isinstance(value, int):
            continue
        group_topic, _, queue = key[len(prefix) :].rpartition("/")
        group, _, topic = group_topic.partition("/")
        if not queue.isdigit() or not topic:
            continue
        q = int(queue)
        lags[(group, topic, q)] = max(0, max_offset(topic, q) - value)
    for group, topic, q, consumed in pop_queues:
        lag = max(0, max_offset(topic, q) - consumed)
        lags[(group, topic, q)] = max(lag, lags.get((group, topic, q), 0))
    return lags


class GroupLagCollector:
    """``chronomq_group_lag_messages{group, topic, queue}`` for the :data:`GROUP_LAG_SERIES`
    largest lags, and ``chronomq_group_lag_queues``: how many group queues have a lag at all
    (committed offsets and pop state), so a dashboard knows when it sees only the largest."""

    def __init__(self, broker: Broker) -> None:
        self._broker = broker

    def _pop_queues(self) -> Iterator[tuple[str, str, int, int]]:
        pop = self._broker.pop
        if pop is None:
            return
        machine = pop.machine
        for group, topic, queue in list(machine.queue_keys()):
            st = machine.queue_state(group, topic, queue)
            yield group, topic, queue, st.cursor - st.held

    def collect(self) -> Iterator[Metric]:
        store = self._broker.raftlog.store
        lags = group_lags(
            list(store.kv.items()), self._pop_queues(), store.max_offset, GROUP_OFFSET_PREFIX
        )
        family = GaugeMetricFamily(
            "chronomq_group_lag_messages",
            f"Messages a consumer group has not consumed, per queue (the {GROUP_LAG_SERIES} "
            "largest)",
            labels=["group", "topic", "queue"],
        )
        top = heapq.nlargest(GROUP_LAG_SERIES, lags.items(), key=lambda kv: (kv[1], kv[0]))
        for (group, topic, queue), lag in sorted(top, key=lambda kv: kv[0]):
            family.add_metric([group, topic, str(queue)], lag)
        yield family
        yield GaugeMetricFamily(
            "chronomq_group_lag_queues",
            "Consumer-group queues with a committed offset or pop state on this node",
            value=len(lags),
        )
