"""Where a node's token travels: only to members' URLs (:mod:`chronomq.cluster.node.peerhttp`)."""

from __future__ import annotations

import asyncio
import ssl
import urllib.error
from collections.abc import Awaitable, Callable
from types import SimpleNamespace
from typing import Any

from aiohttp import web

from chronomq.cluster.config.nodeconfig import load
from chronomq.cluster.node.broker import MEMBER_PREFIX, REMOVED, Broker
from chronomq.cluster.node.peerhttp import PeerHttp, origin

TOKEN = "peer-token-0123456789"
MakeServer = Callable[..., Awaitable[Any]]


def peer(members: list[str], *, https_only: bool = False) -> PeerHttp:
    return PeerHttp(
        token=TOKEN,
        member_urls=lambda: members,
        ssl_context=ssl.create_default_context(),
        https_only=https_only,
    )


def test_origins_compare_scheme_host_and_port() -> None:
    assert origin("http://LOCALHOST/x?y") == ("http", "localhost", 80)
    assert origin("https://127.0.0.1:8443/v1") == ("https", "127.0.0.1", 8443)
    assert origin("ftp://127.0.0.1:21") is None
    assert origin("not a url") is None
    assert origin("http://[::1]:8080") == ("http", "::1", 8080)


def test_the_token_goes_to_member_origins_only() -> None:
    p = peer(["http://127.0.0.1:8081", "http://127.0.0.1:8082/"])
    auth = {"Authorization": f"Bearer {TOKEN}"}
    assert p.headers("http://127.0.0.1:8081/v1/topics/t/messages?x=1") == auth
    assert p.headers("http://127.0.0.1:8082") == auth
    for stranger in (
        "http://127.0.0.1:8083/v1/admin/node",  # another port
        "http://127.0.0.2:8081/v1/admin/node",  # another host
        "https://127.0.0.1:8081/v1/admin/node",  # another scheme
        "http://localhost:8081/v1/admin/node",  # another name for the same host
        "http://evil.example/http://127.0.0.1:8081",
        "",
    ):
        assert p.headers(stranger) == {}, stranger


def test_a_callers_authorization_is_never_relayed() -> None:
    p = peer(["http://127.0.0.1:8081"])
    given = {"Authorization": "Bearer the-clients", "Idempotency-Key": "k"}
    assert p.headers("http://10.0.0.9:1/", given) == {"Idempotency-Key": "k"}
    assert p.headers("http://127.0.0.1:8081/", given)["Authorization"] == f"Bearer {TOKEN}"


def test_a_tls_node_never_sends_the_token_in_clear() -> None:
    p = peer(["http://127.0.0.1:8081", "https://127.0.0.1:8082"], https_only=True)
    assert p.headers("http://127.0.0.1:8081/v1/admin/node") == {}
    assert "Authorization" in p.headers("https://127.0.0.1:8082/v1/admin/node")


def test_without_a_token_nothing_is_attached() -> None:
    p = PeerHttp(
        token="",
        member_urls=lambda: ["http://127.0.0.1:8081"],
        ssl_context=ssl.create_default_context(),
    )
    assert p.headers("http://127.0.0.1:8081/") == {}


def test_members_are_the_configured_peers_and_those_added_at_runtime(tmp_path: Any) -> None:
    toml = tmp_path / "node.toml"
    toml.write_text(
        f'node_id = 0\ndata_dir = "{tmp_path}"\nauth_token = "{TOKEN}"\n'
        'peers = [{id = 1, raft = "127.0.0.1:9081", http = "http://127.0.0.1:8081"},\n'
        '         {id = 2, raft = "127.0.0.1:9082", http = "http://127.0.0.1:8082"}]\n'
    )
    config = load(toml, environ={})
    kv: dict[str, Any] = {}
    raftlog = SimpleNamespace(store=SimpleNamespace(kv=kv), add_apply_listener=lambda f: None)
    broker = Broker(config, raftlog)  # type: ignore[arg-type]
    client = broker.peer_client
    assert client.is_member("http://127.0.0.1:8081/v1/admin/node")
    assert not client.is_member("http://127.0.0.1:8083/v1/admin/node")
    # What POST /v1/admin/members commits, and what DELETE commits.
    kv[f"{MEMBER_PREFIX}3"] = "127.0.0.1:9083 http://127.0.0.1:8083 127.0.0.1:10083"
    kv[f"{MEMBER_PREFIX}2"] = REMOVED
    assert client.is_member("http://127.0.0.1:8083/v1/admin/node")
    assert not client.is_member("http://127.0.0.1:8082/v1/admin/node")
    assert client.is_member("http://127.0.0.1:8081/v1/admin/node")


async def test_real_requests_carry_the_token_to_members_and_follow_no_redirect(
    aiohttp_server: MakeServer,
) -> None:
    seen: dict[str, list[str | None]] = {"member": [], "stranger": []}

    def recorder(name: str) -> Any:
        async def handler(request: web.Request) -> web.Response:
            seen[name].append(request.headers.get("Authorization"))
            if request.path == "/redirect":
                raise web.HTTPFound(str(stranger.make_url("/landing")))
            return web.json_response({"ok": True})

        return handler

    def app(name: str) -> web.Application:
        a = web.Application()
        a.router.add_route("*", "/{tail:.*}", recorder(name))
        return a

    member = await aiohttp_server(app("member"))
    stranger = await aiohttp_server(app("stranger"))
    p = peer([str(member.make_url(""))])
    await p.start()
    try:
        async with p.request("GET", str(member.make_url("/v1/admin/node"))) as r:
            assert r.status == 200
        async with p.request("POST", str(stranger.make_url("/v1/admin/node")), json={}) as r:
            assert r.status == 200
        async with p.request("GET", str(member.make_url("/redirect"))) as r:
            assert r.status == 302  # not followed: the token stays with the member

        def blocking() -> list[int]:
            statuses = []
            with p.urlopen(str(member.make_url("/v1/admin/timer/log")), 5) as r:
                statuses.append(r.status)
            with p.urlopen(str(stranger.make_url("/v1/admin/timer/log")), 5) as r:
                statuses.append(r.status)
            try:
                p.urlopen(str(member.make_url("/redirect")), 5)
            except urllib.error.HTTPError as exc:
                statuses.append(exc.code)
            return statuses

        assert await asyncio.to_thread(blocking) == [200, 200, 302]
    finally:
        await p.close()
    auth = f"Bearer {TOKEN}"
    assert seen["member"] == [auth, auth, auth, auth]
    assert seen["stranger"] == [None, None]
