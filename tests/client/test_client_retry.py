"""``chronomq.aio.Client``, the request-level client: produce retries under one
Idempotency-Key, Retry-After honoured, a removed node left for another, a call pinned to one
node, a call limited to one attempt, admin calls; and the consumers' latency log."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp import web

import chronomq
import chronomq.aio
from chronomq._wire import (
    LEADER_CHANGE_S,
    LEADER_POLL_MAX_S,
    MAX_RETRY_AFTER_S,
    Attempts,
    Nodes,
    Wait,
    retry_after_s,
)
from chronomq.aio import Client
from chronomq.cluster.logs.schema import RecordType, Stage, decode
from chronomq.errors import RequestError, ServerError, UnavailableError

MakeServer = Callable[..., Awaitable[Any]]


def _first_node_first(self: Nodes, urls: list[str]) -> None:
    """``Nodes`` that start with the first URL rather than a random one."""
    self.urls, self.leader, self._preferred = list(urls), None, 0


def test_retry_after_is_read_in_seconds_and_bounded() -> None:
    assert retry_after_s(None) is None
    assert retry_after_s("1") == 1.0
    assert retry_after_s("0.2") == 0.2
    assert retry_after_s("-3") == 0.0
    assert retry_after_s("3600") == MAX_RETRY_AFTER_S
    assert retry_after_s("Wed, 21 Oct 2015 07:28:00 GMT") is None


async def test_a_produce_retried_after_429_and_an_unknown_outcome_keeps_its_key(
    aiohttp_server: MakeServer,
) -> None:
    answers = [
        (429, {"error": "overloaded", "message": "m", "field": None}, {"Retry-After": "0.2"}),
        (503, {"error": "commit_outcome_unknown", "message": "m", "field": None}, {}),
        (200, {"results": [{"msg_id": "00", "queue": 0, "offset": 0}]}, {}),
    ]
    keys: list[str | None] = []
    seen_at: list[float] = []

    async def produce(request: web.Request) -> web.Response:
        keys.append(request.headers.get("Idempotency-Key"))
        seen_at.append(time.monotonic())
        status, body, headers = answers[len(keys) - 1]
        return web.json_response(body, status=status, headers=headers)

    app = web.Application()
    app.router.add_post("/v1/topics/{topic}/messages", produce)
    server = await aiohttp_server(app)
    async with Client([str(server.make_url(""))], deadline_s=10) as client:
        result = await client.produce("t", [{"body": "x"}])
    assert result["results"][0]["offset"] == 0
    assert len(keys) == 3 and keys[0] and len(set(keys)) == 1
    assert seen_at[1] - seen_at[0] >= 0.2  # waited out Retry-After (0.2 s)


async def test_a_node_removed_from_the_cluster_sends_the_client_to_another(
    aiohttp_server: MakeServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(Nodes, "__init__", _first_node_first)
    hits: list[str] = []

    def node(name: str, status: int, body: dict[str, Any]) -> web.Application:
        async def produce(request: web.Request) -> web.Response:
            hits.append(name)
            return web.json_response(body, status=status)

        app = web.Application()
        app.router.add_post("/v1/topics/{topic}/messages", produce)
        return app

    gone = await aiohttp_server(
        node("gone", 410, {"error": "removed_from_cluster", "message": "m", "field": None})
    )
    live = await aiohttp_server(
        node("live", 200, {"results": [{"msg_id": "00", "queue": 0, "offset": 0}]})
    )
    urls = [str(gone.make_url("")), str(live.make_url(""))]
    async with Client(urls, deadline_s=10) as client:
        result = await client.produce("t", [{"body": "x"}])
    assert result["results"][0]["offset"] == 0
    assert hits == ["gone", "live"]


async def test_another_410_is_final(aiohttp_server: MakeServer) -> None:
    async def produce(request: web.Request) -> web.Response:
        return web.json_response({"error": "gone", "message": "m", "field": None}, status=410)

    app = web.Application()
    app.router.add_post("/v1/topics/{topic}/messages", produce)
    server = await aiohttp_server(app)
    async with Client([str(server.make_url(""))], deadline_s=10) as client:
        with pytest.raises(RequestError) as gone:
            await client.produce("t", [{"body": "x"}])
    assert gone.value.status == 410 and gone.value.code == "gone"


async def test_a_call_given_a_node_goes_to_that_node_only(aiohttp_server: MakeServer) -> None:
    """A node's own view (``url=``) is never asked of another node, even when it fails."""
    hits: list[str] = []

    def node(name: str, status: int) -> web.Application:
        async def status_of(request: web.Request) -> web.Response:
            hits.append(name)
            return web.json_response({"node_id": name}, status=status)

        app = web.Application()
        app.router.add_get("/v1/admin/node", status_of)
        return app

    busy = await aiohttp_server(node("busy", 503))
    idle = await aiohttp_server(node("idle", 200))
    urls = [str(busy.make_url("")).rstrip("/"), str(idle.make_url("")).rstrip("/")]
    async with Client(urls, deadline_s=0.5) as client:
        assert (await client.node(urls[1]))["node_id"] == "idle"
        with pytest.raises(chronomq.ServerError) as err:
            await client.node(urls[0])
    assert err.value.status == 503
    assert set(hits) == {"busy", "idle"} and hits.count("idle") == 1


