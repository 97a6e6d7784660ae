"""Receives that long-poll on a follower do not starve its forwarding of writes: each waits on
a lane of its own (``forward_long_polls`` at once), a produce through the same follower is
answered while they wait, and receives past the lane's size answer with no messages at the
end of their wait (never an error). Over HTTP and over gRPC, on 3 real nodes."""

from __future__ import annotations

import asyncio
import re
import urllib.request
from typing import Any

import aiohttp
import grpc
import pytest
from rocketmq.grpc_protocol import definition_pb2 as pb
from rocketmq.grpc_protocol import service_pb2 as spb
from rocketmq.grpc_protocol import service_pb2_grpc as spb_grpc

from chronomq.cluster.process.launcher import LocalCluster
from tests.integration.conftest import wait_for
from tests.integration.test_grpc import raw_send

pytestmark = pytest.mark.integration

LANE = 100
"""``forward_long_polls`` of the cluster: under the 110 polls each transport starts."""
POLLS = 110
WAIT_MS = 20_000
Code = pb.Code


def scrape(cluster: LocalCluster, node: int, sample: str) -> float:
    text = urllib.request.urlopen(f"{cluster.http_url(node)}/metrics", timeout=5).read().decode()
    found = re.search(rf"^{re.escape(sample)} (\S+)$", text, re.M)
    return float(found.group(1)) if found else -1.0


async def lane_shows(cluster: LocalCluster, node: int, forwarded: int, queued: int) -> None:
    async def there() -> bool:
        got = await asyncio.to_thread(
            lambda: (
                scrape(cluster, node, "chronomq_forward_long_polls"),
                scrape(cluster, node, "chronomq_forward_long_polls_queued"),
            )
        )
        return got == (forwarded, queued)

    await wait_for(there, 60, f"{forwarded} polls forwarded and {queued} queued", cluster)


async def test_http_long_polls_on_a_follower_leave_its_produce_alone(make_cluster: Any) -> None:
    cluster: LocalCluster = make_cluster(3, forward_long_polls=LANE)
    leader = cluster.wait_leader(60)
    cluster.wait_all_know_leader(30)
    f = (leader + 1) % 3
    url = cluster.http_url(f)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as s:
        async with s.put(f"{url}/v1/topics/idle", json={"queues": 2}) as r:
            assert r.status in (200, 201), await r.text()

        async def poll() -> tuple[int, Any]:
            async with s.post(
                f"{url}/v1/groups/waiters/pop", json={"topic": "idle", "wait_ms": WAIT_MS}
            ) as r:
                return r.status, await r.json()

        polls = [asyncio.create_task(poll()) for _ in range(POLLS)]
        await lane_shows(cluster, f, LANE, POLLS - LANE)
        async with s.post(
            f"{url}/v1/topics/busy/messages", json={"messages": [{"body": "while polls wait"}]}
        ) as r:
            answer = await r.json()
            assert r.status == 200, answer
        assert not any(p.done() for p in polls), "the polls should still be waiting"
        # One message for the waiting receives: one of the forwarded polls gets it.
        async with s.post(
            f"{url}/v1/topics/idle/messages", json={"messages": [{"body": "for a poll"}]}
        ) as r:
            assert r.status == 200, await r.text()
        results = await asyncio.wait_for(asyncio.gather(*polls), WAIT_MS / 1000 + 30)
    assert {status for status, _ in results} == {200}, results
    bodies = [m["body"] for _, got in results for m in got["messages"]]
    assert bodies == ["for a poll"]
    # Queued polls took the slots that came free (the one that got the message ended early);
    # the others answered empty at the end of their wait.
    unserved = scrape(cluster, f, "chronomq_forward_long_polls_unserved_total")
    assert 0 < unserved <= POLLS - LANE, unserved


async def test_grpc_long_polls_on_a_follower_leave_its_sends_alone(make_cluster: Any) -> None:
    cluster: LocalCluster = make_cluster(3, forward_long_polls=LANE)
    leader = cluster.wait_leader(60)
    cluster.wait_all_know_leader(30)
    f = (leader + 1) % 3
    async with (
        aiohttp.ClientSession() as s,
        s.put(f"{cluster.http_url(f)}/v1/topics/idle_grpc", json={"queues": 2}) as r,
    ):
        assert r.status in (200, 201), await r.text()
    channels = [grpc.aio.insecure_channel(cluster.grpc_address(f)) for _ in range(2)]
    try:
        stubs = [spb_grpc.MessagingServiceStub(c) for c in channels]

        async def receive(k: int) -> list[Any]:
            req = spb.ReceiveMessageRequest(
                group=pb.Resource(name="grpc_waiters"),
                message_queue=pb.MessageQueue(topic=pb.Resource(name="idle_grpc"), id=-1),
                filter_expression=pb.FilterExpression(type=pb.FilterType.TAG, expression="*"),
                batch_size=16,
                auto_renew=False,
            )
            req.invisible_duration.seconds = 30
            req.long_polling_timeout.seconds = WAIT_MS // 1000
            return [r async for r in stubs[k % 2].ReceiveMessage(req, timeout=WAIT_MS / 1000 + 15)]

        polls = [asyncio.create_task(receive(k)) for k in range(POLLS)]
        await lane_shows(cluster, f, LANE, POLLS - LANE)
        sent = await stubs[0].SendMessage(raw_send("busy_grpc", b"while polls wait"), timeout=15)
        assert sent.status.code == Code.OK, sent.status
        assert not any(p.done() for p in polls), "the receives should still be waiting"
        sent = await stubs[1].SendMessage(raw_send("idle_grpc", b"for a receive"), timeout=15)
        assert sent.status.code == Code.OK, sent.status
        results = await asyncio.wait_for(asyncio.gather(*polls), WAIT_MS / 1000 + 30)
    finally:
        for c in channels:
            await c.close()
    codes = sorted({r.status.code for answer in results for r in answer if r.HasField("status")})
    assert codes == sorted({Code.OK, Code.MESSAGE_NOT_FOUND}), codes
    bodies = [r.message.body for answer in results for r in answer if r.HasField("message")]
    assert bodies == [b"for a receive"]
