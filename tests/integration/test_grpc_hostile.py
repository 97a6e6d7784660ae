"""Hostile RocketMQ 5 clients against real nodes, with raw gRPC stubs: values past every bound,
spoofed message ids, forged recall handles, RocketMQ's own system topics."""

from __future__ import annotations

from typing import Any

import aiohttp
import grpc
import pytest
from rocketmq.grpc_protocol import definition_pb2 as pb
from rocketmq.grpc_protocol import service_pb2 as spb
from rocketmq.grpc_protocol import service_pb2_grpc as spb_grpc

from chronomq.cluster.process.launcher import LocalCluster
from tests.integration.test_grpc import raw_send

pytestmark = pytest.mark.integration

Code = pb.Code


def tracebacks(cluster: LocalCluster) -> list[str]:
    found = []
    for i in range(cluster.n):
        text = (cluster.node_dir(i) / "node.log").read_text(errors="replace")
        found += [line[:300] for line in text.splitlines() if "Traceback" in line]
    return found


async def test_huge_delivery_times_are_refused_alike_on_a_follower_and_the_leader(
    make_cluster: Any,
) -> None:
    cluster: LocalCluster = make_cluster()
    leader = cluster.wait_leader(60)
    cluster.wait_all_know_leader(30)
    follower = (leader + 1) % 3
    huge = [2**62, 2**63 - 1, 253_402_300_800]
    for node in (follower, leader):
        async with grpc.aio.insecure_channel(cluster.grpc_address(node)) as channel:
            stub = spb_grpc.MessagingServiceStub(channel)
            for seconds in huge:
                req = raw_send("huge_times", b"x")
                req.messages[0].system_properties.delivery_timestamp.seconds = seconds
                answer = await stub.SendMessage(req, timeout=15)
                assert answer.status.code == Code.ILLEGAL_DELIVERY_TIME, (node, seconds, answer)
                assert "delivery_timestamp" in answer.status.message, answer.status
            query = spb.QueryOffsetRequest(
                message_queue=pb.MessageQueue(topic=pb.Resource(name="huge_times"), id=0),
                query_offset_policy=pb.QueryOffsetPolicy.TIMESTAMP,
            )
            query.timestamp.seconds = 2**62
            answer = await stub.QueryOffset(query, timeout=15)
            assert answer.status.code != Code.INTERNAL_ERROR, answer.status
    # The HTTP API on both, for every time field (a delay level past the table is clamped to
    # its last level, as RocketMQ does).
    async with aiohttp.ClientSession() as s:
        for node in (follower, leader):
            for field, value in (
                ("deliver_at_ms", 2**63 - 1),
                ("deliver_at_ms", 2**64),
                ("delay_ms", 2**63 - 1),
            ):
                async with s.post(
                    f"{cluster.http_url(node)}/v1/topics/huge_times/messages",
                    json={"messages": [{"body": "x", field: value}]},
                ) as r:
                    answer = await r.json()
                    assert r.status == 400, (node, field, value, answer)
                    assert field in (answer["field"] or ""), answer
    assert tracebacks(cluster) == []
