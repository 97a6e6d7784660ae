"""The request-level asyncio client (:class:`chronomq.aio.Client`): one method per route of
the HTTP API, the admin routes included, each one request under the client's retry policy
(:mod:`chronomq._policy`), its answer as the node's JSON. For the tools around a cluster (the
command line, drills, benchmarks, tests) and for operators' scripts; applications send and
consume with :class:`chronomq.aio.Producer` and :class:`chronomq.aio.Consumer`.

    async with chronomq.aio.Client(urls, token=token) as client:
        view = await client.cluster()
        await client.transfer_leadership(to=2)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from chronomq import _api
from chronomq._http_aio import AioTransport
from chronomq._policy import RequestPolicy
from chronomq._wire import Done
from chronomq.errors import UnavailableError


def _in_attempts(attempts: int) -> str:
    return "in 1 attempt" if attempts == 1 else f"in at most {attempts} attempts"


class Client:
    """Every route as one awaited call: ``await client.topics()``, ``await client.produce(...)``,
    ``await client.request("GET", "/v1/admin/node", url=...)``.

    Writes go to the leader once known, reads to any node; a call given ``url`` goes to that
    node only (its own view). Every call is retried as :class:`chronomq._wire.Attempts` says
    (no answer, 429/502/503/504, a node removed from the cluster) until ``deadline_s`` (the
    client's, or the call's own), or for at most the call's ``attempts`` (``attempts=1``:
    one answer from one node, or the failure at once); an error answer raises
    :class:`chronomq.RequestError` (4xx) or :class:`chronomq.ServerError`, no answer
    :class:`chronomq.UnavailableError` (naming the request and the last failure), so a caller
    sees every failure the retries did not mend.
    Use within one event loop; ``async with`` or ``await close()``.
    """

    def __init__(
        self,
        urls: str | Sequence[str],
        *,
        token: str | None = None,
        ca_file: str | None = None,
        deadline_s: float = 30.0,
        request_timeout_s: float = 15.0,
    ) -> None:
        self._policy = RequestPolicy(
            urls,
            token=token,
            ca_file=ca_file,
            deadline_s=deadline_s,
            request_timeout_s=request_timeout_s,
        )
        self._t = AioTransport(self._policy)

    @property
    def urls(self) -> list[str]:
        """The node URLs, as given (without a trailing ``/``)."""
        return list(self._policy.nodes.urls)

    @property
    def leader(self) -> str | None:
        """The URL of the node that took the last write, once known."""
        return self._policy.nodes.leader

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._t.close()

    async def _call(self, req: _api.Req, deadline_s: float | None = None) -> Any:
        return (await self._answer(req, deadline_s)).body

    async def _answer(self, req: _api.Req, deadline_s: float | None = None) -> Done:
        try:
            return await self._t.answer(req, deadline_s)
        except UnavailableError as exc:
            # Named by its request: a tool juggling many calls says which one found no node.
            cause = exc.__cause__ or exc
            ended = "until the deadline" if req.attempts is None else _in_attempts(req.attempts)
            raise UnavailableError(f"{req.method} {req.target} failed {ended}: {cause}") from exc

    async def request(
        self,
        method: str,
        path: str,
        *,
        json_body: Any = None,
        headers: Mapping[str, str] | None = None,
        url: str | None = None,
        write: bool = False,
        deadline_s: float | None = None,
        attempts: int | None = None,
        timeout_s: float | None = None,
    ) -> Any:
        """Any route: ``path`` is the encoded path and query (see :func:`chronomq._wire.path`).
        ``write`` sends it to the leader; ``url`` to that node only. ``attempts`` caps the
        attempts (``attempts=1``: no retry, the first failure raises), ``timeout_s`` bounds
        each of them (the client's ``request_timeout_s`` when None)."""
        status, body = await self.request_with_status(
            method,
            path,
            json_body=json_body,
            headers=headers,
            url=url,
            write=write,
            deadline_s=deadline_s,
            attempts=attempts,
            timeout_s=timeout_s,
        )
        return body

    async def request_with_status(
        self,
        method: str,
        path: str,
        *,
        json_body: Any = None,
        headers: Mapping[str, str] | None = None,
        url: str | None = None,
        write: bool = False,
        deadline_s: float | None = None,
        attempts: int | None = None,
        timeout_s: float | None = None,
    ) -> tuple[int, Any]:
        """:meth:`request`, with the answer's HTTP status: ``status, body = await ...``, for a
        caller that tells a 200 from a 201 or 202. An error answer still raises (its status
        is the exception's ``status``)."""
        req = _api.Req(
            method,
            path,
            json_body,
            headers or {},
            write=write,
            node=url,
            attempts=attempts,
            timeout_s=timeout_s,
        )
        answer = await self._answer(req, deadline_s)
        return answer.status, answer.body

    # ------------------------------------------------------------------ data

    async def produce(
        self,
        topic: str,
        messages: Sequence[Mapping[str, Any]],
        *,
        idempotency_key: str | None = None,
    ) -> dict[str, Any]:
        """One batch as one request (the answer's ``results`` in order). Its key (a new one
        when None) goes with every retry, so a batch whose answer was lost is stored once."""
        key = idempotency_key or _api.new_idempotency_key()
        result: dict[str, Any] = await self._call(_api.produce(topic, messages, key))
        return result

    async def send(self, topic: str, body: str, **fields: Any) -> dict[str, Any]:
        """One message (fields as the produce route takes them); where it was stored."""
        result = await self.produce(topic, [{"body": body, **fields}])
        first: dict[str, Any] = result["results"][0]
        return first

    async def pull(
        self,
        topic: str,
        queue: int,
        offset: int,
        max_messages: int = 32,
        wait_ms: int = 0,
        url: str | None = None,
        prev: str | None = None,
    ) -> dict[str, Any]:
        """A page from ``offset``; with ``prev`` (the msg_id read at ``offset - 1``) a 409
        ``offset_diverged`` when the log no longer holds it there."""
        req = _api.pull(topic, queue, offset, max_messages, wait_ms, prev, url)
        result: dict[str, Any] = await self._call(req)
        return result

    async def topic(self, topic: str) -> dict[str, Any]:
        result: dict[str, Any] = await self._call(_api.describe_topic(topic))
        return result

    async def topics(self) -> dict[str, Any]:
        result: dict[str, Any] = await self._call(_api.list_topics())
        return result

    async def create_topic(self, topic: str, queues: int) -> dict[str, Any]:
        result: dict[str, Any] = await self._call(_api.create_topic(topic, queues))
        return result

    async def commit_offset(self, group: str, topic: str, queue: int, offset: int) -> None:
        await self._call(_api.commit_offset(group, topic, queue, offset))

    async def offsets(
        self, group: str, topic: str | None = None, url: str | None = None
    ) -> list[dict[str, Any]]:
        """The group's committed offsets (``url``: as that node has applied them)."""
        result = await self._call(_api.group_offsets(group, topic, url))
        offsets: list[dict[str, Any]] = result["offsets"]
        return offsets

    async def retry(
        self, group: str, topic: str, queue: int, offset: int, delay_level: int = 0
    ) -> dict[str, Any]:
        """Send a consumed message back; ``delay_level`` 0 lets the broker pick 3 + retries."""
        req = _api.send_back(group, topic, queue, offset, delay_level)
        result: dict[str, Any] = await self._call(req)
        return result

    async def cancel_timer(self, msg_id: str) -> dict[str, Any]:
        """Cancel a timer message: ``{"status": "cancelled" | "delivered" | "unknown", ...}``."""
        result: dict[str, Any] = await self._call(_api.cancel_timer(msg_id))
        return result

    # ------------------------------------------------------------------ admin

    async def schedule(self, url: str | None = None) -> dict[str, Any]:
        """The schedule service's levels, mode and pause switch."""
        result: dict[str, Any] = await self._call(_api.schedule_status(url))
        return result

    async def set_schedule(
        self, *, mode: str | None = None, paused: bool | None = None
    ) -> dict[str, Any]:
        """Switch delivery mode or pause delivery, cluster-wide."""
        result: dict[str, Any] = await self._call(_api.set_schedule(mode, paused))
        return result

    async def timer_status(self, url: str | None = None) -> dict[str, Any]:
        """``GET /v1/admin/timer`` of one node (any node if ``url`` is not given)."""
        result: dict[str, Any] = await self._call(_api.timer_status(url))
        return result

    async def timer_switches(
        self, *, stop_enqueue: bool | None = None, stop_dequeue: bool | None = None
    ) -> dict[str, Any]:
        """Stop or start timer enqueue/delivery cluster-wide; returns the switches."""
        req = _api.timer_switches(stop_enqueue, stop_dequeue)
        result: dict[str, Any] = await self._call(req)
        return result

    async def cluster(
        self, url: str | None = None, *, attempts: int | None = None, timeout_s: float | None = None
    ) -> dict[str, Any]:
        """Every node's role, indexes and reachability, as ``url`` (or any node) sees them
        (``attempts`` and ``timeout_s`` as :meth:`request` takes them)."""
        req = replace(_api.cluster_view(url), attempts=attempts, timeout_s=timeout_s)
        result: dict[str, Any] = await self._call(req)
        return result

    async def node(
        self, url: str, *, attempts: int | None = None, timeout_s: float | None = None
    ) -> dict[str, Any]:
        """``GET /v1/admin/node`` of the node at ``url`` (``attempts`` and ``timeout_s`` as
        :meth:`request` takes them)."""
        req = replace(_api.node_status(url), attempts=attempts, timeout_s=timeout_s)
        result: dict[str, Any] = await self._call(req)
        return result

    async def admin_config(self) -> dict[str, Any]:
        """The effective config (secrets masked)."""
        result: dict[str, Any] = await self._call(_api.config())
        return result

    async def patch_config(self, changes: Mapping[str, Any]) -> dict[str, Any]:
        """Change runtime keys cluster-wide."""
        result: dict[str, Any] = await self._call(_api.patch_config(changes))
        return result

    async def transfer_leadership(
        self, to: int | None, timeout_ms: int | None = None
    ) -> dict[str, Any]:
        """Move the leadership to node ``to`` (None: the most caught-up follower); answers
        ``{"status": "transferred", "leader", "term", "waited_ms", ...}`` once it has moved.
        A refusal raises :class:`chronomq.RequestError` (409 with ``reason``); a 504 is retried
        until the deadline."""
        req = _api.transfer_leadership(to, timeout_ms)
        result: dict[str, Any] = await self._call(req)
        return result