def _not_leader(leader: str | None) -> bytes:
    body: dict[str, Any] = {"error": "not_leader" if leader else "no_leader", "message": "m"}
    if leader:
        body["leader"] = leader
    return orjson.dumps(body)


def _retry_after_1(name: str) -> str | None:
    """The headers of every 503 a node gives during a change of leader."""
    return "1" if name == "Retry-After" else None


def test_a_write_goes_at_once_to_the_leader_a_not_leader_answer_names() -> None:
    """The node's ``Retry-After`` (1 s) is for clients that cannot follow: this one goes to
    the named leader without waiting, and polls in short steps while none is known."""
    nodes = Nodes(["http://a", "http://b", "http://c"])
    nodes.learnt_leader("http://a")
    attempts = Attempts(nodes, write=True, deadline=100.0, rng=lambda: 1.0)
    step = attempts.answered("http://a", 503, _retry_after_1, _not_leader("http://b"), 10.0)
    assert step == Wait(0.0) and attempts.target() == "http://b"
    # The new leader has not confirmed its term yet: no leader to name. Short steps, each to
    # the next node, until the longest election is over.
    now, asked = 10.0, []
    while now < 10.0 + LEADER_CHANGE_S:
        base = attempts.target()
        asked.append(base)
        step = attempts.answered(base, 503, _retry_after_1, _not_leader(None), now)
        assert isinstance(step, Wait) and 0 < step.sleep_s <= LEADER_POLL_MAX_S, (now, step)
        now += step.sleep_s
    assert set(asked) == {"http://a", "http://b", "http://c"}
    # Past that the cluster has been leaderless for long: Retry-After is waited out again.
    step = attempts.answered(attempts.target(), 503, _retry_after_1, _not_leader(None), now)
    assert isinstance(step, Wait) and step.sleep_s >= 1.0


def test_nodes_naming_each_other_are_followed_once_each_then_in_short_steps() -> None:
    nodes = Nodes(["http://a", "http://b"])
    attempts = Attempts(nodes, write=True, deadline=100.0, rng=lambda: 0.0)
    waits = []
    for k in range(6):
        base = attempts.target() if k else "http://a"
        other = "http://b" if base == "http://a" else "http://a"
        step = attempts.answered(base, 503, _retry_after_1, _not_leader(other), 10.0)
        assert isinstance(step, Wait)
        waits.append(step.sleep_s)
    assert waits[:2] == [0.0, 0.0] and 0 < waits[2] <= LEADER_POLL_MAX_S
    assert waits[3:5] == [0.0, 0.0]  # a short step, then following again
    # A call pinned to one node does not follow (that node's own view was asked for).
    pinned = Attempts(nodes, False, 100.0, rng=lambda: 0.0, pinned="http://a")
    step = pinned.answered("http://a", 503, _retry_after_1, _not_leader("http://b"), 10.0)
    assert isinstance(step, Wait) and 0 < step.sleep_s <= LEADER_POLL_MAX_S
    assert pinned.target() == "http://a"


