"""The RocketMQ 5 gRPC endpoint on 3 real node processes, with the official Python client
(``rocketmq-python-client``) unchanged: normal, timer and delay-level sends, recalls, the
auth token, the protocol's codes for bad input, and a send retried across a SIGKILL of the
leader stored once. What is stored is read back with our HTTP pull API. Every wait has a
deadline."""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
from rocketmq import ClientConfiguration, Credentials, Message, Producer
from rocketmq.grpc_protocol import definition_pb2 as pb
from rocketmq.grpc_protocol import service_pb2 as spb
from rocketmq.grpc_protocol import service_pb2_grpc as spb_grpc

from chronomq.cluster.process.launcher import LocalCluster
from tests.integration.conftest import dump_logs, wait_for
from tests.selfsigned import self_signed

CLIENTS_PAGE = Path(__file__).resolve().parents[2] / "docs" / "howto" / "rocketmq-clients.md"

pytestmark = pytest.mark.integration

TOKEN = "grpc-test-token-0123456789"
QUEUES = 4
Code = pb.Code


def now_ms() -> int:
    return time.time_ns() // 1_000_000


class Stored:
    """Every copy of every message in a topic, pulled over HTTP from one node."""

    def __init__(self, cluster: LocalCluster, topic: str, token: str | None = None) -> None:
        self.cluster = cluster
        self.topic = topic
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.offsets = [0] * QUEUES
        self.copies: list[dict[str, Any]] = []

    async def poll(self, node: int) -> list[dict[str, Any]]:
        url = self.cluster.urls[node]
        async with aiohttp.ClientSession(headers=self.headers) as s:
            for q in range(QUEUES):
                try:
                    async with s.get(
                        f"{url}/v1/topics/{self.topic}/queues/{q}/messages",
                        params={"offset": str(self.offsets[q]), "max": "1000"},
                    ) as r:
                        if r.status != 200:
                            continue  # the topic may not exist yet
                        page = await r.json()
                except aiohttp.ClientError:
                    continue
                self.copies.extend(page["messages"])
                self.offsets[q] = page["next_offset"]
        return self.copies

    def by_uniq_key(self) -> Counter[str]:
        return Counter(m["properties"].get("UNIQ_KEY", "") for m in self.copies)


def producer(cluster: LocalCluster, topic: str, token: str = "") -> Producer:
    config = ClientConfiguration(
        cluster.grpc_endpoints,
        Credentials("ak", token) if token else Credentials(),
        request_timeout=10,
    )
    p = Producer(config, (topic,))
    p.startup()
    return p


def message(topic: str, body: bytes, **kw: Any) -> Message:
    m = Message()
    m.topic = topic
    m.body = body
    for k, v in kw.items():
        if k == "properties":
            for name, value in v.items():
                m.add_property(name, value)
        else:
            setattr(m, k, v)
    return m


def raw_send(topic: str, body: bytes, message_id: str = "", **sp: Any) -> spb.SendMessageRequest:
    req = spb.SendMessageRequest()
    m = req.messages.add()
    m.topic.name = topic
    m.body = body
    m.system_properties.message_id = message_id
    m.system_properties.body_encoding = pb.Encoding.IDENTITY
    for k, v in sp.items():
        if k == "user_properties":
            m.user_properties.update(v)
        elif k == "keys":
            m.system_properties.keys.extend(v)
        elif k == "delivery_ms":
            m.system_properties.delivery_timestamp.seconds = v // 1000
        else:
            setattr(m.system_properties, k, v)
    return req


