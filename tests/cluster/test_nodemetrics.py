"""The node's own collectors: delivery lateness, consumer-group lag and its bound."""

from __future__ import annotations

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric

from chronomq.cluster.node.metrics import (
    GROUP_LAG_SERIES,
    KIND_LEVEL,
    KIND_TIMER,
    DeliveryLateness,
    GroupLagCollector,
    group_lags,
)

PREFIX = "go/"


def test_lateness_is_observed_in_seconds_per_kind_and_never_negative() -> None:
    lateness = DeliveryLateness()
    registry = CollectorRegistry()
    registry.register(lateness.histogram)
    value = registry.get_sample_value
    # Both kinds are there before anything is delivered.
    assert value("chronomq_delivery_lateness_seconds_count", {"kind": "level"}) == 0
    assert value("chronomq_delivery_lateness_seconds_count", {"kind": "timer"}) == 0
    items = [("a" * 32, "orders", 0, 10_000), ("b" * 32, "orders", 0, 10_300)]
    lateness.observe(KIND_LEVEL, items, 10_400)  # 400 ms and 100 ms late
    lateness.observe(KIND_TIMER, [("c" * 32, "orders", 0, 5_000)], 4_990)  # clock stepped back
    assert value("chronomq_delivery_lateness_seconds_count", {"kind": "level"}) == 2
    assert value("chronomq_delivery_lateness_seconds_sum", {"kind": "level"}) == 0.5
    assert value("chronomq_delivery_lateness_seconds_bucket", {"kind": "level", "le": "0.1"}) == 1
    assert value("chronomq_delivery_lateness_seconds_bucket", {"kind": "level", "le": "0.5"}) == 2
    assert value("chronomq_delivery_lateness_seconds_sum", {"kind": "timer"}) == 0
    assert value("chronomq_delivery_lateness_seconds_count", {"kind": "timer"}) == 1


def test_group_lag_is_what_lies_past_the_committed_offset_or_the_pop_cursor() -> None:
    ends = {("orders", 0): 100, ("orders", 1): 40, ("%RETRY%g", 0): 3}
    kv = [
        ("go/g/orders/0", 90),
        ("go/g/orders/1", 50),  # past the end (a queue truncated): no negative lag
        ("go/g/%RETRY%g/0", 0),
        ("go/broken", 5),  # not group/topic/queue: ignored
        ("member/1", "x"),
        ("go/h/orders/0", "not an offset"),
    ]
    # Pop: cursor 30 with 2 held → 30 - 2 = 28 consumed for sure.
    pop = [("p", "orders", 0, 28), ("g", "orders", 0, 95)]
    lags = group_lags(kv, pop, lambda t, q: ends.get((t, q), 0), PREFIX)
    assert lags == {
        ("g", "orders", 0): 10,  # committed 90 beats the pop view of 95 (the larger lag)
        ("g", "orders", 1): 0,
        ("g", "%RETRY%g", 0): 3,
        ("p", "orders", 0): 72,
    }


class _Store:
    def __init__(self, kv: dict[str, object], end: int) -> None:
        self.kv = kv
        self._end = end

    def max_offset(self, topic: str, queue: int) -> int:
        return self._end


class _RaftLog:
    def __init__(self, store: _Store) -> None:
        self.store = store


class _Broker:
    def __init__(self, store: _Store) -> None:
        self.raftlog = _RaftLog(store)
        self.pop = None


def test_group_lag_exports_only_the_largest_series_and_counts_them_all() -> None:
    n = GROUP_LAG_SERIES + 50
    kv: dict[str, object] = {f"go/g{i:03d}/orders/0": i for i in range(n)}
    collector = GroupLagCollector(_Broker(_Store(kv, end=1_000)))  # type: ignore[arg-type]
    families: dict[str, Metric] = {m.name: m for m in collector.collect()}
    samples = families["chronomq_group_lag_messages"].samples
    assert len(samples) == GROUP_LAG_SERIES
    # The largest lags are the groups with the lowest offsets.
    assert {s.labels["group"] for s in samples} == {f"g{i:03d}" for i in range(GROUP_LAG_SERIES)}
    assert max(s.value for s in samples) == 1_000
    assert families["chronomq_group_lag_queues"].samples[0].value == n
