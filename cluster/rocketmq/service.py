"""The ``MessagingService`` servicer: routing, the session RPCs and the producer side.

Every unary call answers with the protocol's ``Status`` (:mod:`chronomq.cluster.rocketmq.codes`); an
unexpected exception is logged and answered ``INTERNAL_ERROR``, never as a bare gRPC failure
or a stack trace. Writes go to the leader: on the leader through :meth:`Broker.produce` (the
HTTP API's path: validation, group commit, ops logs, idempotency), on a follower forwarded to
the leader's HTTP API (:class:`chronomq.cluster.node.peerhttp.PeerHttp`), as the HTTP API forwards. While no
leader is known (an election), a call waits for one within its deadline instead of failing at
once, so the official clients' few attempts outlast a failover.

Pop consumption (``ReceiveMessage``, ``AckMessage``, ``ChangeInvisibleDuration``,
``ForwardMessageToDeadLetterQueue``) is :mod:`chronomq.cluster.rocketmq.consume`; the offset RPCs
(``PullMessage``, ``UpdateOffset``, ``GetOffset``, ``QueryOffset``) are
:mod:`chronomq.cluster.rocketmq.offsets`; transactions and lite subscriptions answer ``UNSUPPORTED``.
Every call naming a client id (``x-mq-client-id``: heartbeats, telemetry, receives...) tells
the auto-renewer that client is alive; ``NotifyClientTermination`` ends the renewal of what it
received. The ``message_id`` a consumer sees is the stored ``UNIQ_KEY`` property
(:data:`convert.UNIQ_KEY`), else our ``msg_id``, so it matches the producer's receipt.
"""

from __future__ import annotations

import asyncio
import functools
import time
import urllib.parse
from collections.abc import AsyncIterator
from typing import Any, Final

import grpc
import orjson
from rocketmq.grpc_protocol import service_pb2 as spb
from rocketmq.grpc_protocol import service_pb2_grpc as spb_grpc

from chronomq.cluster.node import reserved
from chronomq.cluster.node.errors import ApiError
from chronomq.cluster.node.idempotency import FIELD as IDEMPOTENCY_HEADER
from chronomq.cluster.rocketmq import convert, routes, streams, telemetry
from chronomq.cluster.rocketmq.consume import ConsumeRpcs
from chronomq.cluster.rocketmq.offsets import OffsetRpcs
from chronomq.cluster.rocketmq.rpc import ServicerBase, client_id_of, make_status, rpc
from chronomq.raftlog import record

MAX_TELEMETRY_COMMANDS: Final = 10_000
"""Commands one Telemetry stream may send before the server closes it (clients send one per
five minutes)."""


