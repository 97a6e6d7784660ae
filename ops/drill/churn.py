"""Churn faults: leadership transfers, and a follower removed and added back while it runs.

``transfer-leader`` asks for 3-5 transfers in a row (``POST /v1/admin/leadership/transfer``
to a random node; non-leaders forward), the target alternating between a random follower and
none (the node picks the most caught-up). The contract: 200 ``{"status": "transferred",
"leader": id}`` once the leadership moved, 409/504 with a JSON error when it did not; a 202
``{"status": "transferring"}`` (the older answer) counts as asked, and the drill then waits,
bounded, for the cluster to name another leader. Every answer is recorded (status, error, how
long it took, whether the leader moved, how long the cluster had no leader); a 200 after which
the leadership did not move to the leader it names is a finding.

``membership`` removes a random follower (never the leader; the others stay a majority) with
``DELETE /v1/admin/members/{id}`` while it keeps running, waits until the other members no
longer list it and it answers 410 ``removed_from_cluster`` to a client (a finding in the
fault's detail when it does not), holds, and adds it back with ``POST /v1/admin/members``
(its own addresses), then waits until it is listed again and has caught up. A 409 "another
membership change is still in progress" is retried with back-off, bounded, and the retries are
recorded. If the drill stops mid-fault, a healer adds the node back.

Each transfer and each membership change is a ``disruption`` record: the checker measures the
time to the next produce and delivery from each, and sums the time without a leader.
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

from chronomq.aio import Client
from chronomq.cluster.process.launcher import LocalCluster
from chronomq.errors import ChronomqError
from chronomq.ops.drill import admin
from chronomq.ops.drill.admin import Answer, LeaderWatch
from chronomq.ops.drill.context import FaultContext
from chronomq.ops.drill.history import now_ms

TRANSFERS_MIN = 3
TRANSFERS_MAX = 5
MOVE_TIMEOUT_S = 6.0
"""How long a transfer answered 200/202 may take to show a new leader."""
SETTLE_TIMEOUT_S = 30.0
"""How long the cluster may take to name a leader again after a refused transfer."""
CHANGE_DEADLINE_S = 30.0
"""How long a membership change is retried (409 in progress, no leader, no answer)."""
REMOVED_WAIT_S = 10.0
"""How long the drill waits to see a removed node dropped from the views and answering 410."""
CATCH_UP_S = 60.0
BACKOFF_FIRST_S = 0.2
BACKOFF_MAX_S = 2.0
RETRYABLE = frozenset({0, 409, 502, 503, 504})
HEAL_CALL_TIMEOUT_S = 5.0
"""How long one call of the healer's re-add may take."""
VIEW_TIMEOUT_S = 3.0
"""How long a member may take to show its cluster view."""
GONE_TIMEOUT_S = 2.0
"""How long the removed node may take to answer a client."""
CLIENT_ROUTE = "/v1/topics"
"""A client route a removed node must refuse with 410."""


def transfer_target(turn: int, leader: int, nodes: int, rng: random.Random) -> int | None:
    """Whom transfer number ``turn`` names: a random follower on even turns, nobody on odd ones
    (the leader then picks the most caught-up follower)."""
    if turn % 2:
        return None
    return rng.choice([j for j in range(nodes) if j != leader])


def membership_victim(leader: int, nodes: int, rng: random.Random) -> int:
    """A random follower to remove; the others must stay a majority of the original cluster
    (so never fewer than three nodes)."""
    if nodes < 3:
        raise ValueError("the membership fault needs at least 3 nodes")
    return rng.choice([j for j in range(nodes) if j != leader])


def backoff_s(attempt: int) -> float:
    """Back-off before retry ``attempt`` (0-based) of a membership change."""
    return float(min(BACKOFF_FIRST_S * 2**attempt, BACKOFF_MAX_S))


def change_outcome(answer: Answer, action: str, attempt: int) -> str:
    """``done``, ``retry`` or ``failed`` for the answer to a membership change.

    An add answered 409 ``member_exists``, or a remove answered 404 ``unknown_member`` after a
    first attempt, is done: an earlier attempt whose answer was lost did it.
    """
    if 200 <= answer.status < 300:
        return "done"
    if action == "add" and answer.status == 409 and answer.error == "member_exists":
        return "done"
    if action == "remove" and answer.status == 404 and attempt > 0:
        return "done"
    return "retry" if answer.status in RETRYABLE else "failed"