async def test_producer_sends_timers_recalls_and_codes(make_cluster: Any) -> None:
    cluster: LocalCluster = make_cluster(auth_token=TOKEN, max_message_bytes=65536)
    cluster.wait_leader(30)
    cluster.wait_all_know_leader(30)
    topic = "grpc_orders"
    p = await asyncio.to_thread(producer, cluster, topic, TOKEN)
    try:
        # Normal messages, with tags, keys and properties.
        receipts = []
        for i in range(20):
            m = message(topic, f"n{i}".encode(), tag="t", keys=f"k{i}", properties={"i": str(i)})
            receipts.append(await asyncio.to_thread(p.send, m))
        # Timer messages due in 3 s; every third one recalled; one due later as a sentinel.
        due_s = int(time.time()) + 3
        timers = [
            await asyncio.to_thread(
                p.send, message(topic, f"t{i}".encode(), delivery_timestamp=due_s)
            )
            for i in range(9)
        ]
        assert all(r.recall_handle for r in timers)
        recalled = timers[::3]
        for r in recalled:
            assert await asyncio.to_thread(p.recall_message, topic, r.recall_handle) == r.message_id
        sentinel = await asyncio.to_thread(
            p.send, message(topic, b"sentinel", delivery_timestamp=due_s + 2)
        )
        # A 4.x delay level as the DELAY property (level 1: 1 s).
        delayed = await asyncio.to_thread(
            p.send, message(topic, b"level1", properties={"DELAY": "1"})
        )
        assert not delayed.recall_handle
    finally:
        await asyncio.to_thread(p.shutdown)

    stored = Stored(cluster, topic, TOKEN)
    wanted = {r.message_id for r in receipts + timers + [sentinel, delayed]} - {
        r.message_id for r in recalled
    }

    async def all_arrived() -> bool:
        await stored.poll(1)
        return wanted <= set(stored.by_uniq_key())

    await wait_for(all_arrived, 30, "every message not recalled delivered", cluster)
    counts = stored.by_uniq_key()
    assert all(counts[i] == 1 for i in wanted), counts
    assert not {r.message_id for r in recalled} & set(counts), "a recalled message arrived"
    by_id = {m["properties"]["UNIQ_KEY"]: m for m in stored.copies}
    for r in timers:
        if r.message_id in by_id:
            assert by_id[r.message_id]["store_ms"] >= due_s * 1000, "a timer message came early"
    assert by_id[sentinel.message_id]["store_ms"] >= (due_s + 2) * 1000
    first = by_id[receipts[0].message_id]
    assert (first["tags"], first["keys"], first["properties"]["i"]) == ("t", ["k0"], "0")
    assert first["offset"] == receipts[0].offset

    # The sends are in the ops latency lines the Spark report reads, as HTTP produces are.
    def logged() -> int:
        text = "".join(
            f.read_text(errors="replace")
            for i in range(cluster.n)
            for f in cluster.node_dir(i).rglob("latency-*.jsonl")
        )
        return text.count(f'"topic":"{topic}"')

    async def all_logged() -> bool:
        return await asyncio.to_thread(logged) >= len(wanted)

    await wait_for(all_logged, 30, "the gRPC sends in the latency logs", cluster)

    # The token: none, a wrong one, then the bearer form.
    target = cluster.grpc_address(2)
    async with grpc.aio.insecure_channel(target) as channel:
        stub = spb_grpc.MessagingServiceStub(channel)
        route = spb.QueryRouteRequest(topic=pb.Resource(name=topic))
        for md in ((), (("authorization", "Bearer wrong"),)):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.QueryRoute(route, metadata=md, timeout=5)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # Nothing written: the server ends the stream before the client could write.
        stream = stub.Telemetry(timeout=5)
        assert await stream.code() == grpc.StatusCode.UNAUTHENTICATED
        auth = (("authorization", f"Bearer {TOKEN}"),)
        answer = await stub.QueryRoute(route, metadata=auth, timeout=5)
        assert answer.status.code == Code.OK
        assert len(answer.message_queues) == QUEUES
        ports = {a.port for a in answer.message_queues[0].broker.endpoints.addresses}
        assert ports == {cluster.grpc_port + i for i in range(3)}

        # Bad input: the protocol's codes, never a bare gRPC failure.
        far_ms = now_ms() + 2 * 366 * 86_400_000
        cases = [
            (raw_send("bad topic", b"x"), Code.ILLEGAL_TOPIC),
            (raw_send("rmq_sys_wheel_timer", b"x"), Code.ILLEGAL_TOPIC),
            (raw_send(topic, b"x" * 70_000), Code.MESSAGE_BODY_TOO_LARGE),
            (raw_send(topic, b""), Code.MESSAGE_BODY_EMPTY),
            (raw_send(topic, b"x", delivery_ms=far_ms), Code.ILLEGAL_DELIVERY_TIME),
            (raw_send(topic, b"x", message_group="g"), Code.UNSUPPORTED),
            (
                raw_send(topic, b"x", user_properties={"REAL_TOPIC": "t"}),
                Code.ILLEGAL_MESSAGE_PROPERTY_KEY,
            ),
            (raw_send(topic, b"x", user_properties={"DELAY": "-1"}), Code.ILLEGAL_DELIVERY_TIME),
            (raw_send(topic, b"x", keys=["a b"]), Code.ILLEGAL_MESSAGE_KEY),
        ]
        for req, code in cases:
            answer = await stub.SendMessage(req, metadata=auth, timeout=10)
            assert answer.status.code == code, (req, answer.status)
            assert answer.status.message
        bad_recall = spb.RecallMessageRequest(topic=pb.Resource(name=topic), recall_handle="nope")
        answer = await stub.RecallMessage(bad_recall, metadata=auth, timeout=5)
        assert answer.status.code == Code.BAD_REQUEST
        done = spb.RecallMessageRequest(
            topic=pb.Resource(name=topic), recall_handle=timers[1].recall_handle
        )
        answer = await stub.RecallMessage(done, metadata=auth, timeout=5)
        assert answer.status.code == Code.PRECONDITION_FAILED, answer.status  # delivered
        calls = [r async for r in stub.ReceiveMessage(spb.ReceiveMessageRequest(), metadata=auth)]
        assert [c.status.code for c in calls] == [Code.ILLEGAL_CONSUMER_GROUP]
        answer = await stub.EndTransaction(spb.EndTransactionRequest(), metadata=auth, timeout=5)
        assert answer.status.code == Code.UNSUPPORTED

    # Metrics per RPC and code, on the node that answered.
    req = urllib.request.Request(
        f"{cluster.urls[2]}/metrics", headers={"Authorization": f"Bearer {TOKEN}"}
    )
    text = await asyncio.to_thread(lambda: urllib.request.urlopen(req, timeout=5).read().decode())
    assert 'chronomq_grpc_requests_total{code="UNAUTHENTICATED",rpc="QueryRoute"} 2.0' in text
    assert 'chronomq_grpc_requests_total{code="UNAUTHENTICATED",rpc="Telemetry"} 1.0' in text
    assert 'chronomq_grpc_requests_total{code="ILLEGAL_TOPIC",rpc="SendMessage"} 2.0' in text
    assert "chronomq_grpc_request_seconds_bucket" in text


