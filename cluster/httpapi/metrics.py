"""The HTTP API's Prometheus registry: request counts and latency, produce and pull counts, the
Raft gauges set on each scrape, and collectors of long polls, connections and membership.

The node's other collectors (:mod:`chronomq.cluster.node.metrics`, the services', pop's) are
registered into the same registry by :func:`chronomq.cluster.httpapi.api.create_app`; ``GET
/metrics`` serves it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from chronomq.cluster.httpapi.httpconn import ConnectionGuard
from chronomq.cluster.node.broker import Broker
from chronomq.version import VERSION


class Metrics:
    """The node's registry: the gauges set on each scrape (:meth:`refresh`), the collectors
    of :mod:`chronomq.cluster.node.metrics` and the services', and the process collector
    (``process_resident_memory_bytes``, ``process_cpu_seconds_total``, open fds, ...)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        GCCollector(registry=r)
        self.requests = Counter(
            "chronomq_http_requests", "HTTP requests", ["route", "status"], registry=r
        )
        self.latency = Histogram(
            "chronomq_http_request_seconds",
            "HTTP request latency",
            ["route"],
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=r,
        )
        self.produced = Counter(
            "chronomq_messages_produced", "Messages produced through this node", registry=r
        )
        self.consumed = Counter(
            "chronomq_messages_pulled", "Messages returned by pulls", registry=r
        )
        self.role = Gauge(
            "chronomq_raft_role", "1 when this node is the confirmed leader", registry=r
        )
        self.term = Gauge("chronomq_raft_term", "Current Raft term", registry=r)
        self.commit_index = Gauge("chronomq_raft_commit_index", "Raft commit index", registry=r)
        self.applied_index = Gauge("chronomq_raft_applied_index", "Raft applied index", registry=r)
        self.max_tick = Gauge(
            "chronomq_raft_max_tick_seconds", "Longest Raft tick since start", registry=r
        )
        self.commitlog_bytes = Gauge(
            "chronomq_commitlog_bytes", "CommitLog length in bytes", registry=r
        )
        self.queued = Gauge(
            "chronomq_group_commit_queued_messages", "Messages waiting for commit", registry=r
        )
        self.inflight = Gauge(
            "chronomq_group_commit_inflight_commands",
            "Commands proposed, not committed",
            registry=r,
        )
        self.transfers = Counter(
            "chronomq_leadership_transfers",
            "Leadership transfers this node tried while it led (asked, or before stopping), by result",
            ["result"],
            registry=r,
        )
        build = Gauge(
            "chronomq_build_info",
            "Always 1; the label says this node's version",
            ["version"],
            registry=r,
        )
        build.labels(version=VERSION).set(1)
        self.collectors: list[Callable[[], None]] = []

    def refresh(self, broker: Broker) -> None:
        st = broker.raftlog.status()
        self.role.set(1 if broker.raftlog.is_leader else 0)
        self.term.set(st["term"])
        self.commit_index.set(st["commit_index"])
        self.applied_index.set(st["applied_index"])
        self.max_tick.set(st["max_tick_ms"] / 1000)
        self.commitlog_bytes.set(broker.raftlog.store.applied_length)
        self.queued.set(st["queued_messages"])
        self.inflight.set(st["inflight_commands"])
        for collect in self.collectors:
            collect()


class BoundsCollector:
    """Long-poll waiters, pull reads moved off the loop, receives forwarded with a wait, and
    the HTTP connection guard."""

    def __init__(self, broker: Broker, guard: ConnectionGuard) -> None:
        self._broker = broker
        self._guard = guard

    def collect(self) -> Iterator[Metric]:
        b, g = self._broker, self._guard
        yield GaugeMetricFamily(
            "chronomq_pull_waiters", "Long-polling pulls waiting now", value=b.waiters.waiting
        )
        yield CounterMetricFamily(
            "chronomq_pull_wakes",
            "Long-polled queues woken by a message written to them",
            value=b.waiters.wakes,
        )
        yield CounterMetricFamily(
            "chronomq_pull_offloaded_reads",
            "Pull pages read on the pull executor (larger than the inline limit)",
            value=b.offloaded_pulls,
        )
        peer = b.peer_client
        yield GaugeMetricFamily(
            "chronomq_forward_long_polls",
            "Receives with a wait this follower has forwarded to the leader and that wait now",
            value=peer.polls_forwarded,
        )
        yield GaugeMetricFamily(
            "chronomq_forward_long_polls_queued",
            "Receives waiting for a slot of forward_long_polls now",
            value=peer.polls_waiting,
        )
        yield CounterMetricFamily(
            "chronomq_forward_long_polls_unserved",
            "Receives that found no slot of forward_long_polls within their wait (answered empty)",
            value=peer.polls_unserved,
        )
        yield GaugeMetricFamily(
            "chronomq_http_connections", "Open HTTP connections", value=g.open_connections
        )
        for name, what in (
            ("refused", "refused at max_http_connections (all busy)"),
            ("displaced", "closed at max_http_connections to admit a new one"),
            ("header_timeouts", "closed for missing http_header_timeout_ms"),
            ("body_timeouts", "answered 408 for missing http_body_timeout_ms"),
        ):
            yield CounterMetricFamily(
                f"chronomq_http_connections_{name}",
                f"HTTP connections {what}",
                value=getattr(g, name),
            )


class MembershipCollector:
    """This node's removal and its pre-vote counters."""

    def __init__(self, broker: Broker) -> None:
        self._broker = broker

    def collect(self) -> Iterator[Metric]:
        machine = self._broker.raftlog.machine
        yield GaugeMetricFamily(
            "chronomq_removed_from_cluster",
            "1 when this node was removed from the cluster",
            value=1 if machine.removal is not None else 0,
        )
        for name, value, what in (
            ("prevotes_started", machine.prevotes_started, "pre-vote rounds this node started"),
            ("prevotes_won", machine.prevotes_won, "pre-vote rounds won (elections started)"),
            (
                "fast_prevotes_started",
                machine.fast_prevotes_started,
                "pre-vote rounds started because the leader's connection closed",
            ),
            (
                "votes_ignored",
                machine.votes_ignored,
                "vote requests ignored (a live leader was heard, or this node was removed)",
            ),
        ):
            yield CounterMetricFamily(f"chronomq_raft_{name}", what, value=value)
