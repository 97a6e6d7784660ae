"""Leadership transfers on a real 3-node cluster: under load they move the leadership, every
acknowledged write stays, and a member added at runtime can be the target."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from chronomq.cluster.cli.client import Client, ClientError
from tests.integration.conftest import dump_logs, wait_for

pytestmark = pytest.mark.integration

TOPIC = "xfer"
PRODUCE_FOR_S = 60.0  # the producers stop by then whatever happens


async def _leader_of(client: Client, url: str) -> int | None:
    try:
        view = await client.cluster(url=url)
    except (ClientError, ConnectionError):
        return None
    leader = view.get("leader")
    return leader if isinstance(leader, int) else None


async def _produce(
    client: Client, stop: asyncio.Event, acked: list[dict[str, Any]], n: int
) -> None:
    """Write plain, delay-level and delay_ms messages until ``stop``; keep every answer."""
    deadline = time.monotonic() + PRODUCE_FOR_S
    k = 0
    while not stop.is_set() and time.monotonic() < deadline:
        batch = [
            {"body": f"p{n}-{k}-plain"},
            {"body": f"p{n}-{k}-level", "delay_level": 1},
            {"body": f"p{n}-{k}-timer", "delay_ms": 1500},
        ]
        result = await client.produce(TOPIC, batch)
        acked.extend(result["results"])
        k += 1


async def _stored_ids(client: Client, topic: str, queue: int, url: str) -> set[str]:
    ids: set[str] = set()
    offset = 0
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        page = await client.pull(topic, queue, offset, 500, url=url)
        ids.update(m["msg_id"] for m in page["messages"])
        if not page["messages"] or page["next_offset"] == offset:
            return ids
        offset = page["next_offset"]
    raise AssertionError(f"reading {topic}/{queue} did not end within 60 s")


def test_transfers_under_load_move_the_leadership_and_lose_no_write(make_cluster: Any) -> None:
    cluster = make_cluster(3, message_delay_level="1s 2s 3s")
    first = cluster.wait_leader(60)
    a = (first + 1) % 3
    third = (first + 2) % 3
    # Alternate between two nodes six times, then to the third.
    targets = [a, first, a, first, a, first, third]

    async def go() -> None:
        async with Client(cluster.urls, deadline_s=60) as client:
            await client.create_topic(TOPIC, 4)
            stop = asyncio.Event()
            acked: list[list[dict[str, Any]]] = [[], []]
            producers = [asyncio.create_task(_produce(client, stop, acked[i], i)) for i in range(2)]
            try:
                await wait_for(
                    lambda: asyncio.sleep(0, len(acked[0]) + len(acked[1]) > 300),
                    30,
                    "the producers to get going",
                    cluster,
                )
                answers = []
                for n, target in enumerate(targets):
                    # Ask any node: a follower forwards to the leader.
                    url = cluster.http_url(n % 3)
                    answer = await client.request(
                        "POST",
                        "/v1/admin/leadership/transfer",
                        json_body={"to": target, "timeout_ms": 15_000},
                        url=url,
                        deadline_s=5,
                    )
                    answers.append(answer)
                    print("transfer", answer)
                    assert answer["status"] == "transferred", answer
                    assert answer["leader"] == target, answer
                    assert answer["to"] == target, answer
                    assert answer["leader_url"] == cluster.http_url(target), answer
                    assert answer["waited_ms"] >= answer["catch_up_ms"] >= 0, answer
                    await wait_for(
                        lambda t=target: _is_leader_everywhere(client, cluster, t),
                        30,
                        f"node {target} to lead in every node's view",
                        cluster,
                    )
                    # Some writes commit in each term.
                    before = len(acked[0]) + len(acked[1])
                    await wait_for(
                        lambda b=before: asyncio.sleep(0, len(acked[0]) + len(acked[1]) > b + 30),
                        30,
                        "writes after the transfer",
                        cluster,
                    )
                terms = [x["term"] for x in answers]
                assert terms == sorted(terms) and len(set(terms)) == len(terms), answers
            finally:
                stop.set()
                done = await asyncio.gather(*producers, return_exceptions=True)
            errors = [d for d in done if isinstance(d, BaseException)]
            assert not errors, errors
            # Every acknowledged write is stored where its answer said.
            everyone = acked[0] + acked[1]
            assert len({r["msg_id"] for r in everyone}) == len(everyone)
            leader_url = cluster.http_url(targets[-1])
            want: dict[tuple[str, int], set[str]] = {}
            for r in everyone:
                want.setdefault((r["topic"], r["queue"]), set()).add(r["msg_id"])
            for (topic, queue), ids in sorted(want.items()):
                stored = await _stored_ids(client, topic, queue, leader_url)
                missing = ids - stored
                assert not missing, (
                    f"{len(missing)} acknowledged messages missing in {topic}/{queue}"
                )
            metrics = await _metrics(client, cluster)
            assert metrics.count('result="transferred"') >= 2, metrics

    try:
        asyncio.run(go())
    except Exception:
        print(dump_logs(cluster))
        raise


async def _is_leader_everywhere(client: Client, cluster: Any, target: int) -> bool:
    leaders = [await _leader_of(client, url) for url in cluster.urls]
    return leaders == [target] * len(leaders)


async def _metrics(client: Client, cluster: Any) -> str:
    """The transfer counters of every node's /metrics, concatenated."""
    assert client._session is not None
    out = []
    for url in cluster.urls:
        async with client._session.get(f"{url}/metrics") as r:
            text = await r.text()
        out += [
            ln for ln in text.splitlines() if ln.startswith("chronomq_leadership_transfers_total")
        ]
    return "\n".join(out)


