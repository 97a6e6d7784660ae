"""The churn faults' choices and arithmetic, without a cluster: who is asked, whom a transfer
names, which follower leaves, what an answer means (and what an admin call makes of a node's
answer), and how long there was no leader."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from chronomq.aio import Client
from chronomq.cluster.process.launcher import LocalCluster
from chronomq.ops.drill import admin, faults
from chronomq.ops.drill.admin import Answer, LeaderGaps, member_body, sole_leader
from chronomq.ops.drill.churn import (
    BACKOFF_MAX_S,
    backoff_s,
    change_outcome,
    membership_victim,
    transfer_target,
)


def test_the_churn_faults_are_part_of_all() -> None:
    assert {"transfer-leader", "membership"} <= set(faults.ALL_FAULTS)
    assert faults.unavailable_reason("transfer-leader", None, False) is None
    assert faults.unavailable_reason("membership", None, False) is None
    assert "transfer-leader" in (faults.__doc__ or "") and "membership" in (faults.__doc__ or "")


@pytest.mark.parametrize("nodes", [3, 5])
def test_transfer_targets_alternate_a_follower_and_nobody(nodes: int) -> None:
    for seed in range(50):
        rng = random.Random(seed)
        for turn in range(6):
            leader = rng.randrange(nodes)
            target = transfer_target(turn, leader, nodes, rng)
            if turn % 2:
                assert target is None, f"seed {seed}"
            else:
                assert target is not None and target != leader, f"seed {seed}"
                assert 0 <= target < nodes, f"seed {seed}"


@pytest.mark.parametrize("nodes", [3, 5])
def test_the_removed_member_is_never_the_leader(nodes: int) -> None:
    picked = set()
    for seed in range(200):
        rng = random.Random(seed)
        leader = seed % nodes
        victim = membership_victim(leader, nodes, rng)
        assert victim != leader and 0 <= victim < nodes, f"seed {seed}"
        picked.add(victim)
    assert picked == set(range(nodes))  # any follower may go


def test_a_cluster_of_two_cannot_lose_a_member() -> None:
    with pytest.raises(ValueError, match="at least 3"):
        membership_victim(0, 2, random.Random(1))


def test_back_off_doubles_up_to_a_limit() -> None:
    waits = [backoff_s(a) for a in range(10)]
    assert waits[:3] == [0.2, 0.4, 0.8]
    assert max(waits) == BACKOFF_MAX_S and waits == sorted(waits)


def test_what_a_membership_answer_means() -> None:
    in_progress = Answer(
        409,
        {"error": "condition_failed", "message": "another membership change is still in progress"},
        3,
    )
    assert change_outcome(Answer(200, {"status": "removed"}, 2), "remove", 0) == "done"
    assert change_outcome(Answer(201, {"status": "added"}, 2), "add", 0) == "done"
    assert change_outcome(in_progress, "add", 0) == "retry"
    assert change_outcome(Answer(503, {"error": "no_leader"}, 2), "remove", 0) == "retry"
    assert change_outcome(Answer(0, "TimeoutError: ", 15000), "add", 0) == "retry"
    # An earlier attempt whose answer was lost did it.
    exists = Answer(409, {"error": "member_exists", "field": "id"}, 2)
    assert change_outcome(exists, "add", 3) == "done"
    unknown = Answer(404, {"error": "unknown_member"}, 2)
    assert change_outcome(unknown, "remove", 1) == "done"
    assert change_outcome(unknown, "remove", 0) == "failed"
    assert change_outcome(Answer(400, {"error": "invalid_input"}, 2), "add", 0) == "failed"


def test_an_answer_keeps_its_error_and_message() -> None:
    a = Answer(409, {"error": "transfer_refused", "message": "not caught up"}, 12)
    assert a.brief() == {
        "status": 409,
        "took_ms": 12,
        "error": "transfer_refused",
        "message": "not caught up",
    }
    assert Answer(200, {"status": "transferred", "leader": 2}, 80).brief() == {
        "status": 200,
        "took_ms": 80,
    }
    assert Answer(0, "ClientConnectorError: refused", 3).error == "ClientConnectorError: refused"


async def test_an_admin_call_keeps_whatever_one_node_answered(
    aiohttp_server: Callable[..., Awaitable[Any]],
) -> None:
    """One attempt each: a 201 stays a 201, a 503 and a 410 are answers (not retried), no
    answer is status 0 with the failure; the healer's plain call runs inside a running loop."""
    hits: list[int] = []

    def route(status: int, body: dict[str, Any]) -> Callable[[web.Request], Awaitable[Any]]:
        async def answer(request: web.Request) -> web.Response:
            hits.append(status)
            return web.json_response(body, status=status)

        return answer

    app = web.Application()
    app.router.add_post("/v1/admin/members", route(201, {"status": "added", "id": 2}))
    app.router.add_delete("/v1/admin/members/2", route(503, {"error": "no_leader"}))
    app.router.add_get("/v1/topics", route(410, {"error": "removed_from_cluster"}))
    server = await aiohttp_server(app)
    url = str(server.make_url("")).rstrip("/")
    async with Client([url]) as client:
        added = await admin.call(client, "POST", url, "/v1/admin/members", {"id": 2})
        busy = await admin.call(client, "DELETE", url, "/v1/admin/members/2")
        gone = await admin.call(client, "GET", url, "/v1/topics", None, 2)
        nobody = await admin.call(client, "GET", "http://127.0.0.1:9", "/v1/admin/node")
    assert (added.status, added.body, added.error) == (201, {"status": "added", "id": 2}, None)
    assert (busy.status, busy.error, gone.status, gone.error) == (
        503,
        "no_leader",
        410,
        "removed_from_cluster",
    )
    assert hits == [201, 503, 410]
    assert nobody.status == 0 and (nobody.error or "").startswith("ClientConnectorError")

    async def loop_of_its_own() -> asyncio.AbstractEventLoop:
        await asyncio.sleep(0)
        return asyncio.get_running_loop()

    # The stub server runs on this loop, which the plain call blocks: no request here.
    assert admin.run_to_end(loop_of_its_own()) is not asyncio.get_running_loop()


