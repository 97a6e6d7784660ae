"""The bearer-token middleware, against aiohttp apps served by ``aiohttp_client``."""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web

from chronomq.cluster.httpapi.api import add_routes
from chronomq.cluster.httpapi.openapi import ROUTES
from chronomq.cluster.node.auth import auth_middleware, bearer_token_matches, open_routes

TOKEN = "t0ken-with-enough-characters"
Client = Any
MakeClient = Callable[..., Awaitable[Client]]


async def ok(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok", "path": request.path})


def small_app(token: str, *, metrics_public: bool = False) -> web.Application:
    app = web.Application(middlewares=[auth_middleware(token, metrics_public=metrics_public)])
    for path in ("/healthz", "/readyz", "/metrics", "/v1/topics", "/v1/admin/config"):
        app.router.add_get(path, ok)
    app.router.add_post("/v1/topics/{topic}/messages", ok)
    return app


def fill(path: str) -> str:
    return re.sub(r"\{[^}]+\}", "1", path)


async def test_without_a_token_configured_everything_is_open(
    aiohttp_client: MakeClient,
) -> None:
    client = await aiohttp_client(small_app(""))
    for path in ("/v1/topics", "/v1/admin/config", "/metrics"):
        assert (await client.get(path)).status == 200
    assert (await client.post("/v1/topics/t/messages")).status == 200


async def test_a_missing_header_is_401_with_the_error_shape_and_a_bearer_challenge(
    aiohttp_client: MakeClient,
) -> None:
    client = await aiohttp_client(small_app(TOKEN))
    for method, path in (("GET", "/v1/topics"), ("POST", "/v1/topics/t/messages")):
        r = await client.request(method, path)
        assert r.status == 401, (method, path)
        assert r.headers["WWW-Authenticate"].startswith("Bearer ")
        body = await r.json()
        assert body["error"] == "unauthorized"
        assert body["field"] == "Authorization"
        assert body["message"]


@pytest.mark.parametrize(
    "header",
    [
        f"Bearer {TOKEN}x",
        f"Bearer {TOKEN[:-1]}",
        "Bearer ",
        "Bearer",
        TOKEN,
        f"Basic {TOKEN}",
        f"Token {TOKEN}",
        f"Bearer {TOKEN.upper()}",
        "Bearer t0ken-with-enough-charactérs",
    ],
)
async def test_a_wrong_token_or_scheme_is_401_invalid_token(
    aiohttp_client: MakeClient, header: str
) -> None:
    client = await aiohttp_client(small_app(TOKEN))
    r = await client.get("/v1/admin/config", headers={"Authorization": header})
    assert r.status == 401
    assert 'error="invalid_token"' in r.headers["WWW-Authenticate"]
    assert (await r.json())["field"] == "Authorization"


@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER", "bEaReR"])
async def test_the_scheme_is_matched_in_any_case(aiohttp_client: MakeClient, scheme: str) -> None:
    client = await aiohttp_client(small_app(TOKEN))
    r = await client.get("/v1/topics", headers={"Authorization": f"{scheme} {TOKEN}"})
    assert r.status == 200


async def test_probes_are_open_and_metrics_only_when_public(aiohttp_client: MakeClient) -> None:
    closed = await aiohttp_client(small_app(TOKEN))
    for path in ("/healthz", "/readyz"):
        assert (await closed.get(path)).status == 200
        assert (await closed.head(path)).status == 200
    assert (await closed.get("/metrics")).status == 401
    # An open path is open to GET only: another method needs the token like any route.
    assert (await closed.post("/healthz")).status == 401

    public = await aiohttp_client(small_app(TOKEN, metrics_public=True))
    assert (await public.get("/metrics")).status == 200
    assert (await public.get("/v1/topics")).status == 401


async def test_unknown_paths_do_not_say_whether_a_route_exists(
    aiohttp_client: MakeClient,
) -> None:
    client = await aiohttp_client(small_app(TOKEN))
    for path in ("/v1/nothing-here", "/v1/topics/t/messages", "/healthz/", "/HEALTHZ"):
        assert (await client.get(path)).status == 401, path
    auth = {"Authorization": f"Bearer {TOKEN}"}
    assert (await client.get("/v1/nothing-here", headers=auth)).status == 404
    assert (await client.get("/v1/topics/t/messages", headers=auth)).status == 405


async def test_every_route_of_the_real_app_needs_the_token(aiohttp_client: MakeClient) -> None:
    """The node's own routes (as /openapi.json lists them) behind the real middleware: no
    handler runs without the token, so no broker is needed to see every 401."""
    app = web.Application(middlewares=[auth_middleware(TOKEN)])
    add_routes(app)
    client = await aiohttp_client(app)
    exempt = set(open_routes(False))
    for method, path in ROUTES:
        if (method, path) in exempt:
            continue
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = await client.request(method, fill(path), headers=headers, data=b"{}")
            assert r.status == 401, (method, path, headers)
    assert (await client.get("/healthz")).status == 200


def test_token_comparison_takes_bytes_and_any_header_text() -> None:
    token = TOKEN.encode()
    assert bearer_token_matches(f"Bearer {TOKEN}", token)
    assert bearer_token_matches(f"  bearer   {TOKEN}  ", token)
    assert not bearer_token_matches(None, token)
    assert not bearer_token_matches(f"Bearer {TOKEN}", b"")
    # Lone surrogates (what a parser may leave of undecodable bytes) never raise or match.
    assert not bearer_token_matches("Bearer \udcff" + TOKEN, token)
    assert bearer_token_matches("Bearer pässwörd", "pässwörd".encode())