async def test_a_produce_follows_a_not_leader_answer_without_waiting_out_retry_after(
    aiohttp_server: MakeServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node that no longer leads answers 503 not_leader naming the leader, with a
    Retry-After longer than the client's deadline: the client goes to the leader at once
    (a client that waited it out would fail at once, the wait being past its deadline)."""
    monkeypatch.setattr(Nodes, "__init__", _first_node_first)
    hits: list[tuple[str, str | None]] = []
    leader = web.Application()
    stored = {"results": [{"msg_id": "00", "queue": 0, "offset": 0}]}

    async def store(request: web.Request) -> web.Response:
        hits.append(("leader", request.headers.get("Idempotency-Key")))
        return web.json_response(stored)

    leader.router.add_post("/v1/topics/{topic}/messages", store)
    leader_server = await aiohttp_server(leader)
    leader_url = str(leader_server.make_url("")).rstrip("/")

    async def refuse(request: web.Request) -> web.Response:
        hits.append(("old", request.headers.get("Idempotency-Key")))
        body = {"error": "not_leader", "message": "m", "field": None, "leader": leader_url}
        return web.json_response(body, status=503, headers={"Retry-After": "30"})

    old = web.Application()
    old.router.add_post("/v1/topics/{topic}/messages", refuse)
    old_server = await aiohttp_server(old)
    async with Client([str(old_server.make_url("")), leader_url], deadline_s=5) as client:
        result = await client.produce("t", [{"body": "x"}])
        assert client.leader == leader_url
    assert result == stored
    assert [who for who, _ in hits] == ["old", "leader"]
    assert hits[0][1] and hits[0][1] == hits[1][1]  # one key: stored once


def test_a_limit_of_attempts_ends_the_request_with_the_last_failure() -> None:
    """``limit`` counts attempts, not time: the deadline is far, the clock stands still."""
    nodes = Nodes(["http://a"])
    busy = b'{"error": "no_leader", "message": "m"}'

    def no_header(name: str) -> str | None:
        return None

    once = Attempts(nodes, False, deadline=1e9, rng=lambda: 0.5, limit=1)
    with pytest.raises(ServerError) as refused:
        once.answered("http://a", 503, no_header, busy, now=0.0)
    assert refused.value.status == 503 and refused.value.code == "no_leader"
    with pytest.raises(UnavailableError, match="ConnectionRefusedError"):
        Attempts(nodes, False, 1e9, limit=1).failed("http://a", ConnectionRefusedError(), 0.0)

    twice = Attempts(nodes, False, deadline=1e9, rng=lambda: 0.5, limit=2)
    assert isinstance(twice.answered("http://a", 503, no_header, busy, now=0.0), Wait)
    with pytest.raises(UnavailableError):
        twice.failed("http://a", TimeoutError(), now=0.0)
    # No limit: the deadline alone ends it.
    unlimited = Attempts(nodes, False, deadline=1e9, rng=lambda: 0.5)
    for _ in range(20):
        assert isinstance(unlimited.failed("http://a", TimeoutError(), now=0.0), Wait)
    with pytest.raises(ValueError, match="at least one attempt"):
        Attempts(nodes, False, 1e9, limit=0)


async def test_a_call_of_one_attempt_is_not_retried(aiohttp_server: MakeServer) -> None:
    """``attempts=1``: the first answer (its status too) or the first failure, within the
    call's own ``timeout_s``; what the drills ask of one node."""
    hits: list[str] = []

    async def members(request: web.Request) -> web.Response:
        hits.append(request.method)
        if len(hits) == 1:
            return web.json_response({"error": "no_leader", "message": "m"}, status=503)
        return web.json_response({"status": "added", "id": 3}, status=201)

    async def slow(request: web.Request) -> web.Response:
        hits.append("slow")
        await asyncio.sleep(2)
        return web.json_response({})

    async def removed(request: web.Request) -> web.Response:
        hits.append("removed")
        body = {"error": "removed_from_cluster", "message": "m"}
        return web.json_response(body, status=410)

    app = web.Application()
    app.router.add_post("/v1/admin/members", members)
    app.router.add_get("/v1/admin/node", slow)
    app.router.add_get("/v1/topics", removed)
    server = await aiohttp_server(app)
    url = str(server.make_url("")).rstrip("/")
    async with Client([url], deadline_s=10, request_timeout_s=15) as client:
        with pytest.raises(ServerError) as busy:
            await client.request("POST", "/v1/admin/members", json_body={}, url=url, attempts=1)
        assert busy.value.status == 503 and hits == ["POST"]
        # The next call, left to the retry policy, is answered 201 at its first attempt.
        status, body = await client.request_with_status(
            "POST", "/v1/admin/members", json_body={}, url=url
        )
        assert (status, body) == (201, {"status": "added", "id": 3})

        hits.clear()
        started = time.monotonic()
        with pytest.raises(UnavailableError, match="GET /v1/admin/node failed in 1 attempt"):
            await client.node(url, attempts=1, timeout_s=0.3)
        assert time.monotonic() - started < 1.5 and hits == ["slow"]

        hits.clear()
        with pytest.raises(ServerError) as gone:  # without the limit, asked until the deadline
            await client.request("GET", "/v1/topics", url=url, attempts=1)
        assert (gone.value.status, gone.value.code) == (410, "removed_from_cluster")
        assert hits == ["removed"]


async def test_admin_calls_send_their_routes(aiohttp_server: MakeServer) -> None:
    seen: list[tuple[str, str, object]] = []

    async def any_route(request: web.Request) -> web.Response:
        body = await request.json() if request.can_read_body else None
        seen.append((request.method, request.path_qs, body))
        return web.json_response({"offsets": []})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", any_route)
    server = await aiohttp_server(app)
    async with Client([str(server.make_url(""))]) as client:
        await client.cluster()
        await client.schedule()
        await client.set_schedule(mode="async")
        await client.timer_status()
        await client.timer_switches(stop_dequeue=True)
        await client.admin_config()
        await client.patch_config({"ops_log_sample_rate": 0.5})
        await client.transfer_leadership(2, timeout_ms=100)
        await client.transfer_leadership(None)
        await client.create_topic("t", 3)
        await client.topics()
        assert await client.offsets("g") == []
        await client.cancel_timer("AB")
        await client.request("DELETE", "/v1/admin/members/3", write=True)
    assert seen == [
        ("GET", "/v1/admin/cluster", None),
        ("GET", "/v1/admin/schedule", None),
        ("PATCH", "/v1/admin/schedule", {"mode": "async"}),
        ("GET", "/v1/admin/timer", None),
        ("POST", "/v1/admin/timer/switches", {"stop_dequeue": True}),
        ("GET", "/v1/admin/config", None),
        ("PATCH", "/v1/admin/config", {"ops_log_sample_rate": 0.5}),
        ("POST", "/v1/admin/leadership/transfer", {"to": 2, "timeout_ms": 100}),
        ("POST", "/v1/admin/leadership/transfer", {}),
        ("PUT", "/v1/topics/t", {"queues": 3}),
        ("GET", "/v1/topics", None),
        ("GET", "/v1/groups/g/offsets", None),
        ("DELETE", "/v1/timers/AB", None),
        ("DELETE", "/v1/admin/members/3", None),
    ]


async def test_no_answer_until_the_deadline_is_unavailable() -> None:
    async with Client(["http://127.0.0.1:9"], deadline_s=0.3) as client:
        with pytest.raises(UnavailableError, match="GET /v1/topics failed until the deadline"):
            await client.topics()


T0 = 1_700_000_000_000


def _one_queue_node(page: list[dict[str, Any]]) -> web.Application:
    """A node with topic ``orders`` of one queue holding ``page``."""

    async def describe(request: web.Request) -> web.Response:
        return web.json_response(
            {"queues": [{"queue": 0, "min_offset": 0, "max_offset": len(page)}]}
        )

    async def offsets(request: web.Request) -> web.Response:
        return web.json_response({"offsets": []})

    async def pull(request: web.Request) -> web.Response:
        start = int(request.query["offset"])
        if request.match_info["topic"] != "orders" or start >= len(page):
            await asyncio.sleep(int(request.query.get("wait_ms", "0")) / 1000)
            return web.json_response({"messages": [], "next_offset": start})
        return web.json_response({"messages": page[start:], "next_offset": len(page)})

    app = web.Application()
    app.router.add_get("/v1/topics/{topic}", describe)
    app.router.add_get("/v1/groups/{group}/offsets", offsets)
    app.router.add_get("/v1/topics/{topic}/queues/{queue}/messages", pull)
    return app


def _read_latency(directory: Path) -> list[Any]:
    kind = RecordType.LATENCY
    return [
        decode(line, kind)
        for path in sorted(directory.glob(f"{kind}-*.jsonl"))
        for line in path.read_bytes().splitlines()
    ]


@pytest.mark.parametrize("flavour", ["sync", "aio"])
async def test_a_consumer_logs_every_message_it_hands_out(
    aiohttp_server: MakeServer, tmp_path: Path, flavour: str
) -> None:
    page = [
        {"msg_id": f"{i:032X}", "topic": "orders", "queue": 0, "offset": i, "body": "x"}
        | {"store_ms": T0 + i, "properties": {}}
        for i in range(3)
    ]
    server = await aiohttp_server(_one_queue_node(page))
    url = str(server.make_url(""))
    options: dict[str, Any] = {"latency_log_dir": tmp_path, "latency_log_name": "c1"}
    options |= {"fetch_wait_ms": 100, "auto_commit": False}
    if flavour == "sync":

        def consume() -> list[str]:
            with chronomq.Consumer(url, "g", "orders", **options) as consumer:
                return [consumer.poll(5).msg_id for _ in page]  # type: ignore[union-attr]

        got_ids = await asyncio.to_thread(consume)
    else:
        async with chronomq.aio.Consumer(url, "g", "orders", **options) as consumer:
            got_ids = [(await consumer.poll(5)).msg_id for _ in page]  # type: ignore[union-attr]
    assert got_ids == [m["msg_id"] for m in page]
    got = _read_latency(tmp_path / "c1")
    assert [(r.msg_id, r.stage, r.store_ms) for r in got] == [
        (m["msg_id"], Stage.CONSUMED, m["store_ms"]) for m in page
    ]
    assert all(r.consumed_ms >= T0 for r in got)