async def test_send_retried_across_a_leader_kill_is_stored_once(make_cluster: Any) -> None:
    cluster: LocalCluster = make_cluster()
    leader = cluster.wait_leader(30)
    cluster.wait_all_know_leader(30)
    topic = "grpc_failover"
    req = raw_send(topic, b"once", message_id="0A0B0C0D0E0F00112233445566778899AA")
    async with grpc.aio.insecure_channel(cluster.grpc_address(leader)) as channel:
        first = await spb_grpc.MessagingServiceStub(channel).SendMessage(req, timeout=10)
    assert first.status.code == Code.OK, first.status

    # An official producer sends through the kill; its own retries go to the other nodes.
    p = await asyncio.to_thread(producer, cluster, topic)
    acked: list[str] = []
    failed: list[str] = []
    stop = threading.Event()

    def send_loop() -> None:
        deadline = time.monotonic() + 60
        i = 0
        while not stop.is_set() and time.monotonic() < deadline:
            try:
                acked.append(p.send(message(topic, f"m{i}".encode())).message_id)
            except Exception as exc:
                failed.append(repr(exc))
            i += 1

    sender = threading.Thread(target=send_loop, daemon=True)
    sender.start()
    try:
        await wait_for(_at_least(acked, 20), 30, "20 sends before the kill", cluster)
        cluster.kill(leader, signal.SIGKILL)
        before = len(acked)
        # The same send (same message id) retried on another node once a new leader is up.
        other = next(i for i in range(cluster.n) if i != leader)
        async with grpc.aio.insecure_channel(cluster.grpc_address(other)) as channel:
            stub = spb_grpc.MessagingServiceStub(channel)

            async def retried() -> Any:
                try:
                    answer = await stub.SendMessage(req, timeout=10)
                except grpc.aio.AioRpcError:
                    return None
                return answer if answer.status.code == Code.OK else None

            again = await wait_for(retried, 30, "the retried send answered", cluster)
        assert again.entries[0].message_id == first.entries[0].message_id
        assert again.entries[0].offset == first.entries[0].offset
        await wait_for(_at_least(acked, before + 20), 30, "20 sends after the kill", cluster)
    finally:
        stop.set()
        await asyncio.to_thread(sender.join, 30)
        await asyncio.to_thread(p.shutdown)

    stored = Stored(cluster, topic)
    survivor = next(i for i in range(cluster.n) if i != leader)

    async def all_acked_stored() -> bool:
        await stored.poll(survivor)
        return set(acked) | {first.entries[0].message_id} <= set(stored.by_uniq_key())

    await wait_for(all_acked_stored, 30, "every acknowledged send stored", cluster)
    counts = stored.by_uniq_key()
    dups = {k: n for k, n in counts.items() if n > 1}
    assert not dups, f"stored twice: {dups}\n{dump_logs(cluster)}"
    assert counts[first.entries[0].message_id] == 1
    assert len(failed) <= 3, failed  # the client's retries outlast the election


