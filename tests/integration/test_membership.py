"""Adding and removing a member at runtime."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from cluster.client import Client
from tests.integration.conftest import dump_logs

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
