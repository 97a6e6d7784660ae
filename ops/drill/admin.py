"""The admin calls the churn faults make, and a watch on the cluster's leadership.

:class:`LeaderGaps` is the arithmetic (how long no single confirmed leader was seen), fed with
samples and a clock in milliseconds; :class:`LeaderWatch` samples the members' ``/v1/admin/node``
in the background and feeds it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

import aiohttp

from chronomq.cluster.process.launcher import LocalCluster

CALL_TIMEOUT_S = 15.0
"""Longest a single admin call may take (a transfer waits for its target to catch up)."""
STATUS_TIMEOUT_S = 1.0
WATCH_PERIOD_S = 0.1


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


def _ssl_context(cluster: LocalCluster) -> ssl.SSLContext | None:
    if not cluster.ca_file:
        return None
    from chronomq.cluster.node.tls import client_context

    return client_context(cluster.ca_file)


def _headers(cluster: LocalCluster) -> dict[str, str]:
    token = cluster.auth_token
    return {"Authorization": f"Bearer {token}"} if token else {}


def session(cluster: LocalCluster) -> aiohttp.ClientSession:
    """A session that authenticates to the cluster's nodes (close it when done)."""
    context = _ssl_context(cluster)
    connector = aiohttp.TCPConnector(ssl=context) if context is not None else None
    return aiohttp.ClientSession(
        headers=_headers(cluster),
        connector=connector,
        timeout=aiohttp.ClientTimeout(total=CALL_TIMEOUT_S),
    )


async def call(
    http: aiohttp.ClientSession,
    method: str,
    url: str,
    body: Any = None,
    timeout_s: float = CALL_TIMEOUT_S,
) -> Answer:
    """One request, no retry: whatever came back (status 0 and the exception when nothing)."""
    started = time.monotonic()
    try:
        async with http.request(
            method, url, json=body, timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as r:
            raw = await r.read()
            try:
                data: Any = json.loads(raw) if raw else None
            except ValueError:
                data = raw[:200].decode(errors="replace")
            status = r.status
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        status, data = 0, f"{type(exc).__name__}: {exc}"
    return Answer(status, data, round((time.monotonic() - started) * 1000))


def call_blocking(
    cluster: LocalCluster, method: str, url: str, body: Any = None, timeout_s: float = 5.0
) -> Answer:
    """:func:`call` without an event loop, for a healer (which runs while the loop stops)."""
    started = time.monotonic()
    data = json.dumps(body).encode() if body is not None else None
    headers = {**_headers(cluster), "Content-Type": "application/json"}
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(  # noqa: S310 - URLs the launcher built
            req, timeout=timeout_s, context=_ssl_context(cluster)
        ) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    except (OSError, ValueError) as exc:
        return Answer(0, f"{type(exc).__name__}: {exc}", round((time.monotonic() - started) * 1000))
    try:
        parsed: Any = json.loads(raw) if raw else None
    except ValueError:
        parsed = raw[:200].decode(errors="replace")
    return Answer(status, parsed, round((time.monotonic() - started) * 1000))


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
    http: aiohttp.ClientSession, cluster: LocalCluster, nodes: list[int]
) -> dict[int, dict[str, Any] | None]:
    """``/v1/admin/node`` of each of ``nodes`` at once (None: no answer)."""

    async def one(i: int) -> dict[str, Any] | None:
        a = await call(
            http, "GET", f"{cluster.http_url(i)}/v1/admin/node", timeout_s=STATUS_TIMEOUT_S
        )
        return a.body if a.status == 200 and isinstance(a.body, dict) else None

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

    def __init__(
        self, http: aiohttp.ClientSession, cluster: LocalCluster, members: list[int]
    ) -> None:
        self._http = http
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
            seen = await statuses(self._http, self._cluster, list(self.members))
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
    http: aiohttp.ClientSession, cluster: LocalCluster, nodes: list[int], timeout_s: float
) -> int:
    """Wait until each of ``nodes`` has applied what the leader had committed when the wait
    began (a check that holds under load, unlike equal digests); the index waited for."""
    deadline = time.monotonic() + timeout_s
    target: int | None = None
    while time.monotonic() < deadline:
        seen = await statuses(http, cluster, nodes)
        leader = sole_leader(seen)
        if target is None and leader is not None:
            target = int((seen[leader] or {}).get("commit_index", 0))
        if target is not None and all(
            st is not None and int(st.get("applied_index", -1)) >= target for st in seen.values()
        ):
            return target
        await asyncio.sleep(WATCH_PERIOD_S)
    raise TimeoutError(f"nodes {nodes} did not catch up within {timeout_s} s (index {target})")
