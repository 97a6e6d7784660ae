"""A consumer past the end of a log that lost its newest entries (every node lost power
under ``flush = async``) is told so, instead of skipping the messages written again there.

3 real node processes; the loss is made by hand on the stopped nodes (tests/integration/
rewind.py). Every wait is a condition with a deadline.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from chronomq.aio import Client
from chronomq.cluster.process.launcher import LocalCluster
from chronomq.errors import ApiError
from tests.integration.conftest import wait_for
from tests.integration.rewind import SETTINGS, last_index, rewind_every_node
from tests.integration.test_restart_all import kill_all_at_once

pytestmark = pytest.mark.integration

TOPIC = "rw"


async def _produce(client: Client, tag: str, n: int) -> list[str]:
    answer = await client.produce(TOPIC, [{"body": f"{tag}-{k}"} for k in range(n)])
    return [r["msg_id"] for r in answer["results"]]


async def _read(client: Client, url: str, offset: int, **kw: Any) -> dict[str, Any]:
    page: dict[str, Any] = await client.pull(TOPIC, 0, offset, 1000, url=url, **kw)
    return page


def test_a_pull_past_a_rewound_log_is_refused_naming_prev(make_cluster: Any) -> None:
    cluster: LocalCluster = make_cluster(3, default_topic_queues=1, **SETTINGS)
    leader = cluster.wait_leader(60)

    async def before() -> tuple[list[str], list[str], int]:
        async with Client(cluster.urls) as client:
            kept = await _produce(client, "a", 30)
            mark = last_index(cluster, leader)
            lost = await _produce(client, "b", 20)
            page = await _read(client, cluster.urls[leader], 0)
            assert [m["msg_id"] for m in page["messages"]] == kept + lost
            return kept, lost, mark

    kept, lost, mark = asyncio.run(before())
    kill_all_at_once(cluster)
    assert rewind_every_node(cluster, mark) > 0
    cluster.start()
    leader = cluster.wait_leader(60)
    follower = next(i for i in range(3) if i != leader)

    async def after() -> None:
        async with Client(cluster.urls) as client:
            page = await _read(client, cluster.urls[leader], 0)
            assert [m["msg_id"] for m in page["messages"]] == kept, "the rewind took nothing"
            # A follower cannot tell yet (its queue ends before offset 49): the pull waits, and
            # answers 409 once offset 49 is written again instead of the messages from 50 on.
            follower_url = cluster.urls[follower]
            waiting = asyncio.create_task(
                _read(client, follower_url, 50, prev=lost[-1], wait_ms=10_000)
            )

            async def follower_waits() -> bool:
                return bool((await client.node(follower_url))["pull_waiters"])

            await wait_for(follower_waits, 20, "the follower's long-poll", cluster)
            again = await _produce(client, "c", 40)  # offsets 30..69: 30..49 held `lost`
            with pytest.raises(ApiError) as refused:
                await waiting
            assert refused.value.status == 409, refused.value
            assert refused.value.body["error"] == "offset_diverged", refused.value.body
            # Without prev, a consumer at offset 50 skips the 20 new messages at 30..49.
            page = await _read(client, cluster.urls[leader], 50)
            assert [m["msg_id"] for m in page["messages"]] == again[20:]
            # With prev it is told, by the leader and by a follower that holds offset 49.
            cluster.wait_converged(60)
            for url in (cluster.urls[leader], cluster.urls[follower]):
                with pytest.raises(ApiError) as refused:
                    await _read(client, url, 50, prev=lost[-1])
                err = refused.value
                assert err.status == 409, err
                assert err.body["error"] == "offset_diverged", err.body
                assert err.body["field"] == "prev", err.body
                assert err.body["max_offset"] == 70, err.body
                assert lost[-1] in err.body["message"], err.body
            # Where the log still holds what was read, the pull goes on (lower case too).
            page = await _read(client, cluster.urls[follower], 30, prev=kept[-1].lower())
            assert [m["msg_id"] for m in page["messages"]] == again
            # Past the end: only the caught-up leader can tell the message is gone.
            with pytest.raises(ApiError) as refused:
                await _read(client, cluster.urls[leader], 90, prev=lost[0])
            assert refused.value.status == 409 and refused.value.body["max_offset"] == 70
            # A prev that is no msg_id: 400 naming it.
            with pytest.raises(ApiError) as refused:
                await _read(client, cluster.urls[leader], 1, prev="nope")
            assert refused.value.status == 400 and refused.value.body["field"] == "prev"

    asyncio.run(after())
