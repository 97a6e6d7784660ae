"""The HTTP API of a real 3-node cluster with a bearer token, and with TLS.

Every route the node's own ``/openapi.json`` lists is tried without the token, with a wrong
one and with the right one under a lowercase scheme, on a follower (so writes are forwarded
to the leader, which must accept the follower's own token). The TLS cluster shares one
self-signed certificate made here with ``openssl``; nodes forward and gather the cluster view
over HTTPS, and plain http gets no answer.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import re
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from chronomq.aio import Client
from chronomq.cluster.node.tls import client_context
from chronomq.cluster.process.launcher import LocalCluster
from chronomq.errors import UnavailableError
from tests.integration.conftest import wait_for
from tests.selfsigned import self_signed

pytestmark = pytest.mark.integration

TOKEN = "integration-token-0123456789"
MSG_ID = "0" * 32
PATH_VALUES = {
    "topic": "sec",
    "queue": "0",
    "group": "g",
    "id": "9",
    "msg_id": MSG_ID,
    "file": "app.js",
}
# Bodies that keep the cluster as it is (a transfer to no such node, an empty change...).
BODIES: dict[tuple[str, str], Any] = {
    ("POST", "/v1/topics/{topic}/messages"): {"messages": [{"body": "x"}]},
    ("PUT", "/v1/topics/{topic}"): {"queues": 4},
    ("PUT", "/v1/groups/{group}/offsets"): {"topic": "sec", "queue": 0, "offset": 0},
    ("POST", "/v1/groups/{group}/retry"): {"topic": "sec", "queue": 0, "offset": 10**9},
    ("PATCH", "/v1/admin/config"): {"no_such_key": 1},
    ("POST", "/v1/admin/leadership/transfer"): {"to": 99},
    ("POST", "/v1/admin/members"): {"id": "not an id"},
    ("PATCH", "/v1/admin/schedule"): {"mode": "neither"},
    ("POST", "/v1/admin/timer/switches"): {"unknown": True},
}
QUERIES = {"/v1/admin/timer/log": "?from=0&to=0"}


def fill(path: str) -> str:
    return re.sub(r"\{([^}]+)\}", lambda m: PATH_VALUES[m.group(1)], path)


async def call(
    session: aiohttp.ClientSession, method: str, url: str, body: Any, authorization: str | None
) -> int:
    headers = {"Authorization": authorization} if authorization is not None else {}
    data = json.dumps(body).encode() if body is not None else None
    if data is not None:
        headers["Content-Type"] = "application/json"
    async with session.request(method, url, data=data, headers=headers) as r:
        await r.read()
        if r.status == 401:
            assert r.headers["WWW-Authenticate"].startswith("Bearer"), (method, url)
            assert (await r.json())["field"] == "Authorization"
        return r.status


@pytest.mark.parametrize("metrics_public", [False, True])
def test_every_route_of_the_openapi_needs_the_token(
    make_cluster: Any, metrics_public: bool
) -> None:
    cluster: LocalCluster = make_cluster(auth_token=TOKEN, metrics_public=metrics_public)
    leader = cluster.wait_leader(60)
    follower = cluster.http_url(next(i for i in range(3) if i != leader))
    open_routes = {
        ("GET", "/healthz"),
        ("GET", "/readyz"),
        ("GET", "/console"),
        ("GET", "/console/{file}"),
    }
    if metrics_public:
        open_routes.add(("GET", "/metrics"))

    async def go() -> None:
        async with aiohttp.ClientSession() as s:
            assert await call(s, "GET", f"{follower}/openapi.json", None, None) == 401
            async with s.get(
                f"{follower}/openapi.json", headers={"Authorization": f"Bearer {TOKEN}"}
            ) as r:
                doc = await r.json()
            routes = [
                (method.upper(), path, op)
                for path, item in doc["paths"].items()
                for method, op in item.items()
            ]
            assert len(routes) >= 20
            documented_open = {(m, p) for m, p, op in routes if op.get("security") == []}
            assert documented_open == open_routes
            failures = []
            for method, path, _op in routes:
                url = follower + fill(path) + QUERIES.get(path, "")
                body = BODIES.get((method, path), {} if "requestBody" in _op else None)
                without = await call(s, method, url, body, None)
                wrong = await call(s, method, url, body, f"Bearer {TOKEN}-not")
                right = await call(s, method, url, body, f"bearer {TOKEN}")
                if (method, path) in open_routes:
                    if without != 200:
                        failures.append((method, path, "open route", without))
                elif (without, wrong) != (401, 401) or right == 401:
                    failures.append((method, path, without, wrong, right))
            assert not failures, failures
            # An unknown path does not tell an unauthenticated caller that it is unknown.
            assert await call(s, "GET", f"{follower}/v1/nope", None, None) == 401
            assert await call(s, "GET", f"{follower}/v1/nope", None, f"Bearer {TOKEN}") == 404

        # The follower gathered the view from its peers with its token, and forwarded the
        # produce above (the only request that stores a message) to the leader.
        async with Client([follower], token=TOKEN) as client:
            view = await client.cluster(url=follower)
            assert [n["reachable"] for n in view["nodes"]] == [True, True, True], view
            queues = (await client.topic("sec"))["queues"]
            assert sum(q["max_offset"] for q in queues) == 1, queues

    asyncio.run(go())


# ---------------------------------------------------------------------- TLS


def test_a_tls_cluster_forwards_over_https_and_refuses_plain_http(
    make_cluster: Any, tmp_path: Path
) -> None:
    cert, key = self_signed(tmp_path)
    cluster: LocalCluster = make_cluster(
        auth_token=TOKEN, tls_cert_file=str(cert), tls_key_file=str(key)
    )
    assert all(u.startswith("https://127.0.0.1:") for u in cluster.urls)
    leader = cluster.wait_leader(60)
    followers = [i for i in range(3) if i != leader]
    produce_via = cluster.http_url(followers[0])
    consume_via = cluster.http_url(followers[1])
    ctx = client_context(str(cert))

    async def go() -> None:
        connector = aiohttp.TCPConnector(ssl=ctx)
        auth = {"Authorization": f"Bearer {TOKEN}"}
        async with aiohttp.ClientSession(connector=connector) as s:
            async with s.post(
                f"{produce_via}/v1/topics/tls/messages",
                json={"messages": [{"body": "over tls", "queue": 0}]},
                headers=auth,
            ) as r:
                assert r.status == 200, await r.text()
                # Answered by the leader, which the follower reached over HTTPS.
                assert r.headers["X-Chronomq-Leader"] == cluster.http_url(leader)
                offset = (await r.json())["results"][0]["offset"]
            async with s.post(
                f"{produce_via}/v1/topics/tls/messages", json={"messages": [{"body": "x"}]}
            ) as r:
                assert r.status == 401
        async with Client([consume_via], token=TOKEN, ca_file=str(cert)) as client:
            pulled = await client.pull("tls", 0, offset, wait_ms=5000, url=consume_via)
            assert [m["body"] for m in pulled["messages"]] == ["over tls"]
            view = await client.cluster(url=consume_via)
            assert [n["reachable"] for n in view["nodes"]] == [True, True, True], view
            assert {n["http_url"] for n in view["nodes"]} == set(cluster.urls)
        # Without the certificate, a client does not trust the nodes.
        async with Client([consume_via], token=TOKEN, deadline_s=0.5) as untrusting:
            with pytest.raises(UnavailableError, match="certificate"):
                await untrusting.topics()

    asyncio.run(go())

    plain = cluster.urls[0].replace("https://", "http://") + "/healthz"
    with pytest.raises((OSError, http.client.HTTPException)):
        urllib.request.urlopen(plain, timeout=5)  # noqa: S310 - loopback

    # The CLI with the token from the environment and the CA from a flag.
    status = subprocess.run(
        [sys.executable, "-m", "chronomq.cluster", "status", "--json", "--url", consume_via]
        + ["--ca-file", str(cert)],
        env={**os.environ, "CHRONOMQ_AUTH_TOKEN": TOKEN},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["leader"] == leader


def test_a_member_added_at_runtime_is_reached_with_the_token(make_joinable_cluster: Any) -> None:
    """Node 3 joins through POST /v1/admin/members: the others gather its status with their
    token (it is a member now), and it forwards writes to the leader with its own. Its
    TimerLog comes from its own CommitLog (the copies in rmq_sys_timer_log); a peer fetch, if
    one is needed, goes out with its token and never fails for want of it."""
    cluster: LocalCluster = make_joinable_cluster(
        4, initial=3, auth_token=TOKEN, log_compaction_min_entries=50
    )
    leader = cluster.wait_leader(60)
    new = 3

    async def go() -> None:
        async with Client(cluster.urls[:3], token=TOKEN, deadline_s=60) as client:
            for k in range(60):
                await client.produce("late", [{"body": f"t{k}", "delay_ms": 3_600_000}] * 10)
            await client.request(
                "POST",
                "/v1/admin/members",
                json_body={
                    "id": new,
                    "raft": f"127.0.0.1:{cluster.raft_port + new}",
                    "http": cluster.http_url(new),
                },
                url=cluster.http_url(leader),
            )
            await asyncio.to_thread(cluster.start, new)
            await asyncio.to_thread(cluster.wait_converged, 90, [0, 1, 2, new])
            for i in range(4):
                view = await client.cluster(url=cluster.http_url(i))
                assert [n["reachable"] for n in view["nodes"]] == [True] * 4, (i, view)

            async def backlog_everywhere() -> bool:
                totals = [
                    (await client.timer_status(url))["backlog"]["total"] for url in cluster.urls
                ]
                return totals == [600] * 4

            await wait_for(backlog_everywhere, 30, "the timer backlog on every node", cluster)
            # A write sent to the new member is forwarded to the leader with its token.
            placed = await client.request(
                "POST",
                "/v1/topics/late/messages",
                json_body={"messages": [{"body": "via node 3"}]},
                headers={"Idempotency-Key": "via-node-3"},
                url=cluster.http_url(new),
                write=True,
            )
            assert placed["results"][0]["topic"] == "late"

    asyncio.run(go())
    log = (cluster.node_dir(new) / "node.log").read_text()
    assert "TimerLog fetch from" not in log, log
    assert re.search(r"(fetched_records|local_records)=[1-9]", log), log


def test_bad_group_names_and_unknown_console_files_answer_like_the_rest(
    make_cluster: Any,
) -> None:
    """An invalid group is named as a group (not a topic); a path under /console/ that is no
    console file needs the token like any path that matches no route."""
    cluster: LocalCluster = make_cluster(1, auth_token=TOKEN)
    cluster.wait_leader(60)
    url = cluster.http_url(0)
    auth = {"Authorization": f"Bearer {TOKEN}"}

    async def go() -> None:
        async with aiohttp.ClientSession() as s:
            async with s.put(f"{url}/v1/topics/t", json={"queues": 1}, headers=auth) as r:
                assert r.status == 201, await r.text()
            for method, path, body in (
                ("PUT", "/v1/groups/bad%20group/offsets", {"topic": "t", "queue": 0, "offset": 0}),
                ("PUT", "/v1/groups/bad%25group/offsets", {"topic": "t", "queue": 0, "offset": 0}),
                ("GET", "/v1/groups/bad%25group/offsets", None),
                ("POST", "/v1/groups/bad%25group/pop", {"topic": "t"}),
            ):
                async with s.request(method, url + path, json=body, headers=auth) as r:
                    answer = await r.json()
                assert r.status == 400 and answer["field"] == "group", (path, answer)
                assert answer["message"].startswith("group") and "topic" not in answer["message"]
            for path in ("/console/nosuch.js", "/console/a/b", "/nosuch", "/v1/nosuch"):
                async with s.get(url + path) as r:
                    assert r.status == 401, (path, r.status)
                async with s.get(url + path, headers=auth) as r:
                    assert r.status == 404, (path, r.status)
            for path in ("/console", "/console/app.js", "/console/index.html"):
                async with s.get(url + path) as r:
                    assert r.status == 200, (path, r.status)

    asyncio.run(go())