def test_the_sole_leader_is_confirmed_and_named_by_everyone() -> None:
    lead = {"role": "leader", "leader": 1}
    follow = {"role": "follower", "leader": 1}
    assert sole_leader({0: follow, 1: lead, 2: follow}) == 1
    assert sole_leader({0: follow, 1: lead, 2: None}) == 1  # a node that does not answer
    assert sole_leader({0: {"role": "follower", "leader": None}, 1: lead}) is None
    assert sole_leader({0: follow, 1: {"role": "leader-unconfirmed", "leader": 1}}) is None
    assert sole_leader({0: {"role": "leader", "leader": 0}, 1: lead}) is None
    assert sole_leader({}) is None


def test_leaderless_time_counts_from_the_sample_that_saw_none() -> None:
    g = LeaderGaps()
    g.observe(0, 1)
    g.observe(100, None)  # 0-100 had a leader
    g.observe(200, None)  # 100-200 had none
    g.observe(300, 2)  # 200-300 had none
    g.observe(400, 2)
    g.observe(500, None)
    g.observe(550, 2)
    assert (g.leaderless_ms, g.longest_ms, g.changes, g.leader) == (250, 200, 1, 2)


def test_leaderless_time_refuses_a_clock_going_back() -> None:
    g = LeaderGaps()
    g.observe(100, 1)
    with pytest.raises(ValueError, match="backwards"):
        g.observe(99, 1)


def test_a_member_is_added_back_with_its_own_addresses(tmp_path: Path) -> None:
    c = LocalCluster(3, tmp_path, http_port=15000, raft_port=25000)
    assert member_body(c, 2) == {
        "id": 2,
        "raft": "127.0.0.1:25002",
        "http": "http://127.0.0.1:15002",
        "fetch": "127.0.0.1:26002",
    }
    # The same addresses the node's peers are configured with.
    peer = next(p for p in c.config_values(0)["peers"] if p["id"] == 2)
    assert peer == member_body(c, 2)
