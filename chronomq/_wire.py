"""The request policy both transports share, without I/O: paths, node choice, retries.

A transport (``_http_sync`` with http.client, ``_http_aio`` with aiohttp) asks an
:class:`Attempts` where to send, sends, and reports back the answer or the failure; it is told
either :class:`Done` or how long to :class:`Wait` before the next attempt. Everything about
leaders, ``Retry-After``, back-off and deadlines lives here, with the clock passed in.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import orjson

from chronomq.errors import ApiError, ChronomqError, ServerError, UnavailableError, api_error

RETRYABLE_STATUS = frozenset({429, 502, 503, 504})
MAX_RETRY_AFTER_S = 60.0
"""A ``Retry-After`` longer than this is taken as this (a node asks for 1 s today)."""
BACKOFF_FIRST_S = 0.025
BACKOFF_MAX_S = 0.25
"""The longest back-off between two attempts without a ``Retry-After``: a failover is over in
one to two seconds, and a longer wait would only add to what a producer sees of it (the drills
measure time to the next delivery through this client)."""
LEADER_CHANGE_CODES = frozenset({"not_leader", "no_leader", "leader_unreachable"})
"""503 answers of a change of leader: the node asked does not lead (and names the leader when
it knows it), knows none yet, or cannot reach the one it knew."""
LEADER_CHANGE_S = 3.0
"""How long a request looks for a new leader in short steps: an election is over within the
longest election timeout (2 s) and a round trip. Past that the cluster has no leader for
longer (no quorum), and the node's ``Retry-After`` is waited out again."""
LEADER_POLL_MAX_S = 0.05
"""The longest step while no leader is known, within :data:`LEADER_CHANGE_S`."""
LEADER_HEADER = "X-Chronomq-Leader"
USER_AGENT = "chronomq-python"


def path(*segments: str | int) -> str:
    """``/a/b/c`` with every segment percent-encoded, ``/`` and ``%`` included: a topic
    ``%RETRY%default`` travels as ``%25RETRY%25default``, not as ``%RETRY%DEfault``."""
    return "".join("/" + quote(str(s), safe="") for s in segments)


def query(**params: str | int | None) -> str:
    """``?k=v&...`` of the parameters that are not None, values percent-encoded."""
    parts = [f"{k}={quote(str(v), safe='')}" for k, v in params.items() if v is not None]
    return "?" + "&".join(parts) if parts else ""


def parse_urls(urls: str | Sequence[str]) -> list[str]:
    """Node URLs from a list or a comma-separated string (as ``CHRONOMQ_URL`` gives them)."""
    items = urls.split(",") if isinstance(urls, str) else list(urls)
    out = [u.strip().rstrip("/") for u in items if u and u.strip()]
    if not out:
        raise ValueError("at least one node URL is needed")
    for u in out:
        if not u.startswith(("http://", "https://")):
            raise ValueError(f"node URL {u!r} must start with http:// or https://")
    return out


def decode_json(raw: bytes) -> Any:
    return orjson.loads(raw) if raw else None


class Nodes:
    """The cluster's node list and where the next request goes.

    Writes go to the leader once known (learnt from a successful write or the
    ``X-Chronomq-Leader`` header of a forwarded one); any node takes them otherwise, as a
    follower forwards. Reads stick to one node and move to the next when it fails.
    Shared by every request of a client; a race between threads only picks another node.
    """

    def __init__(self, urls: Sequence[str]) -> None:
        self.urls = list(urls)
        self.leader: str | None = None
        self._preferred = random.randrange(len(self.urls))

    def target(self, write: bool) -> str:
        if write and self.leader is not None:
            return self.leader
        return self.urls[self._preferred % len(self.urls)]

    def failed(self, base: str) -> None:
        """``base`` did not serve the request: forget it as leader, move reads on."""
        if self.leader == base:
            self.leader = None
        if self.urls[self._preferred % len(self.urls)] == base:
            self._preferred = (self._preferred + 1) % len(self.urls)

    def learnt_leader(self, url: str) -> None:
        self.leader = url.rstrip("/")


@dataclass(frozen=True, slots=True)
class Done:
    """The request is answered: the decoded body and the HTTP status (below 400)."""

    body: Any
    status: int = 200


@dataclass(frozen=True, slots=True)
class Wait:
    sleep_s: float


def retry_after_s(value: str | None) -> float | None:
    """A ``Retry-After`` header in seconds (the delay-seconds form), at most
    :data:`MAX_RETRY_AFTER_S`; None when absent or not a number."""
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        return None
    if seconds != seconds:  # NaN
        return None
    return min(max(seconds, 0.0), MAX_RETRY_AFTER_S)


