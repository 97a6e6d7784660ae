"""Adding and removing a member at runtime."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import pytest

from chronomq.cluster.cli.client import Client, ClientError
from tests.integration.conftest import dump_logs, wait_for

pytestmark = pytest.mark.integration


def test_a_fourth_node_joins_catches_up_and_leaves(make_joinable_cluster: Any) -> None:
    cluster = make_joinable_cluster(4, initial=3, log_compaction_min_entries=50)
    leader = cluster.wait_leader(60)
    follower = next(i for i in range(3) if i != leader)
    new = 3
    raft = f"127.0.0.1:{cluster.raft_port + new}"

    async def go() -> None:
        async with Client(cluster.urls[:3], deadline_s=60) as client:
            await client.create_topic("m", 2)
            for k in range(100):
                await client.produce("m", [{"body": f"b{k}-{j}"} for j in range(20)])
            added = await client.request(
                "POST",
                "/v1/admin/members",
                json_body={"id": new, "raft": raft, "http": cluster.http_url(new)},
                url=cluster.http_url(follower),
            )
            assert added["status"] == "added"
            await asyncio.to_thread(cluster.start, new)
            await asyncio.to_thread(cluster.wait_converged, 90, [0, 1, 2, new])
            for url in cluster.urls:
                view = await client.cluster(url=url)
                assert [n["id"] for n in view["nodes"]] == [0, 1, 2, 3]
                assert all(n["reachable"] for n in view["nodes"])
            await client.request("DELETE", f"/v1/admin/members/{new}", url=cluster.http_url(leader))
            # Followers apply the removal a moment after the leader answers.
            deadline = time.monotonic() + 10
            while True:
                view = await client.cluster(url=cluster.http_url(follower))
                if [n["id"] for n in view["nodes"]] == [0, 1, 2] or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.05)
            assert [n["id"] for n in view["nodes"]] == [0, 1, 2]
            # The three keep committing without the removed member.
            await asyncio.to_thread(cluster.kill, new)
            await client.produce("m", [{"body": "after removal"}])

    try:
        asyncio.run(go())
    except Exception:
        print(dump_logs(cluster))
        raise


async def _get(url: str) -> tuple[int, Any]:
    """One GET without retries: (status, JSON body)."""
    async with aiohttp.ClientSession() as session, session.get(url) as r:
        return r.status, await r.json(content_type=None)


async def _term(url: str) -> int:
    status, body = await _get(f"{url}/v1/admin/node")
    assert status == 200, body
    return int(body["term"])


def test_removing_a_follower_and_the_leader_then_adding_one_back(make_cluster: Any) -> None:
    """A follower removed through itself and the leader removed through itself (it hands over
    first) learn it: they answer 410, keep their terms while the rest goes on, and one added
    back while it runs rejoins without a leader change. Every node logs the changes and
    shows the same history."""
    cluster = make_cluster(4)
    leader = cluster.wait_leader(60)
    follower = next(i for i in range(4) if i != leader)
    members = [i for i in range(4) if i not in (leader, follower)]
    timeout_s = 2.0  # raft_max_timeout_ms

    async def removed(i: int) -> bool:
        status, body = await _get(f"{cluster.http_url(i)}/v1/admin/node")
        return status == 200 and body.get("removed") is not None

    async def go() -> None:
        async with Client(cluster.urls, deadline_s=60) as client:
            await client.create_topic("m", 1)
            await client.produce("m", [{"body": "before"}])
            # The node that answers removes itself: a follower forwards to the leader.
            answer = await client.request(
                "DELETE", f"/v1/admin/members/{follower}", url=cluster.http_url(follower)
            )
            assert answer["status"] == "removed" and answer["leader"] == leader
            await wait_for(lambda: removed(follower), 20, "the follower learns", cluster)
            # The leader removes itself: it hands the leadership over first.
            answer = await client.request(
                "DELETE", f"/v1/admin/members/{leader}", url=cluster.http_url(leader)
            )
            assert answer["status"] == "removed" and answer["leader"] in members
            await wait_for(lambda: removed(leader), 20, "the old leader learns", cluster)

        urls = [cluster.http_url(i) for i in members]
        async with Client(urls, deadline_s=60) as client:
            for gone in (follower, leader):
                url = cluster.http_url(gone)
                status, body = await _get(f"{url}/v1/topics/m")
                assert status == 410 and body["error"] == "removed_from_cluster", body
                assert (await _get(f"{url}/readyz"))[0] == 410
                assert (await _get(f"{url}/healthz"))[1]["removed_from_cluster"] is True
            terms = {i: await _term(cluster.http_url(i)) for i in (follower, leader)}
            # Three election timeouts: the removed nodes keep their terms, the rest commits.
            deadline = time.monotonic() + 3 * timeout_s
            n = 0
            while time.monotonic() < deadline:
                await client.produce("m", [{"body": f"during {n}"}])
                n += 1
                for i, term in terms.items():
                    assert await _term(cluster.http_url(i)) == term, f"node {i} campaigned"
                await asyncio.sleep(0.1)
            assert n >= 5
            views = [await client.cluster(url=u) for u in urls]
            assert [n["id"] for n in views[0]["nodes"]] == members
            history = views[0]["membership_history"]
            assert [(h["action"], h["id"]) for h in history] == [
                ("remove", follower),
                ("remove", leader),
            ]
            assert all(v["membership_history"] == history for v in views)

            # Added back while it runs: no election in the rest, it follows and serves.
            new_leader = cluster.leader(members)
            term = await _term(urls[0])
            await client.request(
                "POST",
                "/v1/admin/members",
                json_body={
                    "id": follower,
                    "raft": f"127.0.0.1:{cluster.raft_port + follower}",
                    "http": cluster.http_url(follower),
                },
            )

            async def back() -> bool:
                status, body = await _get(f"{cluster.http_url(follower)}/readyz")
                return status == 200

            await wait_for(back, 30, "the re-added node serves again", cluster)
            assert cluster.leader(members) == new_leader
            for i in [*members, follower]:
                assert await _term(cluster.http_url(i)) == term
            await asyncio.to_thread(cluster.wait_converged, 60, [*members, follower])
            views = [await client.cluster(url=cluster.http_url(i)) for i in [*members, follower]]
            history = views[0]["membership_history"]
            assert [(h["action"], h["id"]) for h in history][-1] == ("add", follower)
            assert all(v["membership_history"] == history for v in views)
        for i in members:
            text = (cluster.node_dir(i) / "node.log").read_text(errors="replace")
            assert text.count("membership change applied") >= 3, i
        removed_log = (cluster.node_dir(leader) / "node.log").read_text(errors="replace")
        assert removed_log.count("was removed from the cluster") == 1

    try:
        asyncio.run(go())
    except Exception:
        print(dump_logs(cluster))
        raise


def test_a_membership_change_after_leadership_transfers(make_joinable_cluster: Any) -> None:
    """After the leadership moved a few times under writes, adding a member succeeds."""
    cluster = make_joinable_cluster(4, initial=3)
    cluster.wait_leader(60)
    new = 3

    async def go() -> None:
        async with Client(cluster.urls[:3], deadline_s=60) as client:
            await client.create_topic("t", 2)
            stop = asyncio.Event()

            async def write() -> None:
                k = 0
                while not stop.is_set():
                    await client.produce("t", [{"body": f"w{k}-{j}"} for j in range(20)])
                    k += 1

            writer = asyncio.create_task(write())
            moves = 0
            try:
                for _ in range(8):
                    if moves == 4:
                        break
                    before = cluster.leader([0, 1, 2])
                    try:
                        await client.request(
                            "POST", "/v1/admin/leadership/transfer", json_body={}, deadline_s=10
                        )
                    except ClientError as exc:
                        assert exc.status == 409, exc  # not caught up at that instant
                        continue

                    async def moved(before: int | None = before) -> bool:
                        now = cluster.leader([0, 1, 2])
                        return now is not None and now != before

                    await wait_for(moved, 20, "the leadership moves", cluster)
                    moves += 1
            finally:
                stop.set()
                await writer
            assert moves >= 2, f"the leadership moved {moves} times"
            added = await client.request(
                "POST",
                "/v1/admin/members",
                json_body={
                    "id": new,
                    "raft": f"127.0.0.1:{cluster.raft_port + new}",
                    "http": cluster.http_url(new),
                },
                deadline_s=5,
            )
            assert added["status"] == "added"
            await asyncio.to_thread(cluster.start, new)
            await asyncio.to_thread(cluster.wait_converged, 90, [0, 1, 2, new])

    try:
        asyncio.run(go())
    except Exception:
        print(dump_logs(cluster))
        raise
