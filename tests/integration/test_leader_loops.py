"""Leader-only loops follow the leadership on 3 real nodes: leadership transfers while two
producers write delay-level messages, then a switch to async delivery and a burst. Every level
drains, no follower runs a loop or logs a delivery attempt, and every message arrives once and
never early."""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from typing import Any

import pytest

from cluster.client import Client, ClientError
from tests.integration.conftest import wait_for
from tests.integration.test_schedule import TOPIC, Collector, check_history

pytestmark = pytest.mark.integration

LEVELS = "1s 2s 3s"
TRANSFERS = 6
BURST_MESSAGES = 2000
# What a follower's schedule loop logged when it outlived its term.
ZOMBIE_LINES = ("delivery failed", "not the leader", ", expected ")


async def _transfer(cluster: Any, client: Client, leader: int, to: int) -> bool:
    """Ask ``leader`` to hand over to ``to`` (retrying refusals for a while); True if it moved."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            await client.request(
                "POST",
                "/v1/admin/leadership/transfer",
                json_body={"to": to},
                url=cluster.http_url(leader),
            )
            break
        except (ClientError, ConnectionError):
            await asyncio.sleep(0.2)
    until = time.monotonic() + 5
    while time.monotonic() < until:
        now = await asyncio.to_thread(cluster.leader)
        if now is not None and now != leader:
            return True
        await asyncio.sleep(0.1)
    return False


def test_loops_follow_the_leadership_through_transfers_and_a_burst(make_cluster: Any) -> None:
    cluster = make_cluster(3, message_delay_level=LEVELS)
    cluster.wait_leader(60)
    rng = random.Random()

    async def go() -> None:
        due: dict[str, int] = {}
        stop = asyncio.Event()
        async with Client(cluster.urls) as client:

            async def produce(n: int, tag: str) -> None:
                """One request, retried with its idempotency key until it is answered, so
                every stored message is known."""
                msgs = [{"body": f"{tag}-{i}", "delay_level": rng.randint(1, 3)} for i in range(n)]
                key = uuid.uuid4().hex
                deadline = time.monotonic() + 30
                while True:
                    try:
                        answer = await client.produce(TOPIC, msgs, idempotency_key=key)
                        break
                    except (ClientError, ConnectionError):
                        assert time.monotonic() < deadline, f"produce {tag} never answered"
                        await asyncio.sleep(0.1)
                for r in answer["results"]:
                    due[r["msg_id"]] = r["deliver_ms"]

            async def producer(p: int) -> None:
                n = 0
                while not stop.is_set():
                    await produce(8, f"p{p}-{n}")
                    n += 1
                    await asyncio.sleep(0.02)

            producers = [asyncio.create_task(producer(p)) for p in range(2)]
            moved = 0
            for _ in range(TRANSFERS):
                leader = await asyncio.to_thread(cluster.wait_leader, 30)
                moved += await _transfer(cluster, client, leader, 1 if leader == 0 else 0)
                await asyncio.sleep(0.5)
            stop.set()
            await asyncio.gather(*producers)
            assert moved >= 2, f"only {moved} of {TRANSFERS} transfers moved the leadership"

            leader = await asyncio.to_thread(cluster.wait_leader, 30)
            await client.set_schedule(mode="async")
            for j in range(BURST_MESSAGES // 200):
                await produce(200, f"burst-{j}")

            collector = Collector(client)

            async def all_in() -> bool:
                return await collector.poll() >= len(due)

            await wait_for(all_in, 60, "every delayed message delivered", cluster)
            assert check_history(due, collector.copies) == {
                "lost": 0,
                "duplicated": 0,
                "early": 0,
                "unexpected": 0,
            }

            for i in range(3):
                view = await client.schedule(url=cluster.http_url(i))
                loops = view["loops"]
                assert not any(lv["blocked"] for lv in view["levels"]), view["levels"]
                if i == leader:
                    assert loops["schedule_levels"] == 3 and loops["timer_driver"] == 1, loops
                    assert loops["running"] == 4 and loops["term"] is not None
                else:
                    assert loops["running"] == 0 and loops["term"] is None, (i, loops)
                assert loops["started"] - loops["stopped"] == loops["running"]
                assert loops["stuck"] == []

        for i in range(3):
            text = (cluster.node_dir(i) / "node.log").read_text(errors="replace")
            schedule_lines = [ln for ln in text.splitlines() if "schedule" in ln]
            zombie = [ln for ln in schedule_lines if any(z in ln for z in ZOMBIE_LINES)]
            assert not zombie, f"node {i}: {zombie[:3]}"

    asyncio.run(go())
