"""The admin calls the churn faults make, and a watch on the cluster's leadership.

Every call goes through :class:`chronomq.aio.Client` as one attempt to one named node
(``attempts=1``): the drill wants that node's answer within the call's time, and keeps no
answer (status 0) as what it saw instead of retrying it away; the membership changes retry on
their own terms (:func:`chronomq.ops.drill.churn.change_outcome`).

:class:`LeaderGaps` is the arithmetic (how long no single confirmed leader was seen), fed with
samples and a clock in milliseconds; :class:`LeaderWatch` samples the members' ``/v1/admin/node``
in the background and feeds it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from chronomq.aio import Client
from chronomq.cluster.process.launcher import LocalCluster
from chronomq.errors import ApiError, ChronomqError, UnavailableError

CALL_TIMEOUT_S = 15.0
"""Longest a single admin call may take (a transfer waits for its target to catch up)."""
STATUS_TIMEOUT_S = 1.0
WATCH_PERIOD_S = 0.1

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Answer:
    """One admin call: HTTP status (0: no answer), the JSON body, how long it took."""

    status: int
    body: Any
    took_ms: int

    @property
    def error(self) -> str | None:
        """The answer's error code, or what went wrong on the way (no answer)."""
        if isinstance(self.body, dict) and "error" in self.body:
            return str(self.body["error"])
        return None if 200 <= self.status < 300 else str(self.body)[:200]

    def brief(self) -> dict[str, Any]:
        """What the history keeps of it."""
        out: dict[str, Any] = {"status": self.status, "took_ms": self.took_ms}
        if self.error is not None:
            out["error"] = self.error
            if isinstance(self.body, dict) and self.body.get("message"):
                out["message"] = str(self.body["message"])[:200]
        return out


def client(cluster: LocalCluster) -> Client:
    """A client that authenticates to the cluster's nodes (close it when done)."""
    return Client(
        cluster.urls,
        token=cluster.auth_token,
        ca_file=cluster.ca_file,
        request_timeout_s=CALL_TIMEOUT_S,
    )


def _failure(exc: BaseException) -> str:
    """What went wrong on the way: the failure the client met, under its wrappings of it."""
    while isinstance(exc, UnavailableError) and exc.__cause__ is not None:
        exc = exc.__cause__
    return f"{type(exc).__name__}: {exc}"


async def call(
    client: Client,
    method: str,
    url: str,
    path: str,
    body: Any = None,
    timeout_s: float = CALL_TIMEOUT_S,
) -> Answer:
    """One request to the node at ``url``, no retry: whatever came back (status 0 and the
    failure when nothing)."""
    started = time.monotonic()
    try:
        status, data = await client.request_with_status(
            method, path, json_body=body, url=url, attempts=1, timeout_s=timeout_s
        )
    except ApiError as exc:
        status, data = exc.status, exc.body
    except UnavailableError as exc:
        status, data = 0, _failure(exc)
    return Answer(status, data, round((time.monotonic() - started) * 1000))


def run_to_end(work: Coroutine[Any, Any, T]) -> T:
    """``work`` run to its end on an event loop of its own, on a thread: for a healer, a plain
    call that the drill makes, and waits for, on its own loop."""
    with ThreadPoolExecutor(1, thread_name_prefix="drill-heal") as pool:
        return pool.submit(asyncio.run, work).result()


def member_body(cluster: LocalCluster, i: int) -> dict[str, Any]:
    """Node ``i``'s own addresses, as ``POST /v1/admin/members`` takes them."""
    host = cluster.hosts[i]
    return {
        "id": i,
        "raft": f"{host}:{cluster.raft_port + i}",
        "http": cluster.http_url(i),
        "fetch": f"{host}:{cluster.raft_port + i + 1000}",
    }


def sole_leader(statuses: dict[int, dict[str, Any] | None]) -> int | None:
    """The one node whose status says it is the confirmed leader and whom every answering
    node names as leader; None when there is none, several, or they disagree."""
    leaders = [i for i, st in statuses.items() if st and st.get("role") == "leader"]
    if len(leaders) != 1:
        return None
    named = {st.get("leader") for st in statuses.values() if st}
    return leaders[0] if named == {leaders[0]} else None