def test_transfer_answers_name_what_is_wrong(make_cluster: Any) -> None:
    cluster = make_cluster(3)
    leader = cluster.wait_leader(60)

    async def go() -> None:
        async with Client(cluster.urls, deadline_s=20) as client:
            url = cluster.http_url(leader)
            for body, field in (
                ({"to": "1"}, "to"),
                ({"to": True}, "to"),
                ({"to": 1.0}, "to"),
                ({"to": -1}, "to"),
                ({"timeout_ms": 0}, "timeout_ms"),
                ({"timeout_ms": 60_001}, "timeout_ms"),
                ({"timeout_ms": "5s"}, "timeout_ms"),
                ({"too": 1}, "too"),
                ([1], "body"),
            ):
                with pytest.raises(ClientError) as bad:
                    await client.request(
                        "POST", "/v1/admin/leadership/transfer", json_body=body, url=url, write=True
                    )
                assert bad.value.status == 400, (body, bad.value.body)
                assert bad.value.body["field"] == field, (body, bad.value.body)
            with pytest.raises(ClientError) as unknown:
                await client.request(
                    "POST", "/v1/admin/leadership/transfer", json_body={"to": 7}, url=url
                )
            assert unknown.value.status == 400
            assert unknown.value.body["error"] == "unknown_member"
            assert unknown.value.body["field"] == "to"
            # To the leader itself: nothing to do, said so.
            same = await client.request(
                "POST", "/v1/admin/leadership/transfer", json_body={"to": leader}, url=url
            )
            assert same["status"] == "already_leader" and same["leader"] == leader, same
            # No target: the most caught-up follower, and the answer names it.
            moved = await client.transfer_leadership(None)
            assert moved["status"] == "transferred" and moved["leader"] != leader, moved
            assert moved["from"] == leader and moved["to"] == moved["leader"], moved

    try:
        asyncio.run(go())
    except Exception:
        print(dump_logs(cluster))
        raise


def test_a_member_added_at_runtime_can_take_the_leadership(make_joinable_cluster: Any) -> None:
    cluster = make_joinable_cluster(4, initial=3)
    leader = cluster.wait_leader(60)
    new = 3
    raft = f"127.0.0.1:{cluster.raft_port + new}"

    async def go() -> None:
        async with Client(cluster.urls[:3], deadline_s=60) as client:
            await client.create_topic("m", 2)
            await client.produce("m", [{"body": f"b{k}"} for k in range(50)])
            await client.request(
                "POST",
                "/v1/admin/members",
                json_body={"id": new, "raft": raft, "http": cluster.http_url(new)},
                url=cluster.http_url(leader),
            )
            await asyncio.to_thread(cluster.start, new)
            await asyncio.to_thread(cluster.wait_converged, 90, [0, 1, 2, new])
            answer = await client.request(
                "POST",
                "/v1/admin/leadership/transfer",
                json_body={"to": new, "timeout_ms": 15_000},
                url=cluster.http_url(leader),
            )
            assert answer["status"] == "transferred" and answer["leader"] == new, answer
            assert answer["leader_url"] == cluster.http_url(new), answer
            await client.produce("m", [{"body": "on the new leader"}])

    try:
        asyncio.run(go())
    except Exception:
        print(dump_logs(cluster))
        raise