def _at_least(items: list[str], n: int) -> Any:
    async def check() -> bool:
        return len(items) >= n

    return check


def test_docs_example_runs(make_cluster: Any) -> None:
    """The example of the docs' RocketMQ 5 clients page, as written but for the endpoints."""
    block = re.search(
        r"<!-- grpc-example:start -->\n```python\n(.*?)```\n<!-- grpc-example:end -->",
        CLIENTS_PAGE.read_text(),
        re.S,
    )
    assert block is not None
    written = "127.0.0.1:8180;127.0.0.1:8181;127.0.0.1:8182"
    assert written in block.group(1)
    cluster: LocalCluster = make_cluster()
    cluster.wait_leader(30)
    cluster.wait_all_know_leader(30)
    code = block.group(1).replace(written, cluster.grpc_endpoints)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[0].startswith("stored ") and lines[1].startswith("recalled "), lines
    # The consumer receives the message sent now (the recalled timer never comes).
    assert [ln.split()[2] for ln in lines[2:]] == ["b'paid"], lines


async def test_tls_endpoint(make_cluster: Any, tmp_path: Path) -> None:
    """With the HTTP API's certificate the endpoint speaks TLS only; a follower forwards a send
    to the leader over HTTPS."""
    cert, key = self_signed(tmp_path)
    cluster: LocalCluster = make_cluster(tls_cert_file=str(cert), tls_key_file=str(key))
    leader = cluster.wait_leader(60)
    follower = next(i for i in range(cluster.n) if i != leader)
    creds = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
    async with grpc.aio.secure_channel(cluster.grpc_address(follower), creds) as channel:
        stub = spb_grpc.MessagingServiceStub(channel)

        async def sent() -> Any:
            answer = await stub.SendMessage(raw_send("tls", b"x", message_id="T1"), timeout=10)
            return answer if answer.status.code == Code.OK else None

        answer = await wait_for(sent, 30, "a send over TLS", cluster)
        assert answer.entries[0].message_id == "T1"
    async with grpc.aio.insecure_channel(cluster.grpc_address(follower)) as channel:
        with pytest.raises(grpc.aio.AioRpcError):
            await spb_grpc.MessagingServiceStub(channel).Heartbeat(
                spb.HeartbeatRequest(), timeout=3
            )
