"""What every handler of the servicer shares: the Status of an answer, the :func:`rpc` wrapper
of unary handlers, and :class:`ServicerBase` (the broker, the metrics, and running a write on
the leader or forwarding it to the leader's HTTP API). The handlers themselves are in
:mod:`chronomq.cluster.rocketmq.service` (routing, session, producer), :mod:`chronomq.cluster.rocketmq.consume`
(pop consumption) and :mod:`chronomq.cluster.rocketmq.offsets` (offset-based pulls)."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, Final

import aiohttp
import orjson
from rocketmq.grpc_protocol import definition_pb2 as pb

from chronomq.cluster.node import reserved
from chronomq.cluster.node.broker import Broker
from chronomq.cluster.node.errors import ApiError, from_exception
from chronomq.cluster.node.peerhttp import Lane
from chronomq.cluster.rocketmq import codes, routes
from chronomq.cluster.rocketmq.autorenew import AutoRenewer
from chronomq.cluster.rocketmq.metrics import GrpcMetrics
from chronomq.cluster.rocketmq.renew import client_id_problem
from chronomq.raftlog import record

log = logging.getLogger(__name__)

LEADER_POLL_S: Final = 0.05
"""How often a call waiting for a leader looks again."""
DEFAULT_BUDGET_S: Final = 10.0
"""How long a write may wait for a leader and its commit when the call has no deadline."""
_ALWAYS_RETRY: Final = frozenset({"no_leader", "not_leader"})
"""Errors met before anything was proposed: any write may try again."""
_RETRY_WITH_KEY: Final = frozenset(
    {"leader_unreachable", "commit_outcome_unknown", "replication_failed"}
)
"""Errors after which a write may have been stored: retried only under an idempotency key."""
FORWARDED_HEADER: Final = "X-Chronomq-Forwarded"
CLIENT_ID_METADATA: Final = "x-mq-client-id"
"""The metadata key naming the calling client (every official client sends it)."""


def client_id_of(context: Any) -> str | None:
    """The call's client id, or None when it names none (or one too long to be real)."""
    if context is None:
        return None
    try:
        metadata = context.invocation_metadata() or ()
    except Exception:  # a test's stand-in context, or a call already over
        return None
    for key, value in metadata:
        if key == CLIENT_ID_METADATA:
            return value if client_id_problem(value) is None else None
    return None


def make_status(failure: codes.Failure | None = None) -> pb.Status:
    if failure is None:
        return pb.Status(code=pb.Code.OK, message="OK")
    return pb.Status(code=failure.code, message=failure.message)


