"""Delay levels on 3 real nodes: on time, exactly once, across a leader kill; retry to the DLQ."""

from __future__ import annotations

import asyncio
import signal
import time
from typing import Any

import aiohttp
import pytest

from chronomq.aio import Client
from chronomq.errors import ChronomqError
from tests.integration.conftest import pull_applied, wait_for

pytestmark = pytest.mark.integration

LEVELS = "1s 2s 3s 5s"
TOPIC = "orders"
QUEUES = 4


async def produce_levels(client: Client, per_level: int, levels: int = 4) -> dict[str, int]:
    """Produce ``per_level`` messages on every level; msg_id -> deliver_ms from the answers."""
    due: dict[str, int] = {}
    for level in range(1, levels + 1):
        for start in range(0, per_level, 500):
            n = min(500, per_level - start)
            answer = await client.produce(
                TOPIC,
                [{"body": f"L{level}-{start + i}", "delay_level": level} for i in range(n)],
            )
            for r in answer["results"]:
                assert r["delay_level"] == level and r["topic"] == "SCHEDULE_TOPIC_XXXX"
                due[r["msg_id"]] = r["deliver_ms"]
    return due


class Collector:
    """Reads every queue of the real topic from the start; keeps every copy it sees."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self.offsets = [0] * QUEUES
        self.copies: dict[str, list[dict[str, Any]]] = {}

    async def poll(self) -> int:
        for q in range(QUEUES):
            try:
                page = await self.client.pull(TOPIC, q, self.offsets[q], 1000)
            except ChronomqError:
                continue
            for m in page["messages"]:
                self.copies.setdefault(m["msg_id"], []).append(m)
            self.offsets[q] = page["next_offset"]
        return len(self.copies)


def check_history(due: dict[str, int], copies: dict[str, list[dict[str, Any]]]) -> dict[str, int]:
    lost = [m for m in due if m not in copies]
    duplicated = [m for m, c in copies.items() if len(c) > 1]
    early = [m for m, c in copies.items() if m in due and c[0]["store_ms"] < due[m]]
    unexpected = [m for m in copies if m not in due]
    return {
        "lost": len(lost),
        "duplicated": len(duplicated),
        "early": len(early),
        "unexpected": len(unexpected),
    }


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_every_level_on_time_and_exactly_once(make_cluster: Any, mode: str) -> None:
    cluster = make_cluster(3, message_delay_level=LEVELS)
    cluster.wait_leader(60)

    async def go() -> None:
        async with Client(cluster.urls) as client:
            state = await client.set_schedule(mode=mode)
            assert state["mode"] == mode
            due = await produce_levels(client, 100)
            collector = Collector(client)

            async def all_in() -> bool:
                return await collector.poll() >= len(due)

            await wait_for(all_in, 30, "every delayed message delivered", cluster)
            assert check_history(due, collector.copies) == {
                "lost": 0,
                "duplicated": 0,
                "early": 0,
                "unexpected": 0,
            }
            one = next(iter(collector.copies.values()))[0]
            assert one["properties"]["REAL_TOPIC"] == TOPIC
            assert "DELAY" not in one["properties"]
            assert one["body"].startswith("L")
            # Every node agrees the levels are drained, and the mode is replicated.
            for url in cluster.urls:

                async def drained(url: str = url) -> bool:
                    view = await client.schedule(url=url)
                    return view["mode"] == mode and all(
                        lv["backlog"] == 0 and lv["offset"] == 100 for lv in view["levels"]
                    )

                await wait_for(drained, 10, f"levels drained on {url}", cluster)

    asyncio.run(go())


@pytest.mark.parametrize("fault", ["kill", "pause"])
def test_leader_fault_during_async_delivery_loses_and_repeats_nothing(
    make_cluster: Any, fault: str
) -> None:
    """SIGKILL (then restart) or SIGSTOP (then SIGCONT: a stale leader wakes up) mid-delivery."""
    cluster = make_cluster(3, message_delay_level=LEVELS, enable_schedule_async_deliver=True)
    first = cluster.wait_leader(60)

    async def go() -> None:
        async with Client(cluster.urls) as client:
            # Pause, load, then release everything at once so the kill lands mid-delivery.
            # A burst takes about a second to deliver; a poll slowed by a loaded machine can
            # miss it whole, and then the next burst is the one the fault lands in.
            due: dict[str, int] = {}
            for _burst in range(3):
                await client.set_schedule(paused=True)
                burst = await produce_levels(client, 3000)
                due.update(burst)
                latest = max(burst.values())

                async def all_due(latest: int = latest) -> bool:
                    return time.time() * 1000 >= latest

                await wait_for(all_due, 15, "every message due", cluster)
                await client.set_schedule(paused=False)

                async def delivered(before: int = len(due) - len(burst)) -> int:
                    view = await client.schedule(url=cluster.http_url(first))
                    return sum(lv["offset"] for lv in view["levels"]) - before

                done = await wait_for(delivered, 15, "async delivery started", cluster)
                if done < len(burst):
                    break
            else:
                pytest.fail("three bursts of 12,000 were each delivered between two polls")
            cluster.kill(first, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
            cluster.wait_leader(30, among=[i for i in range(3) if i != first])
            if fault == "kill":
                cluster.restart(first)
            else:
                cluster.kill(first, signal.SIGCONT)
            collector = Collector(client)

            async def all_in() -> bool:
                return await collector.poll() >= len(due)

            await wait_for(all_in, 60, "every delayed message delivered after failover", cluster)
            # Give a duplicate, if any, the chance to show up before judging.
            leader = cluster.wait_leader(30)

            async def settled() -> bool:
                view = await client.schedule(url=cluster.http_url(leader))
                return all(lv["backlog"] == 0 and lv["pending"] == 0 for lv in view["levels"])

            await wait_for(settled, 30, "levels drained on the new leader", cluster)
            await collector.poll()
            assert check_history(due, collector.copies) == {
                "lost": 0,
                "duplicated": 0,
                "early": 0,
                "unexpected": 0,
            }
        cluster.wait_converged(60)

    asyncio.run(go())


def test_sixteen_retries_then_the_dead_letter_queue(make_cluster: Any) -> None:
    cluster = make_cluster(3, message_delay_level=LEVELS, enable_schedule_async_deliver=True)
    cluster.wait_leader(60)
    group = "billing"

    async def go() -> None:
        async with Client(cluster.urls) as client:
            sent = await client.send("invoices", "charge #7", queue=1)
            topic, queue, offset = "invoices", 1, sent["offset"]
            retry_topic = f"%RETRY%{group}"
            retry_offset = 0
            for n in range(16):
                answer = await client.retry(group, topic, queue, offset, delay_level=1)
                assert answer["target"] == "retry", answer
                assert answer["topic"] == retry_topic
                assert answer["reconsume_times"] == n + 1
                again = await client.retry(group, topic, queue, offset, delay_level=1)
                assert again["duplicate"] is True  # the same send-back twice re-enqueues once

                async def redelivered(at: int = retry_offset) -> list[dict[str, Any]]:
                    return await pull_applied(client, retry_topic, 0, at, 10, wait_ms=500)

                got = await wait_for(redelivered, 10, f"retry {n + 1} redelivered", cluster)
                assert len(got) == 1
                m = got[0]
                assert m["reconsume_times"] == n + 1
                assert m["body"] == "charge #7"
                assert m["properties"]["RETRY_TOPIC"] == "invoices"
                assert m["properties"]["ORIGIN_MESSAGE_ID"] == sent["msg_id"]
                topic, queue, offset = retry_topic, 0, m["offset"]
                retry_offset = m["offset"] + 1
            dead = await client.retry(group, topic, queue, offset)
            assert dead["target"] == "dlq" and dead["topic"] == f"%DLQ%{group}"

            async def dead_lettered() -> list[dict[str, Any]]:
                return await pull_applied(client, f"%DLQ%{group}", 0, 0, 10)

            got = await wait_for(dead_lettered, 10, "the message in the DLQ", cluster)
            assert len(got) == 1
            dlq = got[0]
            assert dlq["reconsume_times"] == 17
            assert dlq["properties"]["MAX_RECONSUME_TIMES"] == "16"
            assert dlq["properties"]["ORIGIN_MESSAGE_ID"] == sent["msg_id"]

    asyncio.run(go())


def test_bad_schedule_input_gets_a_400_naming_the_field(make_cluster: Any) -> None:
    cluster = make_cluster(3, message_delay_level=LEVELS)
    cluster.wait_leader(60)
    url = cluster.urls[0]

    async def go() -> None:
        async with aiohttp.ClientSession() as s:
            cases: list[tuple[str, str, Any, str]] = [
                (
                    "POST",
                    "/v1/topics/t/messages",
                    {"messages": [{"body": "x", "delay_level": -1}]},
                    "messages[0].delay_level",
                ),
                (
                    "POST",
                    "/v1/topics/t/messages",
                    {"messages": [{"body": "x", "delay_level": 1.5}]},
                    "messages[0].delay_level",
                ),
                (
                    "POST",
                    "/v1/topics/t/messages",
                    {"messages": [{"body": "x", "delay_level": "3"}]},
                    "messages[0].delay_level",
                ),
                (
                    "POST",
                    "/v1/topics/SCHEDULE_TOPIC_XXXX/messages",
                    {"messages": [{"body": "x"}]},
                    "topic",
                ),
                ("PATCH", "/v1/admin/schedule", {"mode": "fast"}, "mode"),
                ("PATCH", "/v1/admin/schedule", {"paused": "yes"}, "paused"),
                ("PATCH", "/v1/admin/schedule", {"speed": 1}, "speed"),
                ("POST", "/v1/groups/g/retry", {"topic": "t", "queue": 0}, "offset"),
                ("POST", "/v1/groups/g/retry", {"topic": "t", "queue": -1, "offset": 0}, "queue"),
                ("POST", "/v1/groups/g!/retry", {"topic": "t", "queue": 0, "offset": 0}, "group"),
                ("POST", "/v1/groups/g/retry", {"topic": "", "queue": 0, "offset": 0}, "topic"),
            ]
            # A topic with a message, so the retry cases fail on their own field.
            async with s.post(
                f"{url}/v1/topics/t/messages", json={"messages": [{"body": "x"}]}
            ) as r:
                assert r.status == 200
            for method, path, body, field in cases:
                async with s.request(method, f"{url}{path}", json=body) as r:
                    answer = await r.json()
                    assert r.status == 400, (path, body, answer)
                    assert answer["field"] == field, (path, body, answer)
            async with s.post(
                f"{url}/v1/topics/t/messages", json={"messages": [{"body": "x", "delay_level": 99}]}
            ) as r:
                result = (await r.json())["results"][0]
                assert r.status == 200 and result["delay_level"] == 4 and result["clamped"] is True
            # A replayed produce answers with the first attempt's due time.
            first_answer: dict[str, Any] = {}
            for attempt in range(2):
                async with s.post(
                    f"{url}/v1/topics/t/messages",
                    json={"messages": [{"body": "once", "delay_level": 3}]},
                    headers={"Idempotency-Key": "replayed-delay"},
                ) as r:
                    answer = await r.json()
                    assert r.status == 200, answer
                if attempt == 0:
                    first_answer = answer["results"][0]
                    await asyncio.sleep(0.05)  # a later store time for the replay
                else:
                    assert answer["duplicate"] is True
                    assert answer["results"][0] == first_answer
            async with s.get(f"{url}/metrics") as r:
                text = await r.text()
                assert 'chronomq_schedule_backlog{level="4"}' in text

    asyncio.run(go())