class Attempts:
    """The retry state of one request until its deadline (monotonic seconds).

    Retried: connection failures and timeouts, 429/502/503/504, and 410 from a node removed
    from the cluster (another node is asked). Every other error answer is final. After a
    ``Retry-After`` the next attempt waits at least that long; a wait that would pass the
    deadline ends the request with the last error instead of retrying early. A request
    ``pinned`` to one node (its own view: ``/v1/admin/node``, a pull from that node) goes
    nowhere else.

    A change of leader (:data:`LEADER_CHANGE_CODES`) is not waited out: an answer that names
    the new leader sends the next attempt there at once (at most once per node in a row, so
    nodes naming each other cannot spin), and while no leader is known the next attempt comes
    after at most :data:`LEADER_POLL_MAX_S`, for :data:`LEADER_CHANGE_S`; the node's
    ``Retry-After`` (1 s, for clients that cannot follow) is waited out only after that.

    ``limit`` caps the number of attempts (None: as many as the deadline allows). A caller
    that wants one answer from one node, or counts no answer as a finding (a drill), asks for
    ``limit=1``: the first failure that would be retried ends the request with its error.
    """

    def __init__(
        self,
        nodes: Nodes,
        write: bool,
        deadline: float,
        rng: Callable[[], float] = random.random,
        pinned: str | None = None,
        limit: int | None = None,
    ) -> None:
        if limit is not None and limit < 1:
            raise ValueError(f"at least one attempt is needed, not {limit}")
        self.nodes = nodes
        self.write = write
        self.deadline = deadline
        self.pinned = pinned.rstrip("/") if pinned else None
        self.limit = limit
        self.attempt = 0
        self._rng = rng
        self._last: ChronomqError | None = None
        self._leaderless_since: float | None = None
        self._followed = 0  # attempts sent at once to a named leader, in a row

    def target(self) -> str:
        return self.pinned or self.nodes.target(self.write)

    def answered(
        self, base: str, status: int, header: Callable[[str], str | None], raw: bytes, now: float
    ) -> Done | Wait:
        try:
            body = decode_json(raw)
        except orjson.JSONDecodeError:
            if status < 400:
                return self.failed(base, ValueError(f"{base} answered {status} with no JSON"), now)
            body = {"error": "error", "message": raw[:200].decode(errors="replace")}
        leader = header(LEADER_HEADER)
        if status < 400:
            if self.write:
                self.nodes.learnt_leader(leader or base)
            return Done(body, status)
        error = api_error(status, body)
        hinted = body.get("leader") if isinstance(body, dict) else None
        removed = status == 410 and error.code == "removed_from_cluster"
        if status not in RETRYABLE_STATUS and not removed:
            raise error
        self.nodes.failed(base)
        named = isinstance(hinted, str) and hinted.startswith(("http://", "https://"))
        if isinstance(hinted, str) and named:
            self.nodes.learnt_leader(hinted)
        retry_after = retry_after_s(header("Retry-After"))
        if status == 503 and error.code in LEADER_CHANGE_CODES:
            return self._leader_change(error, base, named, retry_after, now)
        self._followed = 0
        return self._wait(error, retry_after, now)

    def _leader_change(
        self,
        error: ChronomqError,
        base: str,
        named: bool,
        retry_after: float | None,
        now: float,
    ) -> Wait:
        """The next attempt after ``base`` answered that it does not lead: at once to the
        leader the answer ``named``, else after a short step (see the class)."""
        if self._leaderless_since is None:
            self._leaderless_since = now
        leader = self.nodes.leader if named else None
        if (
            leader is not None
            and leader != base
            and self.target() == leader
            and self._followed < len(self.nodes.urls)
        ):
            self._followed += 1
            return self._wait(error, None, now, step_s=0.0)
        self._followed = 0
        if now - self._leaderless_since >= LEADER_CHANGE_S:
            return self._wait(error, retry_after, now)
        step_s = min(BACKOFF_FIRST_S * 2**self.attempt, LEADER_POLL_MAX_S)
        return self._wait(error, None, now, step_s=step_s * (0.5 + 0.5 * self._rng()))

    def failed(self, base: str, exc: BaseException, now: float) -> Wait:
        """The request to ``base`` got no answer (refused, reset, timed out, not JSON)."""
        self.nodes.failed(base)
        self._followed = 0
        error = UnavailableError(f"{base} did not answer: {type(exc).__name__}: {exc}")
        error.__cause__ = exc
        return self._wait(error, None, now)

    def _wait(
        self,
        error: ChronomqError,
        retry_after: float | None,
        now: float,
        step_s: float | None = None,
    ) -> Wait:
        """The wait before the next attempt: ``step_s`` when given, else ``Retry-After``
        when the node sent one, else the exponential back-off."""
        self._last = error
        self.attempt += 1
        if self.limit is not None and self.attempt >= self.limit:
            raise self._final_error()
        backoff = min(BACKOFF_FIRST_S * 2**self.attempt, BACKOFF_MAX_S) * (0.5 + self._rng())
        if step_s is not None:
            backoff = step_s
        elif retry_after is not None:
            # The node said when to come back; sooner would only add to its load.
            backoff = retry_after * (1 + 0.1 * self._rng())
        if now + backoff > self.deadline:
            raise self._final_error()
        return Wait(backoff)

    def _final_error(self) -> ChronomqError:
        last = self._last
        if isinstance(last, ApiError):
            return (
                ServerError(last.status, last.body) if not isinstance(last, ServerError) else last
            )
        return last or UnavailableError("no attempt was made before the deadline")