def rpc(
    response: Callable[..., Any],
) -> Callable[[Callable[..., Awaitable[Any]]], Callable[..., Awaitable[Any]]]:
    """Wrap a unary handler: metrics, a removed node's refusal, and every error as a Status."""

    def wrap(handler: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        name = handler.__name__

        @functools.wraps(handler)
        async def call(self: ServicerBase, request: Any, context: Any) -> Any:
            t0 = time.perf_counter()
            failure: codes.Failure | None = None
            try:
                gone = self.broker.removed_error()
                if gone is not None:
                    raise gone
                self._saw(context)
                answer = await handler(self, request, context)
            except asyncio.CancelledError:
                self.metrics.observe(name, "CANCELLED", time.perf_counter() - t0)
                raise
            except Exception as exc:
                failure = codes.from_exception_or_none(exc)
                if failure is None:
                    log.exception("unexpected error in %s", name)
                    failure = codes.internal()
                answer = response(status=make_status(failure))
            code = failure.name if failure is not None else "OK"
            self.metrics.observe(name, code, time.perf_counter() - t0)
            return answer

        return call

    return wrap


class ServicerBase:
    """The broker and the metrics, and the helpers every handler uses."""

    def __init__(self, broker: Broker, metrics: GrpcMetrics) -> None:
        self.broker = broker
        self.metrics = metrics
        self.stopping = asyncio.Event()
        self.renewer: AutoRenewer | None = None
        """Renews auto_renew receives (:mod:`chronomq.cluster.rocketmq.consume` sets it)."""

    # ------------------------------------------------------------------ helpers

    def _saw(self, context: Any) -> None:
        """The calling client is alive (its auto_renew hand-outs go on being renewed)."""
        if self.renewer is not None:
            self.renewer.saw(client_id_of(context))

    @property
    def _config(self) -> Any:
        return self.broker.config

    def _budget_s(self, context: Any) -> float:
        remaining = context.time_remaining() if context is not None else None
        limit = self._config.commit_timeout_ms / 1000 + 5
        if remaining is None:
            return min(DEFAULT_BUDGET_S, limit)
        return max(0.0, min(remaining - 0.1, limit))

    def _members(self) -> list[routes.GrpcAddress]:
        try:
            connected = self.broker.raftlog.machine.status()["peers_connected"]
        except Exception:  # the Raft thread is stopping: list this node alone
            connected = {}
        members = routes.live_members(self._config, self.broker.peers(), connected)
        return routes.leader_first(members, self.broker.leader_url(), self._config)

    def _queue_count(self, topic: pb.Resource) -> int:
        name = record.validate_topic(topic.name, "topic")
        n = self.broker.raftlog.store.queue_count(name)
        if n is not None:
            return n
        if (
            self._config.auto_create_topic
            and not reserved.is_system_topic(name)
            and reserved.group_of_topic(name) is None
        ):
            return int(self._config.default_topic_queues)
        raise ApiError(404, "unknown_topic", f"topic {name} does not exist", "topic")

    async def _on_leader(
        self,
        local: Callable[[], Awaitable[dict[str, Any]]],
        remote: Callable[[str, float], Awaitable[dict[str, Any]]],
        budget_s: float,
        idempotent: bool,
    ) -> dict[str, Any]:
        """``local()`` on the leader, else ``remote(leader_url, seconds left)``; waits for a
        leader and retries what is safe to retry until ``budget_s`` has passed."""
        deadline = time.monotonic() + budget_s
        while True:
            try:
                if self.broker.raftlog.is_leader:
                    return await local()
                leader = self.broker.leader_url()
                if leader is None or leader == self._config.http_url:
                    raise ApiError(503, "no_leader", "no leader is known yet; retry shortly", None)
                return await remote(leader, max(0.1, deadline - time.monotonic()))
            except Exception as exc:
                api = from_exception(exc)
                if api is None:
                    raise
                retry = api.code in _ALWAYS_RETRY or (idempotent and api.code in _RETRY_WITH_KEY)
                if not retry or time.monotonic() + LEADER_POLL_S >= deadline:
                    raise api from None
                if self.stopping.is_set():
                    raise api from None
                await asyncio.sleep(LEADER_POLL_S)

    async def _forward(
        self,
        method: str,
        leader: str,
        path: str,
        timeout_s: float,
        body: bytes | None = None,
        headers: dict[str, str] | None = None,
        lane: Lane = "write",
    ) -> dict[str, Any]:
        """One request to the leader's HTTP API; its error answer raised as an ApiError.
        ``lane``: the peer pool it goes on (``poll`` inside a long-poll slot)."""
        hdrs = {**(headers or {}), FORWARDED_HEADER: self._config.http_url}
        if body is not None:
            hdrs["Content-Type"] = "application/json"
        try:
            async with self.broker.peer_client.request(
                method,
                f"{leader}{path}",
                data=body,
                headers=hdrs,
                lane=lane,
                timeout=aiohttp.ClientTimeout(total=timeout_s),
            ) as r:
                payload = await r.read()
                status = r.status
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise ApiError(
                503, "leader_unreachable", f"the leader at {leader} did not answer: {exc}", None
            ) from None
        try:
            data = orjson.loads(payload)
        except orjson.JSONDecodeError:
            data = None
        if status == 200 and isinstance(data, dict):
            return data
        if isinstance(data, dict) and isinstance(data.get("error"), str):
            field = data.get("field")
            raise ApiError(
                status,
                data["error"],
                str(data.get("message") or ""),
                field if isinstance(field, str) else None,
            )
        raise ApiError(503, "leader_unreachable", f"the leader answered HTTP {status}", None)