async def _next_or_closed(commands: AsyncIterator[Any], closing: asyncio.Event) -> Any | None:
    """The stream's next command; None when it ended or ``closing`` was set first."""
    if closing.is_set():
        return None
    step = asyncio.ensure_future(commands.__anext__())
    stop = asyncio.ensure_future(closing.wait())
    try:
        await asyncio.wait({step, stop}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stop.cancel()
    if not step.done():
        step.cancel()
        return None
    try:
        return step.result()
    except StopAsyncIteration:
        return None


class MessagingService(ConsumeRpcs, OffsetRpcs, ServicerBase, spb_grpc.MessagingServiceServicer):
    """``apache.rocketmq.v2.MessagingService`` on one node."""

    @functools.cached_property
    def _recalls(self) -> convert.RecallHandles:
        # Keyed as receipt handles are: a cluster without a secret (loopback only) signs with
        # a fixed key, and its handles are then as good as its open API.
        secret = self._config.cluster_secret_bytes or b"chronomq/no-cluster-secret"
        return convert.RecallHandles(secret)

    # ------------------------------------------------------------------ routing and session

    @rpc(spb.QueryRouteResponse)
    async def QueryRoute(self, request: Any, context: Any) -> Any:
        n = self._queue_count(request.topic)
        queues = routes.message_queues(request.topic, n, self._members())
        return spb.QueryRouteResponse(status=make_status(), message_queues=queues)

    @rpc(spb.QueryAssignmentResponse)
    async def QueryAssignment(self, request: Any, context: Any) -> Any:
        self._queue_count(request.topic)  # the topic's checks
        found = routes.assignments(request.topic, self._members())
        return spb.QueryAssignmentResponse(status=make_status(), assignments=found)

    @rpc(spb.HeartbeatResponse)
    async def Heartbeat(self, request: Any, context: Any) -> Any:
        return spb.HeartbeatResponse(status=make_status())

    @rpc(spb.NotifyClientTerminationResponse)
    async def NotifyClientTermination(self, request: Any, context: Any) -> Any:
        if self.renewer is not None:  # what it received is no longer renewed
            self.renewer.client_gone(client_id_of(context))
        return spb.NotifyClientTerminationResponse(status=make_status())

    @functools.cached_property
    def _telemetry_streams(self) -> streams.TelemetryStreams:
        limits = streams.StreamLimits(total=self._config.grpc_max_telemetry_streams)
        return streams.TelemetryStreams(limits)

    async def Telemetry(self, request_iterator: Any, context: Any) -> AsyncIterator[Any]:
        """Answer each ``settings`` command with the server's; the stream stays open until
        the client closes it, the node stops, or a cap of :mod:`~chronomq.cluster.rocketmq.
        streams` closes it (RESOURCE_EXHAUSTED; DEADLINE_EXCEEDED without settings in time)."""
        t0 = time.perf_counter()
        code = "OK"
        held = self._telemetry_streams
        closing = asyncio.Event()
        why: list[str] = []

        def close(reason: str) -> None:
            why.append(reason)
            closing.set()

        try:
            ticket = held.admit(client_id_of(context), str(context.peer()), lambda: close("client"))
        except streams.Refused as exc:
            self.metrics.telemetry_refused.labels(exc.reason).inc()
            self.metrics.observe("Telemetry", "RESOURCE_EXHAUSTED", time.perf_counter() - t0)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
            return
        self.metrics.telemetry_streams.set(len(held))
        timeout_s = self._config.grpc_telemetry_settings_timeout_ms / 1000
        deadline = asyncio.get_running_loop().call_later(timeout_s, close, "settings")
        try:
            seen = 0
            commands = request_iterator.__aiter__()
            while True:
                command = await _next_or_closed(commands, closing)
                if command is None:
                    break
                seen += 1
                if seen > MAX_TELEMETRY_COMMANDS:
                    code = "TOO_MANY_REQUESTS"
                    break
                self._saw(context)
                if command.HasField("settings"):
                    deadline.cancel()
                    held.settings_seen(ticket)
                    settings = telemetry.server_settings(self._config, command.settings)
                    yield spb.TelemetryCommand(status=make_status(), settings=settings)
        except asyncio.CancelledError:
            code = "CANCELLED"
            raise
        finally:
            deadline.cancel()
            held.release(ticket)
            self.metrics.telemetry_streams.set(len(held))
            if why:
                code = "RESOURCE_EXHAUSTED" if why[0] == "client" else "DEADLINE_EXCEEDED"
                self.metrics.telemetry_refused.labels(why[0]).inc()
            self.metrics.observe("Telemetry", code, time.perf_counter() - t0)
        if why:
            message = (
                "closed: this client id opened another Telemetry stream"
                if why[0] == "client"
                else f"closed: no settings within {timeout_s:g} s"
            )
            status = (
                grpc.StatusCode.RESOURCE_EXHAUSTED
                if why[0] == "client"
                else grpc.StatusCode.DEADLINE_EXCEEDED
            )
            await context.abort(status, message)

    # ------------------------------------------------------------------ producer

    @rpc(spb.SendMessageResponse)
    async def SendMessage(self, request: Any, context: Any) -> Any:
        produce = convert.produce_request(request, int(self._config.max_message_bytes))
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
                status=make_status(), message_id=client_id or msg_id, offset=int(res["offset"])
            )
            if "deliver_at_ms" in raw:
                entry.recall_handle = self._recalls.make(msg_id, produce.topic, client_id)
            entries.append(entry)
        return spb.SendMessageResponse(status=make_status(), entries=entries)

    @rpc(spb.RecallMessageResponse)
    async def RecallMessage(self, request: Any, context: Any) -> Any:
        record.validate_topic(request.topic.name, "topic")
        hex_id, client_id = self._recalls.parse(request.recall_handle, request.topic.name)
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
            return spb.RecallMessageResponse(status=make_status(), message_id=client_id or hex_id)
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

    # ------------------------------------------------------------------ not supported

    @rpc(spb.SyncLiteSubscriptionResponse)
    async def SyncLiteSubscription(self, request: Any, context: Any) -> Any:
        raise ApiError(400, "unsupported", "lite topics are not supported")
