"""``/metrics`` of 3 real node processes after produce, delay-level, timer, consume, a gRPC
call and a leadership transfer: every metric the alert rules and the Grafana dashboard name exists, and
the new series say what happened (lateness per kind, group lag, leader changes, replication
lag per follower), with counters typed as counters."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import grpc
import pytest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from rocketmq.grpc_protocol import definition_pb2 as pb
from rocketmq.grpc_protocol import service_pb2 as spb
from rocketmq.grpc_protocol import service_pb2_grpc as spb_grpc

from chronomq.aio import Client
from chronomq.cluster.process.launcher import LocalCluster
from tests.integration.conftest import wait_for
from tests.ops.test_observability import dashboard_metric_names, rule_metric_names

pytestmark = pytest.mark.integration

TOPIC = "orders"
GROUP = "billing"


async def scrape(s: aiohttp.ClientSession, url: str) -> dict[str, Metric]:
    async with s.get(f"{url}/metrics") as r:
        assert r.status == 200, await r.text()
        text = await r.text()
    return {m.name: m for m in text_string_to_metric_families(text)}


def sample_names(families: dict[str, Metric]) -> set[str]:
    return {s.name for m in families.values() for s in m.samples}


def value(families: dict[str, Metric], sample: str, **labels: str) -> float | None:
    for m in families.values():
        for s in m.samples:
            if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    return None


def test_every_metric_of_the_rules_and_the_dashboard_is_served(make_cluster: Any) -> None:
    cluster: LocalCluster = make_cluster(3)
    first = cluster.wait_leader(60)
    target = (first + 1) % 3

    async def go() -> None:
        async with Client(cluster.urls, deadline_s=30) as client, aiohttp.ClientSession() as s:
            moved = await client.transfer_leadership(target)
            assert moved["leader"] == target, moved
            leader = cluster.wait_leader(30)
            assert leader == target
            url = cluster.http_url(leader)
            await client.produce(TOPIC, [{"body": f"plain {i}"} for i in range(20)])
            await client.produce(
                TOPIC, [{"body": f"level {i}", "delay_level": 1} for i in range(5)]
            )
            await client.produce(TOPIC, [{"body": f"timer {i}", "delay_ms": 300} for i in range(5)])
            await client.commit_offset(GROUP, TOPIC, 0, 0)
            await client.pull(TOPIC, 0, 0, 8)
            async with grpc.aio.insecure_channel(cluster.grpc_address(leader)) as channel:
                route = spb.QueryRouteRequest(topic=pb.Resource(name=TOPIC))
                await spb_grpc.MessagingServiceStub(channel).QueryRoute(route, timeout=10)

            async def delivered() -> dict[str, Metric] | None:
                families = await scrape(s, url)
                counts = [
                    value(families, "chronomq_delivery_lateness_seconds_count", kind=kind)
                    for kind in ("level", "timer")
                ]
                return families if counts == [5, 5] else None

            families = await wait_for(delivered, 30, "5 level and 5 timer deliveries", cluster)

            wanted = rule_metric_names() | dashboard_metric_names()
            missing = wanted - sample_names(families)
            assert not missing, f"named by the rules or the dashboard, not served: {missing}"

            # Lateness: delay level 1 is 1 s, the timer 300 ms: both on time within seconds.
            for kind in ("level", "timer"):
                within = value(
                    families, "chronomq_delivery_lateness_seconds_bucket", kind=kind, le="10.0"
                )
                assert within == 5, (kind, within)
            lag = value(
                families, "chronomq_group_lag_messages", group=GROUP, topic=TOPIC, queue="0"
            )
            assert lag is not None and lag > 0
            peers = {
                s.labels["peer"] for s in families["chronomq_raft_replication_lag_entries"].samples
            }
            assert peers == {str(i) for i in range(3) if i != leader}
            # Running totals are counters; the renamed ones keep no old name.
            for name in (
                "chronomq_raft_slow_ticks",
                "chronomq_raft_leader_changes",
                "chronomq_schedule_delivered",
                "chronomq_timer_messages",
                "chronomq_produce_disk_full_rejections",
                "chronomq_leader_loops_started",
            ):
                assert families[name].type == "counter", name
            assert value(families, "chronomq_schedule_delivered_total", level="1") == 5
            assert "chronomq_timer_read_behind_ms" not in families
            assert "chronomq_schedule_oldest_due_lag_ms" not in families
            assert (value(families, "process_resident_memory_bytes") or 0) > 0
            # Every node saw the transfer as a leader change; followers report no lag series.
            for i in range(3):
                other = await scrape(s, cluster.http_url(i))
                changes = value(other, "chronomq_raft_leader_changes_total")
                assert changes is not None and changes >= 1, (i, changes)
                if i != leader:
                    assert not other["chronomq_raft_replication_lag_entries"].samples

    asyncio.run(go())