async def _change(
    client: Client,
    ctx: FaultContext,
    action: str,
    via: list[int],
    method: str,
    path: str,
    body: Any = None,
) -> tuple[Answer, list[dict[str, Any]]]:
    """A membership change, retried as :func:`change_outcome` says until
    :data:`CHANGE_DEADLINE_S`; the last answer and the refused attempts."""
    deadline = time.monotonic() + CHANGE_DEADLINE_S
    retries: list[dict[str, Any]] = []
    attempt = 0
    while True:
        node = ctx.rng.choice(via)
        answer = await admin.call(client, method, ctx.cluster.http_url(node), path, body)
        outcome = change_outcome(answer, action, attempt)
        if outcome == "done":
            return answer, retries
        retries.append({"via": node, **answer.brief()})
        pause = backoff_s(attempt)
        if outcome == "failed" or time.monotonic() + pause > deadline:
            raise RuntimeError(
                f"membership: {method} {path} answered {answer.status} {answer.body} "
                f"after {len(retries)} attempts"
            )
        attempt += 1
        await asyncio.sleep(pause)


# ---------------------------------------------------------------------- transfer-leader


async def transfer_leader(ctx: FaultContext) -> dict[str, Any]:
    c = ctx.cluster
    rounds = ctx.rng.randint(TRANSFERS_MIN, TRANSFERS_MAX)
    first = await ctx.leader()
    ctx.record("start", fault="transfer-leader", node=first, transfers=rounds)
    answers: list[dict[str, Any]] = []
    findings: list[str] = []
    async with admin.client(c) as client, LeaderWatch(client, c, list(range(c.n))) as watch:
        for k in range(rounds):
            leader = await watch.wait_leader(SETTLE_TIMEOUT_S)
            if leader is None:
                raise TimeoutError(f"transfer-leader: no leader within {SETTLE_TIMEOUT_S} s")
            target = transfer_target(ctx.transfers, leader, c.n, ctx.rng)
            ctx.transfers += 1
            via = ctx.rng.randrange(c.n)
            body = {"to": target} if target is not None else {}
            before_ms = watch.gaps.leaderless_ms
            asked_ms, asked = now_ms(), time.monotonic()
            answer = await admin.call(
                client, "POST", c.http_url(via), "/v1/admin/leadership/transfer", body
            )
            if answer.status in (200, 202):
                new = await watch.wait_leader(MOVE_TIMEOUT_S, other_than=leader)
                if new is None:
                    new = await watch.wait_leader(SETTLE_TIMEOUT_S)
            else:
                new = await watch.wait_leader(SETTLE_TIMEOUT_S)
            settled_ms = round((time.monotonic() - asked) * 1000)
            claimed = answer.body.get("leader") if isinstance(answer.body, dict) else None
            row = {
                "round": k,
                "leader": leader,
                "to": target,
                "via": via,
                **answer.brief(),
                "answer_status": answer.body.get("status")
                if isinstance(answer.body, dict)
                else None,
                "claimed_leader": claimed,
                "new_leader": new,
                "moved": new is not None and new != leader,
                "settled_ms": settled_ms,
                "leaderless_ms": watch.gaps.leaderless_ms - before_ms,
            }
            answers.append(row)
            ctx.record("disruption", fault="transfer-leader", step="transfer", t_ms=asked_ms, **row)
            if answer.status == 200 and (not row["moved"] or claimed != new):
                findings.append(
                    f"transfer {k} answered 200 naming leader {claimed}, but the leader went "
                    f"from {leader} to {new}"
                )
        await admin.wait_caught_up(client, c, list(range(c.n)), CATCH_UP_S)
        gaps = watch.gaps
    moved = sum(1 for a in answers if a["moved"])
    ctx.record(
        "end",
        fault="transfer-leader",
        transfers=rounds,
        moved=moved,
        findings=findings,
        leaderless_ms=gaps.leaderless_ms,
        longest_leaderless_ms=gaps.longest_ms,
    )
    return {"transfers": answers, "moved": moved, "findings": findings}


# ---------------------------------------------------------------------- membership


def _readd(ctx: FaultContext, victim: int, members: list[int]) -> None:
    """The healer: add ``victim`` back, bounded; a plain call (see :func:`admin.run_to_end`)."""
    admin.run_to_end(_readd_on(ctx.cluster, victim, members))


async def _readd_on(cluster: LocalCluster, victim: int, members: list[int]) -> None:
    body = admin.member_body(cluster, victim)
    deadline = time.monotonic() + CHANGE_DEADLINE_S / 2
    attempt = 0
    async with admin.client(cluster) as client:
        while time.monotonic() < deadline:
            node = members[attempt % len(members)]
            answer = await admin.call(
                client,
                "POST",
                cluster.http_url(node),
                "/v1/admin/members",
                body,
                HEAL_CALL_TIMEOUT_S,
            )
            if change_outcome(answer, "add", attempt) != "retry":
                return
            await asyncio.sleep(backoff_s(attempt))
            attempt += 1


