"""The client's produce retries: one Idempotency-Key for every attempt, Retry-After honoured."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from chronomq.cluster.cli.client import MAX_RETRY_AFTER_S, Client, ClientError, _retry_after_s

MakeServer = Callable[..., Awaitable[Any]]


def test_retry_after_is_read_in_seconds_and_bounded() -> None:
    assert _retry_after_s(None) == 0.0
    assert _retry_after_s("1") == 1.0
    assert _retry_after_s("0.2") == 0.2
    assert _retry_after_s("-3") == 0.0
    assert _retry_after_s("3600") == MAX_RETRY_AFTER_S
    assert _retry_after_s("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0


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
    assert seen_at[1] - seen_at[0] >= 0.1  # waited about Retry-After (0.5-1 x 0.2 s)


async def test_a_node_removed_from_the_cluster_sends_the_client_to_another(
    aiohttp_server: MakeServer,
) -> None:
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
        try:
            await client.produce("t", [{"body": "x"}])
        except ClientError as exc:
            assert exc.status == 410
        else:
            raise AssertionError("a 410 other than removed_from_cluster was retried")
