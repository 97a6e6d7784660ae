"""The ``MessagingService`` servicer: thin handlers that call into the broker.

Every unary call answers with the protocol's ``Status`` (:mod:`cluster.rocketmq.codes`); an
unexpected exception is logged and answered ``INTERNAL_ERROR``, never as a bare gRPC failure
or a stack trace. Writes go to the leader: on the leader through :meth:`Broker.produce` (the
HTTP API's path: validation, group commit, ops logs, idempotency), on a follower forwarded to
the leader's HTTP API (:class:`cluster.peerhttp.PeerHttp`), as the HTTP API forwards. While no
leader is known (an election), a call waits for one within its deadline instead of failing at
once, so the official clients' few attempts outlast a failover.

Pop consumption (``ReceiveMessage``, ``AckMessage``, ``ChangeInvisibleDuration``,
``ForwardMessageToDeadLetterQueue``) and the offset RPCs answer ``NOT_IMPLEMENTED`` here;
transactions and lite subscriptions ``UNSUPPORTED``. A consumption engine replaces those
methods: unary ones wrapped in :func:`rpc` (raise an :class:`ApiError` or a domain error, get
the protocol's Status), writes through :meth:`MessagingService._on_leader`; the ``message_id``
a consumer sees is the stored ``UNIQ_KEY`` property (:data:`convert.UNIQ_KEY`), else our
``msg_id``, so it matches the producer's receipt.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Final, TypeVar

import aiohttp
import orjson
from rocketmq.grpc_protocol import definition_pb2 as pb
from rocketmq.grpc_protocol import service_pb2 as spb
from rocketmq.grpc_protocol import service_pb2_grpc as spb_grpc

from cluster import reserved
from cluster.broker import Broker
from cluster.errors import ApiError, from_exception
from cluster.idempotency import FIELD as IDEMPOTENCY_HEADER
from cluster.rocketmq import codes, convert, routes, telemetry
from cluster.rocketmq.metrics import GrpcMetrics
from raftlog import record

log = logging.getLogger(__name__)

LEADER_POLL_S: Final = 0.05
"""How often a call waiting for a leader looks again."""
DEFAULT_BUDGET_S: Final = 10.0
"""How long a write may wait for a leader and its commit when the call has no deadline."""
MAX_TELEMETRY_COMMANDS: Final = 10_000
"""Commands one Telemetry stream may send before the server closes it (clients send one per
five minutes)."""
_ALWAYS_RETRY: Final = frozenset({"no_leader", "not_leader"})
"""Errors met before anything was proposed: any write may try again."""
_RETRY_WITH_KEY: Final = frozenset(
    {"leader_unreachable", "commit_outcome_unknown", "replication_failed"}
)
"""Errors after which a write may have been stored: retried only under an idempotency key."""
_FORWARDED: Final = "X-Chronomq-Forwarded"

Response = TypeVar("Response")


def _status(failure: codes.Failure | None = None) -> pb.Status:
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
        async def call(self: MessagingService, request: Any, context: Any) -> Any:
            t0 = time.perf_counter()
            failure: codes.Failure | None = None
            try:
                gone = self.broker.removed_error()
                if gone is not None:
                    raise gone
                answer = await handler(self, request, context)
            except asyncio.CancelledError:
                self.metrics.observe(name, "CANCELLED", time.perf_counter() - t0)
                raise
            except Exception as exc:
                failure = codes.from_exception_or_none(exc)
                if failure is None:
                    log.exception("unexpected error in %s", name)
                    failure = codes.internal()
                answer = response(status=_status(failure))
            code = failure.name if failure is not None else "OK"
            self.metrics.observe(name, code, time.perf_counter() - t0)
            return answer

        return call

    return wrap


class MessagingService(spb_grpc.MessagingServiceServicer):
    def __init__(self, broker: Broker, metrics: GrpcMetrics) -> None:
        self.broker = broker
        self.metrics = metrics
        self.stopping = asyncio.Event()

    # ------------------------------------------------------------------ helpers

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
        return routes.live_members(self._config, self.broker.peers(), connected)

    def _queue_count(self, topic: pb.Resource) -> int:
        name = record.validate_topic(topic.name, "topic")
        n = self.broker.raftlog.store.queue_count(name)
        if n is not None:
            return n
        if self._config.auto_create_topic and not reserved.is_system_topic(name):
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
    ) -> dict[str, Any]:
        """One request to the leader's HTTP API; its error answer raised as an ApiError."""
        hdrs = {**(headers or {}), _FORWARDED: self._config.http_url}
        if body is not None:
            hdrs["Content-Type"] = "application/json"
        try:
            async with self.broker.peer_client.request(
                method,
                f"{leader}{path}",
                data=body,
                headers=hdrs,
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

    # ------------------------------------------------------------------ routing and session

    @rpc(spb.QueryRouteResponse)
    async def QueryRoute(self, request: Any, context: Any) -> Any:
        n = self._queue_count(request.topic)
        queues = routes.message_queues(request.topic, n, self._members())
        return spb.QueryRouteResponse(status=_status(), message_queues=queues)

    @rpc(spb.QueryAssignmentResponse)
    async def QueryAssignment(self, request: Any, context: Any) -> Any:
        n = self._queue_count(request.topic)
        queues = routes.message_queues(request.topic, n, self._members())
        return spb.QueryAssignmentResponse(
            status=_status(), assignments=[pb.Assignment(message_queue=q) for q in queues]
        )

    @rpc(spb.HeartbeatResponse)
    async def Heartbeat(self, request: Any, context: Any) -> Any:
        return spb.HeartbeatResponse(status=_status())

    @rpc(spb.NotifyClientTerminationResponse)
    async def NotifyClientTermination(self, request: Any, context: Any) -> Any:
        return spb.NotifyClientTerminationResponse(status=_status())

    async def Telemetry(self, request_iterator: Any, context: Any) -> AsyncIterator[Any]:
        """Answer each ``settings`` command with the server's; the stream stays open until
        the client closes it or the node stops."""
        t0 = time.perf_counter()
        code = "OK"
        try:
            seen = 0
            async for command in request_iterator:
                seen += 1
                if seen > MAX_TELEMETRY_COMMANDS:
                    code = "TOO_MANY_REQUESTS"
                    break
                if command.HasField("settings"):
                    settings = telemetry.server_settings(self._config, command.settings)
                    yield spb.TelemetryCommand(status=_status(), settings=settings)
        except asyncio.CancelledError:
            code = "CANCELLED"
            raise
        finally:
            self.metrics.observe("Telemetry", code, time.perf_counter() - t0)

    # ------------------------------------------------------------------ producer

    @rpc(spb.SendMessageResponse)
    async def SendMessage(self, request: Any, context: Any) -> Any:
        produce = convert.produce_request(request, int(self._config.max_message_size))
        reserved.check_user_topic(produce.topic)
        key = produce.idempotency_key
        broker = self.broker

        async def local() -> dict[str, Any]:
            with broker.hold_request(produce.body_bytes):
                answer = await broker.produce(produce.topic, list(produce.messages), key)
            self.metrics.produced.inc(len(answer["results"]))  # a forward counts on the leader
            return answer

        async def remote(leader: str, timeout_s: float) -> dict[str, Any]:
            path = f"/v1/topics/{urllib.parse.quote(produce.topic, safe='')}/messages"
            headers = {IDEMPOTENCY_HEADER: key} if key else {}
            body = orjson.dumps(produce.body())
            return await self._forward("POST", leader, path, timeout_s, body, headers)

        answer = await self._on_leader(local, remote, self._budget_s(context), key is not None)
        results = answer.get("results")
        if not isinstance(results, list) or len(results) != len(produce.messages):
            raise ApiError(500, "internal", "the produce answer does not match the request")
        entries = []
        for raw, client_id, res in zip(produce.messages, produce.client_ids, results, strict=True):
            msg_id = str(res["msg_id"])
            entry = spb.SendResultEntry(
                status=_status(), message_id=client_id or msg_id, offset=int(res["offset"])
            )
            if "deliver_at_ms" in raw:
                entry.recall_handle = convert.recall_handle(msg_id, client_id)
            entries.append(entry)
        return spb.SendMessageResponse(status=_status(), entries=entries)

    @rpc(spb.RecallMessageResponse)
    async def RecallMessage(self, request: Any, context: Any) -> Any:
        record.validate_topic(request.topic.name, "topic")
        hex_id, client_id = convert.parse_recall_handle(request.recall_handle)
        broker = self.broker

        async def local() -> dict[str, Any]:
            if broker.timer is None:
                raise ApiError(503, "timer_unavailable", "the timer service is not running")
            answer: dict[str, Any] = await broker.timer.cancel(hex_id)
            return answer

        async def remote(leader: str, timeout_s: float) -> dict[str, Any]:
            return await self._forward("DELETE", leader, f"/v1/timers/{hex_id}", timeout_s)

        # A cancel is idempotent: cancelling twice answers "cancelled" twice.
        answer = await self._on_leader(local, remote, self._budget_s(context), True)
        status = answer.get("status")
        reason = str(answer.get("reason") or "")
        if status == "cancelled":
            return spb.RecallMessageResponse(status=_status(), message_id=client_id or hex_id)
        if status == "delivered":
            raise ApiError(
                409, "already_delivered", "the message was already delivered", "recall_handle"
            )
        raise ApiError(
            404,
            "unknown_recall_handle",
            f"the timer cannot tell whether it holds this message ({reason or 'unknown'})",
            "recall_handle",
        )

    @rpc(spb.EndTransactionResponse)
    async def EndTransaction(self, request: Any, context: Any) -> Any:
        raise ApiError(400, "unsupported", "transactional messages are not supported")

    # ------------------------------------------------------------------ not built here

    @rpc(spb.AckMessageResponse)
    async def AckMessage(self, request: Any, context: Any) -> Any:
        raise _not_implemented("AckMessage")

    @rpc(spb.ChangeInvisibleDurationResponse)
    async def ChangeInvisibleDuration(self, request: Any, context: Any) -> Any:
        raise _not_implemented("ChangeInvisibleDuration")

    @rpc(spb.ForwardMessageToDeadLetterQueueResponse)
    async def ForwardMessageToDeadLetterQueue(self, request: Any, context: Any) -> Any:
        raise _not_implemented("ForwardMessageToDeadLetterQueue")

    @rpc(spb.UpdateOffsetResponse)
    async def UpdateOffset(self, request: Any, context: Any) -> Any:
        raise _not_implemented("UpdateOffset")

    @rpc(spb.GetOffsetResponse)
    async def GetOffset(self, request: Any, context: Any) -> Any:
        raise _not_implemented("GetOffset")

    @rpc(spb.QueryOffsetResponse)
    async def QueryOffset(self, request: Any, context: Any) -> Any:
        raise _not_implemented("QueryOffset")

    @rpc(spb.SyncLiteSubscriptionResponse)
    async def SyncLiteSubscription(self, request: Any, context: Any) -> Any:
        raise ApiError(400, "unsupported", "lite topics are not supported")

    async def ReceiveMessage(self, request: Any, context: Any) -> AsyncIterator[Any]:
        self.metrics.observe("ReceiveMessage", "NOT_IMPLEMENTED", 0.0)
        failure = codes.from_api_error(_not_implemented("ReceiveMessage"))
        yield spb.ReceiveMessageResponse(status=_status(failure))

    async def PullMessage(self, request: Any, context: Any) -> AsyncIterator[Any]:
        self.metrics.observe("PullMessage", "NOT_IMPLEMENTED", 0.0)
        failure = codes.from_api_error(_not_implemented("PullMessage"))
        yield spb.PullMessageResponse(status=_status(failure))


def _not_implemented(rpc_name: str) -> ApiError:
    return ApiError(
        501,
        "not_implemented",
        f"{rpc_name} is not implemented yet: pop and offset consumption over gRPC are not built; "
        "consume with the HTTP API meanwhile",
    )