async def _listed_by(
    client: Client, ctx: FaultContext, members: list[int]
) -> dict[int, list[int] | None]:
    """The member ids each of ``members`` lists in its cluster view (None: no answer, or an
    error)."""

    async def one(i: int) -> list[int] | None:
        try:
            view = await client.cluster(
                ctx.cluster.http_url(i), attempts=1, timeout_s=VIEW_TIMEOUT_S
            )
        except ChronomqError:
            return None
        if not isinstance(view, dict):
            return None
        return sorted(int(n["id"]) for n in view.get("nodes", []))

    views = await asyncio.gather(*(one(i) for i in members))
    return dict(zip(members, views, strict=True))


async def _wait_listed(
    client: Client,
    ctx: FaultContext,
    members: list[int],
    victim: int,
    listed: bool,
    timeout_s: float,
) -> bool:
    """Wait until every member's view lists ``victim`` (or none does); False at the deadline."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        views = await _listed_by(client, ctx, members)
        if all(v is not None and (victim in v) == listed for v in views.values()):
            return True
        await asyncio.sleep(0.2)
    return False


async def _wait_gone(client: Client, ctx: FaultContext, victim: int, timeout_s: float) -> Answer:
    """What the removed node answers a client, once it is 410 or when the time is up."""
    deadline = time.monotonic() + timeout_s
    while True:
        answer = await admin.call(
            client, "GET", ctx.cluster.http_url(victim), CLIENT_ROUTE, None, GONE_TIMEOUT_S
        )
        if answer.status == 410 or time.monotonic() >= deadline:
            return answer
        await asyncio.sleep(0.2)


async def membership(ctx: FaultContext) -> dict[str, Any]:
    c = ctx.cluster
    leader = await ctx.leader()
    victim = membership_victim(leader, c.n, ctx.rng)
    everyone = list(range(c.n))
    members = [i for i in everyone if i != victim]
    ctx.record("start", fault="membership", node=victim, leader=leader)
    findings: list[str] = []

    def heal() -> None:
        _readd(ctx, victim, members)

    ctx.healers.append(heal)
    async with admin.client(c) as client, LeaderWatch(client, c, everyone) as watch:
        # Remove. The removed node no longer counts for "is there a leader".
        watch.members = members
        before_ms, asked_ms = watch.gaps.leaderless_ms, now_ms()
        answer, retries = await _change(
            client, ctx, "remove", everyone, "DELETE", f"/v1/admin/members/{victim}"
        )
        await watch.wait_leader(SETTLE_TIMEOUT_S)
        ctx.record(
            "disruption",
            fault="membership",
            step="remove",
            t_ms=asked_ms,
            node=victim,
            **answer.brief(),
            retries=retries,
            leaderless_ms=watch.gaps.leaderless_ms - before_ms,
        )
        if not await _wait_listed(client, ctx, members, victim, False, REMOVED_WAIT_S):
            findings.append(
                f"node {victim} still listed by a member {REMOVED_WAIT_S:.0f} s after its removal"
            )
        gone = await _wait_gone(client, ctx, victim, REMOVED_WAIT_S)
        if gone.status != 410 or gone.error != "removed_from_cluster":
            said = f"{gone.status} {gone.error}" if gone.error else str(gone.status)
            findings.append(
                f"removed node {victim} answered GET {CLIENT_ROUTE} with {said} "
                f"{REMOVED_WAIT_S:.0f} s after its removal, not 410 removed_from_cluster"
            )
        await asyncio.sleep(ctx.hold_s)

        # Add it back, from a member (the removed node refuses or cannot forward).
        before_ms, asked_ms = watch.gaps.leaderless_ms, now_ms()
        answer, add_retries = await _change(
            client, ctx, "add", members, "POST", "/v1/admin/members", admin.member_body(c, victim)
        )
        if not await _wait_listed(client, ctx, members, victim, True, CATCH_UP_S):
            raise TimeoutError(f"membership: node {victim} not listed {CATCH_UP_S} s after")
        await admin.wait_caught_up(client, c, everyone, CATCH_UP_S)
        await watch.wait_leader(SETTLE_TIMEOUT_S)
        ctx.record(
            "disruption",
            fault="membership",
            step="add",
            t_ms=asked_ms,
            node=victim,
            **answer.brief(),
            retries=add_retries,
            leaderless_ms=watch.gaps.leaderless_ms - before_ms,
        )
        watch.members = everyone
        gaps = watch.gaps
    ctx.healers.remove(heal)
    ctx.record(
        "end",
        fault="membership",
        node=victim,
        findings=findings,
        leaderless_ms=gaps.leaderless_ms,
        longest_leaderless_ms=gaps.longest_ms,
    )
    return {
        "node": victim,
        "remove_retries": len(retries),
        "add_retries": len(add_retries),
        "findings": findings,
    }
