"""The client's request policy against tiny aiohttp servers: paths on the wire, Retry-After,
failover, idempotency keys; and its cores (batching, consumer bookkeeping) with fake clocks."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web

import chronomq
import chronomq.aio
from chronomq import _api
from chronomq._batch import Batcher
from chronomq._consume import ConsumerState, FetchStart
from chronomq._http_aio import AioTransport
from chronomq._http_sync import SyncTransport
from chronomq._model import MessageData
from chronomq._policy import RequestPolicy
from chronomq._wire import Attempts, Nodes, Wait, path, query, retry_after_s
from chronomq.aio import Client

MakeServer = Callable[..., Awaitable[Any]]
STORED = {"results": [{"msg_id": "AB", "topic": "t", "queue": 0, "offset": 7}], "duplicate": False}


def test_path_segments_are_percent_encoded() -> None:
    assert path("v1", "topics", "%RETRY%default", "queues", 0) == (
        "/v1/topics/%25RETRY%25default/queues/0"
    )
    assert path("v1", "timers", "a/b c") == "/v1/timers/a%2Fb%20c"
    assert query(topic="%DLQ%cdc", offset=3, skip=None) == "?topic=%25DLQ%25cdc&offset=3"


async def test_every_client_sends_the_retry_topic_of_group_default_as_is(
    aiohttp_server: MakeServer,
) -> None:
    """``%de`` in ``%RETRY%default`` must reach the node encoded, whichever client sends it,
    in the path and in the query."""
    paths: list[tuple[str, str]] = []
    queries: list[str] = []

    async def pull(request: web.Request) -> web.Response:
        paths.append((request.match_info["topic"], request.raw_path))
        return web.json_response({"messages": [], "next_offset": 0, "max_offset": 0})

    async def offsets(request: web.Request) -> web.Response:
        queries.append(request.query["topic"])
        return web.json_response({"group": "default", "offsets": []})

    app = web.Application()
    app.router.add_get("/v1/topics/{topic}/queues/{queue}/messages", pull)
    app.router.add_get("/v1/groups/{group}/offsets", offsets)
    server = await aiohttp_server(app)
    url = str(server.make_url("")).rstrip("/")
    topic = "%RETRY%default"

    sync = SyncTransport(RequestPolicy([url]))
    await asyncio.to_thread(sync.call, _api.pull(topic, 0, 0, 1, 0))
    await asyncio.to_thread(sync.call, _api.group_offsets("default", topic))
    sync.close()
    aio = AioTransport(RequestPolicy([url]))
    await aio.call(_api.pull(topic, 0, 0, 1, 0))
    await aio.call(_api.group_offsets("default", topic))
    await aio.close()
    async with Client([url]) as client:
        await client.pull(topic, 0, 0)
        await client.offsets("default", topic)
    assert [p[0] for p in paths] == [topic] * 3
    assert all(p[1].startswith("/v1/topics/%25RETRY%25default/queues/0/") for p in paths)
    assert queries == [topic] * 3


async def test_every_client_sends_the_same_headers_and_body(aiohttp_server: MakeServer) -> None:
    """The token, the user agent, the JSON body and a request's own headers reach the node
    alike from the sync and the asyncio transport."""
    seen: list[tuple[dict[str, str], bytes]] = []

    async def produce(request: web.Request) -> web.Response:
        seen.append((dict(request.headers), await request.read()))
        return web.json_response(STORED)

    app = web.Application()
    app.router.add_post("/v1/topics/{topic}/messages", produce)
    server = await aiohttp_server(app)
    url = str(server.make_url(""))
    req = _api.produce("t", [{"body": "x"}], "key-1")

    sync = SyncTransport(RequestPolicy([url], token="s3cret"))
    await asyncio.to_thread(sync.call, req)
    sync.close()
    aio = AioTransport(RequestPolicy([url], token="s3cret"))
    await aio.call(req)
    await aio.close()
    assert len(seen) == 2
    for headers, body in seen:
        assert headers["Authorization"] == "Bearer s3cret"
        assert headers["User-Agent"] == "chronomq-python"
        assert headers["Content-Type"] == "application/json"
        assert headers["Idempotency-Key"] == "key-1"
        assert body == b'{"messages":[{"body":"x"}]}'


def _flaky_node(
    answers: list[tuple[int, dict[str, Any], dict[str, str]]], log: list[Any]
) -> web.Application:
    async def produce(request: web.Request) -> web.Response:
        log.append((time.monotonic(), request.headers.get("Idempotency-Key"), await request.json()))
        status, body, headers = answers[min(len(log), len(answers)) - 1]
        return web.json_response(body, status=status, headers=headers)

    app = web.Application()
    app.router.add_post("/v1/topics/{topic}/messages", produce)
    return app


BUSY = (
    503,
    {"error": "commit_outcome_unknown", "message": "retry with the same key", "field": None},
    {"Retry-After": "1"},
)
"""A 503 whose Retry-After is waited out (a change of leader's is not: see
``test_client_retry``)."""


async def test_sync_producer_waits_out_retry_after_and_keeps_its_key(
    aiohttp_server: MakeServer,
) -> None:
    log: list[Any] = []
    server = await aiohttp_server(_flaky_node([BUSY, (200, STORED, {})], log))

    def send() -> chronomq.SendResult:
        with chronomq.Producer([str(server.make_url(""))], linger_ms=0) as producer:
            return producer.send("t", "x", keys="k", tags="a", delay_ms=5000)

    result = await asyncio.to_thread(send)
    assert result == chronomq.SendResult(msg_id="AB", topic="t", queue=0, offset=7)
    assert len(log) == 2 and log[1][0] - log[0][0] >= 1.0  # not a moment sooner
    assert log[0][1] and log[0][1] == log[1][1]
    assert log[0][2] == {"messages": [{"body": "x", "keys": ["k"], "tags": "a", "delay_ms": 5000}]}


async def test_async_producer_waits_out_retry_after_and_keeps_its_key(
    aiohttp_server: MakeServer,
) -> None:
    log: list[Any] = []
    server = await aiohttp_server(_flaky_node([BUSY, (200, STORED, {})], log))
    async with chronomq.aio.Producer([str(server.make_url(""))], linger_ms=0) as producer:
        result = await producer.send("t", b"\xff", delay_level=3)
    assert result.offset == 7
    assert len(log) == 2 and log[1][0] - log[0][0] >= 1.0
    assert log[0][1] and log[0][1] == log[1][1]
    assert log[0][2] == {"messages": [{"body_base64": "/w==", "delay_level": 3}]}


async def test_a_retry_after_past_the_deadline_fails_at_once(aiohttp_server: MakeServer) -> None:
    log: list[Any] = []
    busy = (503, BUSY[1], {"Retry-After": "5"})
    server = await aiohttp_server(_flaky_node([busy], log))
    async with chronomq.aio.Producer([str(server.make_url(""))], deadline_s=2) as producer:
        t0 = time.monotonic()
        with pytest.raises(chronomq.ServerError) as err:
            await producer.send("t", "x")
    assert err.value.status == 503 and err.value.code == "commit_outcome_unknown"
    assert len(log) == 1 and time.monotonic() - t0 < 1.0


async def test_failover_to_the_next_node_and_to_the_leader_it_names(
    aiohttp_server: MakeServer,
) -> None:
    with socket.socket() as s:  # a port nobody listens on: connection refused
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    leader_log: list[Any] = []
    leader = await aiohttp_server(_flaky_node([(200, STORED, {})], leader_log))
    leader_url = str(leader.make_url("")).rstrip("/")
    follower_log: list[Any] = []
    follower = await aiohttp_server(
        _flaky_node([(200, STORED, {"X-Chronomq-Leader": leader_url})], follower_log)
    )
    t = SyncTransport(RequestPolicy([dead, str(follower.make_url(""))]))
    t.policy.nodes._preferred = 0
    req = _api.produce("t", [{"body": "x"}], "key-1")
    for _ in range(3):
        await asyncio.to_thread(t.call, req)
    t.close()
    assert len(follower_log) == 1 and len(leader_log) == 2  # then straight to the leader
    assert t.policy.nodes.leader == leader_url


async def test_a_request_error_is_final_and_names_the_field(aiohttp_server: MakeServer) -> None:
    log: list[Any] = []
    bad = {"error": "invalid_input", "message": "unknown field", "field": "messages[0].bodyx"}
    server = await aiohttp_server(_flaky_node([(400, bad, {})], log))
    with pytest.raises(chronomq.RequestError) as err:
        await asyncio.to_thread(
            SyncTransport(RequestPolicy([str(server.make_url(""))])).call,
            _api.produce("t", [{"bodyx": 1}], "k"),
        )
    assert err.value.field == "messages[0].bodyx" and len(log) == 1


def test_attempts_honour_retry_after_with_a_fake_clock() -> None:
    nodes = Nodes(["http://a", "http://b"])
    attempts = Attempts(nodes, write=True, deadline=100.0, rng=lambda: 0.0)
    headers = {"Retry-After": "2"}
    step = attempts.answered("http://a", 429, headers.get, b'{"error":"overloaded"}', 10.0)
    assert step == Wait(2.0)
    step = attempts.answered("http://a", 503, {}.get, b"{}", 12.0)
    assert isinstance(step, Wait) and step.sleep_s < 0.1  # no header: exponential back-off
    assert retry_after_s("3600") == 60.0 and retry_after_s("soon") is None
    with pytest.raises(chronomq.ServerError):
        Attempts(nodes, True, deadline=11.0).answered("http://a", 429, headers.get, b"{}", 10.0)


def test_request_policy_prepares_what_every_attempt_sends() -> None:
    policy = RequestPolicy("http://a, http://b/", token="s3cret", deadline_s=4.0)
    assert policy.nodes.urls == ["http://a", "http://b"] and policy.ssl_context() is None
    req = _api.produce("t", [{"body": "x"}], "key-1")
    out = policy.prepare(req)
    assert (out.method, out.target) == ("POST", "/v1/topics/t/messages")
    assert out.body == b'{"messages":[{"body":"x"}]}' and out.timeout_s == 15.0
    assert out.headers == {
        "User-Agent": "chronomq-python",
        "Content-Type": "application/json",
        "Authorization": "Bearer s3cret",
        "Idempotency-Key": "key-1",
    }
    long_poll = RequestPolicy(["http://a"]).prepare(_api.pull("t", 0, 0, 32, 5000))
    assert long_poll.body is None and long_poll.timeout_s == 20.0
    assert "Authorization" not in long_poll.headers
    assert policy.attempts(req, now=10.0).deadline == 14.0
    assert policy.attempts(req, now=10.0, deadline_s=1.5).deadline == 11.5
    assert RequestPolicy(["http://a", "https://b"]).ssl_context() is not None


# ---------------------------------------------------------------------- cores


def test_batcher_lingers_fills_and_flushes() -> None:
    b: Batcher[int] = Batcher(max_batch=3, linger_s=0.01, max_pending=5)
    b.add("a", {"body": "1"}, 1, now=0.0)
    b.add("b", {"body": "2"}, 2, now=0.001)
    assert b.take(0.005) == ("", []) and b.wait_s(0.005) == pytest.approx(0.005)
    assert b.take(0.0105) == ("a", [({"body": "1"}, 1)])
    for i in range(3):
        b.add("c", {"body": str(i)}, 10 + i, now=0.0105)
    assert b.full() is False and b.wait_s(0.0105) == 0.0
    assert b.take(0.0105)[0] == "c"  # full: goes at once, before b is due
    assert b.take(0.0, flush=True) == ("b", [({"body": "2"}, 2)])
    assert b.wait_s(1.0) is None and b.pending == 0


def _msg(topic: str, queue: int, offset: int) -> MessageData:
    return MessageData(
        msg_id=f"{topic}{queue}{offset}", topic=topic, queue=queue, offset=offset, body=b""
    )


def test_consumer_state_plans_queues_and_commits_only_finished_messages() -> None:
    s = ConsumerState(
        "default",
        ["orders"],
        start="latest",
        auto_commit_interval_s=1.0,
        refresh_interval_s=5.0,
        now=0.0,
    )
    assert s.topics == ["orders", "%RETRY%default"]
    described = {
        "queues": [
            {"queue": 0, "min_offset": 2, "max_offset": 9},
            {"queue": 1, "min_offset": 0, "max_offset": 4},
        ]
    }
    plan = s.plan("orders", described, [{"topic": "orders", "queue": 1, "offset": 3}])
    assert plan == [FetchStart("orders", 0, 9), FetchStart("orders", 1, 3)]
    assert s.plan("%RETRY%default", None, []) == []  # not created yet
    retry = {"queues": [{"queue": 0, "min_offset": 0, "max_offset": 1}]}
    assert s.plan("%RETRY%default", retry, []) == [FetchStart("%RETRY%default", 0, 0)]
    assert s.plan("orders", described, []) == []  # already read
    assert s.to_commit() == {}
    a, b = _msg("orders", 1, 3), _msg("orders", 1, 4)
    s.hand_out(a)
    assert s.to_commit() == {}  # in hand, not finished
    s.hand_out(b)
    assert s.to_commit() == {("orders", 1): 4}
    s.commit_done(("orders", 1), 4)
    s.finish_in_hand()
    assert s.to_commit() == {("orders", 1): 5}
    s.commit_done(("orders", 1), 5)
    s.finish(a)  # finishing an older message never moves back
    assert s.to_commit() == {}
    assert s.commit_due(0.5) is False and s.commit_due(1.0) is True
    assert s.wait_s(0.0, 0.5) == 0.0 and s.refresh_due(0.0)
    s.refreshed(0.0)
    s.auto_committed(1.0)
    assert s.wait_s(1.0, 10.0) == 1.0
    s.refresh_soon(1.0, 0.2)
    assert s.wait_s(1.0, 10.0) == pytest.approx(0.2)