async def statuses(
    client: Client, cluster: LocalCluster, nodes: list[int]
) -> dict[int, dict[str, Any] | None]:
    """``/v1/admin/node`` of each of ``nodes`` at once (None: no answer, or an error)."""

    async def one(i: int) -> dict[str, Any] | None:
        try:
            status = await client.node(cluster.http_url(i), attempts=1, timeout_s=STATUS_TIMEOUT_S)
        except ChronomqError:
            return None
        return status if isinstance(status, dict) else None

    answers = await asyncio.gather(*(one(i) for i in nodes))
    return dict(zip(nodes, answers, strict=True))


@dataclass
class LeaderGaps:
    """Time without a leader, from samples: between two samples, the time counts as
    leaderless when the earlier one saw no sole leader. Times are monotonic milliseconds and
    must not go backwards."""

    leaderless_ms: int = 0
    longest_ms: int = 0
    changes: int = 0
    leader: int | None = None
    _last_ms: int | None = None
    _last_leader: int | None = None
    _gap_ms: int = 0

    def observe(self, now_ms: int, leader: int | None) -> None:
        if self._last_ms is not None:
            if now_ms < self._last_ms:
                raise ValueError(f"time went backwards: {now_ms} < {self._last_ms}")
            if self.leader is None:
                step = now_ms - self._last_ms
                self.leaderless_ms += step
                self._gap_ms += step
                self.longest_ms = max(self.longest_ms, self._gap_ms)
        if leader is not None:
            self._gap_ms = 0
            if self._last_leader is not None and leader != self._last_leader:
                self.changes += 1
            self._last_leader = leader
        self.leader = leader
        self._last_ms = now_ms


class LeaderWatch:
    """Samples the members' statuses every :data:`WATCH_PERIOD_S` while running; ``members``
    may change (a removed node is no longer asked)."""

    def __init__(self, client: Client, cluster: LocalCluster, members: list[int]) -> None:
        self._client = client
        self._cluster = cluster
        self.members = list(members)
        self.gaps = LeaderGaps()
        self._task: asyncio.Task[None] | None = None
        self._sampled = asyncio.Event()

    async def __aenter__(self) -> LeaderWatch:
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        while True:
            seen = await statuses(self._client, self._cluster, list(self.members))
            self.gaps.observe(round(time.monotonic() * 1000), sole_leader(seen))
            self._sampled.set()
            await asyncio.sleep(WATCH_PERIOD_S)

    async def next_sample(self) -> int | None:
        """The leader at the next sample taken from now."""
        self._sampled.clear()
        await self._sampled.wait()
        return self.gaps.leader

    async def wait_leader(self, timeout_s: float, other_than: int | None = None) -> int | None:
        """A sole leader (other than ``other_than`` if given), or None when the time is up."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with contextlib.suppress(TimeoutError):
                leader = await asyncio.wait_for(
                    self.next_sample(), max(0.05, deadline - time.monotonic())
                )
                if leader is not None and leader != other_than:
                    return leader
        return None


async def wait_caught_up(
    client: Client, cluster: LocalCluster, nodes: list[int], timeout_s: float
) -> int:
    """Wait until each of ``nodes`` has applied what the leader had committed when the wait
    began (a check that holds under load, unlike equal digests); the index waited for."""
    deadline = time.monotonic() + timeout_s
    target: int | None = None
    while time.monotonic() < deadline:
        seen = await statuses(client, cluster, nodes)
        leader = sole_leader(seen)
        if target is None and leader is not None:
            target = int((seen[leader] or {}).get("commit_index", 0))
        if target is not None and all(
            st is not None and int(st.get("applied_index", -1)) >= target for st in seen.values()
        ):
            return target
        await asyncio.sleep(WATCH_PERIOD_S)
    raise TimeoutError(f"nodes {nodes} did not catch up within {timeout_s} s (index {target})")
