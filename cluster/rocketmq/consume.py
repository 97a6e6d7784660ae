"""Pop consumption over gRPC: ``ReceiveMessage``, ``AckMessage``, ``ChangeInvisibleDuration``,
``ForwardMessageToDeadLetterQueue`` (what ``SimpleConsumer`` and ``PushConsumer`` use).

Each call is one write of :mod:`chronomq.cluster.node.popcalls` on the leader (a follower forwards it to the
leader's ``/v1/groups/{group}/...`` routes, as a send is forwarded), so pop state is replicated
and a receipt handle from before a failover still acks on the new leader.

``ReceiveMessage`` answers as the RocketMQ proxy does: a ``status`` first (``OK``, or
``MESSAGE_NOT_FOUND`` when the long poll ended empty), then one ``message`` per hand-out, then
the ``delivery_timestamp``. A request with ``auto_renew`` (a push consumer, which then acks,
or changes the invisible time to its back-off on failure) takes ``default_invisible_time_ms``
(:data:`AUTO_RENEW_INVISIBLE_MS` by default) whatever invisible duration it names, as
RocketMQ's proxy does, and this node renews it until the consumer is done with it
(:mod:`chronomq.cluster.rocketmq.autorenew`; ``enable_proxy_auto_renew``); a request without
``auto_renew`` must name its invisible duration. Ack, change and forward to the DLQ act on the
newest handle of a renewed hand-out, whichever the client gives. The long poll is bounded by
``max_wait_ms`` and by the call's deadline, keeping :data:`DEADLINE_MARGIN_S` for the
hand-out's commit.

A receive hands out from every queue of the topic, whichever queue of the route the client
names (the RocketMQ proxy pops the same way), and ``QueryAssignment`` assigns the whole topic
(queue ``-1``), so a push consumer runs one long poll per topic.

The node that serves a receive writes ``consumed`` latency lines for first deliveries, so the
Spark report sees the end-to-end lateness of timer messages received over gRPC.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import time
import zlib
from collections.abc import AsyncIterator, Sequence
from typing import Any, Final

import orjson
from google.protobuf import duration_pb2, timestamp_pb2
from rocketmq.grpc_protocol import definition_pb2 as pb
from rocketmq.grpc_protocol import service_pb2 as spb

from chronomq.cluster.node import models, popcalls, reserved
from chronomq.cluster.node.errors import ApiError, bad_request
from chronomq.cluster.node.popcalls import ReceiveArgs
from chronomq.cluster.rocketmq import codes, convert
from chronomq.cluster.rocketmq.autorenew import (
    MAX_FORWARDS_IN_FLIGHT,
    AutoRenewer,
    RenewAnswer,
    RenewStatus,
)
from chronomq.cluster.rocketmq.metrics import GrpcMetrics
from chronomq.cluster.rocketmq.renew import StopReason, Tracked
from chronomq.cluster.rocketmq.rpc import ServicerBase, client_id_of, make_status, rpc
from chronomq.cluster.rocketmq.telemetry import DEFAULT_LONG_POLLING_MS
from chronomq.pop import (
    MAX_HANDLE_CHARS,
    MAX_INVISIBLE_MS,
    MAX_POP_MESSAGES,
    MIN_INVISIBLE_MS,
    group_problem,
)
from chronomq.raftlog import record
from chronomq.timer.message import TIMER_OUT_MS

AUTO_RENEW_INVISIBLE_MS: Final = 60_000
"""Invisible time of a hand-out to a consumer that asked for ``auto_renew``, unless
``default_invisible_time_ms`` says otherwise (the RocketMQ proxy's default)."""
DEADLINE_MARGIN_S: Final = 1.0
"""Time a receive keeps before the call's deadline for its hand-out to commit."""
MAX_FILTER_CHARS: Final = 4096

Code = pb.Code
log = logging.getLogger(__name__)


def duration_ms(d: duration_pb2.Duration) -> int:
    return int(d.seconds) * 1000 + int(d.nanos) // 1_000_000


def timestamp_pb(ms: int) -> timestamp_pb2.Timestamp:
    return timestamp_pb2.Timestamp(seconds=ms // 1000, nanos=(ms % 1000) * 1_000_000)


def check_group(name: str) -> str:
    problem = group_problem(name)
    if problem is not None:
        raise ApiError(400, "illegal_consumer_group", problem, "group")
    return name


def tags_of(expression: pb.FilterExpression) -> tuple[str, ...] | None:
    """The subscription's tags (``TagA || TagB``); None for every tag (``*`` or empty)."""
    if expression.type == pb.FilterType.SQL:
        raise ApiError(
            400,
            "unsupported",
            "SQL92 filters are not supported: filter by tag",
            "filter_expression",
        )
    text = expression.expression.strip()
    if len(text) > MAX_FILTER_CHARS:
        raise ApiError(
            400, "illegal_filter_expression", "the filter is too long", "filter_expression"
        )
    if text in ("", "*"):
        return None
    tags = tuple(t.strip() for t in text.split("||"))
    if not all(tags) or any("*" in t for t in tags):
        raise ApiError(
            400,
            "illegal_filter_expression",
            f"a tag filter is '*' or tags joined by '||', got {text!r}",
            "filter_expression",
        )
    return tags


def invisible_ms_of(d: duration_pb2.Duration) -> int:
    """An invisible duration in ms, within what pop accepts (else ILLEGAL_INVISIBLE_TIME)."""
    ms = duration_ms(d)
    if not MIN_INVISIBLE_MS <= ms <= MAX_INVISIBLE_MS:
        raise ApiError(
            400,
            "illegal_invisible_time",
            f"invisible_duration must be {MIN_INVISIBLE_MS // 1000} s to "
            f"{MAX_INVISIBLE_MS // 3_600_000} h",
            "invisible_duration",
        )
    return ms


def check_handle(text: str, field: str = "receipt_handle") -> str:
    """A receipt handle's text, before it is decoded (INVALID_RECEIPT_HANDLE naming ``field``)."""
    if not 0 < len(text) <= MAX_HANDLE_CHARS:
        raise ApiError(400, "invalid_receipt_handle", "not a receipt handle", field)
    return text


def expired() -> pb.Status:
    """What an ack, a change or a forward of a hand-out that is over answers."""
    return pb.Status(
        code=Code.INVALID_RECEIPT_HANDLE,
        message="expired: the message was handed out again, revived or sent to the DLQ",
    )


def receive_args(
    request: spb.ReceiveMessageRequest,
    max_wait_ms: int,
    remaining_s: float | None,
    *,
    auto_renew_invisible_ms: int = AUTO_RENEW_INVISIBLE_MS,
    server_renews: bool = False,
) -> ReceiveArgs:
    """The request as our receive; an :class:`ApiError` names what is wrong. With
    ``server_renews`` an ``auto_renew`` request takes ``auto_renew_invisible_ms`` whatever it
    names; otherwise only when it names none."""
    topic = request.message_queue.topic.name
    record.validate_topic(topic, "topic")
    if reserved.is_system_topic(topic):
        raise ApiError(400, "illegal_topic", f"{topic} is a system topic", "topic")
    if request.auto_renew and server_renews:
        invisible_ms = auto_renew_invisible_ms
    elif request.HasField("invisible_duration"):
        invisible_ms = invisible_ms_of(request.invisible_duration)
    elif request.auto_renew:
        invisible_ms = auto_renew_invisible_ms
    else:
        raise ApiError(
            400, "illegal_invisible_time", "invisible_duration is required", "invisible_duration"
        )
    batch = int(request.batch_size)
    if batch < 0:
        raise bad_request("batch_size must not be negative", "batch_size")
    poll_ms = (
        duration_ms(request.long_polling_timeout)
        if request.HasField("long_polling_timeout")
        else DEFAULT_LONG_POLLING_MS
    )
    if poll_ms < 0:
        raise ApiError(400, "illegal_polling_time", "long_polling_timeout is negative", None)
    wait_ms = min(poll_ms, max_wait_ms)
    if remaining_s is not None:
        wait_ms = min(wait_ms, max(0, int((remaining_s - DEADLINE_MARGIN_S) * 1000)))
    return ReceiveArgs(
        topic=topic,
        queue=None,  # the whole topic, as the RocketMQ proxy pops from every queue
        max_messages=min(batch or MAX_POP_MESSAGES, MAX_POP_MESSAGES),
        invisible_ms=invisible_ms,
        wait_ms=wait_ms,
        tags=tags_of(request.filter_expression),
        max_reconsume_times=None,
    )


def message_pb(m: dict[str, Any], endpoint_host: str = "") -> pb.Message:
    """A message for the client: received by pop (as :func:`chronomq.cluster.httpapi.popcalls.popped_json`
    gives it, with its receipt handle, attempt and invisible time) or pulled by offset (as
    :func:`chronomq.cluster.node.pull.message_json` gives it: no receipt handle, and the attempt is
    ``reconsume_times + 1``, as the RocketMQ proxy answers a pull)."""
    props: dict[str, str] = dict(m.get("properties") or {})
    if m.get("body_base64") is not None:
        body = base64.b64decode(m["body_base64"])
    else:
        body = str(m.get("body") or "").encode()
    out = pb.Message(body=body)
    out.topic.name = str(m["topic"])
    sp = out.system_properties
    sp.message_id = props.get(convert.UNIQ_KEY) or str(m["msg_id"])
    if m.get("tags"):
        sp.tag = str(m["tags"])
    sp.keys.extend(m.get("keys") or [])
    sp.body_digest.type = pb.DigestType.CRC32
    sp.body_digest.checksum = format(zlib.crc32(body) & 0xFFFFFFFF, "08X")
    sp.body_encoding = pb.Encoding.IDENTITY
    sp.born_timestamp.CopyFrom(timestamp_pb(int(m.get("born_ms") or 0)))
    sp.store_timestamp.CopyFrom(timestamp_pb(int(m.get("store_ms") or 0)))
    sp.born_host = endpoint_host or "chronomq"
    sp.store_host = endpoint_host or "chronomq"
    sp.queue_id = int(m["queue"])
    sp.queue_offset = int(m["offset"])
    attempt = m.get("delivery_attempt")
    sp.delivery_attempt = (
        int(attempt) if attempt is not None else int(m.get("reconsume_times") or 0) + 1
    )
    if m.get("receipt_handle"):
        sp.receipt_handle = str(m["receipt_handle"])
        sp.invisible_duration.CopyFrom(
            duration_pb2.Duration(
                seconds=max(0, int(m.get("invisible_until_ms") or 0) - int(time.time() * 1000))
                // 1000
            )
        )
    due = props.get(TIMER_OUT_MS)
    if due is not None and due.isascii() and due.isdigit():
        sp.message_type = pb.MessageType.DELAY
        sp.delivery_timestamp.CopyFrom(timestamp_pb(int(due)))
    else:
        sp.message_type = pb.MessageType.NORMAL
    out.user_properties.update(
        {
            k: v
            for k, v in props.items()
            if k != convert.UNIQ_KEY and not reserved.is_reserved_property(k)
        }
    )
    return out


def _renew_answer(answer: dict[str, Any]) -> RenewAnswer:
    handle = answer.get("receipt_handle")
    until = answer.get("invisible_until_ms")
    if answer.get("status") == "changed" and isinstance(handle, str) and isinstance(until, int):
        return RenewAnswer(RenewStatus.CHANGED, handle, until)
    if answer.get("status") == "expired":
        return RenewAnswer(RenewStatus.EXPIRED)
    return RenewAnswer(RenewStatus.ERROR)


def _ack_stop(status: object) -> StopReason:
    return StopReason.ACKED if status in ("acked", "already_acked") else StopReason.STALE


class ConsumeRpcs(ServicerBase):
    """The pop-consumption RPCs of the servicer."""

    def __init__(self, broker: Any, metrics: GrpcMetrics) -> None:
        super().__init__(broker, metrics)
        self._forward_gate = asyncio.Semaphore(MAX_FORWARDS_IN_FLIGHT)
        if self._config.enable_proxy_auto_renew:
            self.renewer = AutoRenewer.from_config(self._config, self._renew, metrics)

    async def _renew(self, entries: Sequence[Tracked], invisible_ms: int) -> list[RenewAnswer]:
        """The renewer's calls: one command per batch on the leader; from a follower each
        handle forwarded to the leader's change route (a 4xx there refuses it for good). No
        retry: an unknown outcome is tried again when next due."""
        broker = self.broker
        if broker.raftlog.is_leader:
            results = await popcalls.change_invisible_many(
                broker, [e.current for e in entries], invisible_ms
            )
            return [_renew_answer(popcalls.change_json(r)) for r in results]
        leader = broker.leader_url()
        if leader is None or leader == self._config.http_url:
            raise ApiError(503, "no_leader", "no leader is known yet", None)
        timeout_s = self._config.commit_timeout_ms / 1000 + 1

        async def one(e: Tracked) -> RenewAnswer:
            body = orjson.dumps({"receipt_handle": e.current, "invisible_ms": invisible_ms})
            path = self._group_path(e.group, "invisible")
            try:
                async with self._forward_gate:
                    answer = await self._forward("POST", leader, path, timeout_s, body)
            except ApiError as exc:
                if 400 <= exc.status < 500 and exc.status not in (408, 429):
                    log.info("auto-renew refused by the leader: %s %s", exc.code, exc.message)
                    return RenewAnswer(RenewStatus.EXPIRED)
                return RenewAnswer(RenewStatus.ERROR)
            return _renew_answer(answer)

        return list(await asyncio.gather(*(one(e) for e in entries)))

    async def _pop_call(
        self, path: str, body: dict[str, Any], local: Any, budget_s: float
    ) -> dict[str, Any]:
        """``local()`` on the leader, else the same call forwarded to the leader's route."""

        async def remote(leader: str, timeout_s: float) -> dict[str, Any]:
            return await self._forward("POST", leader, path, timeout_s, orjson.dumps(body))

        # Safe to repeat: a lost hand-out comes back after its invisible time; acks, changes
        # and forwards of a handle already used answer from the replicated state.
        return await self._on_leader(local, remote, budget_s, True)

    async def _receive_call(
        self, group: str, args: ReceiveArgs, local: Any, budget_s: float
    ) -> dict[str, Any]:
        """A receive: :meth:`_pop_call`, but one forwarded with a wait goes on the poll lane
        (:meth:`PeerHttp.long_poll_slot`) with the wait still left once it has a slot, and
        answers with no messages when no slot comes free within its wait."""
        path = self._group_path(group, "pop")

        async def remote(leader: str, timeout_s: float) -> dict[str, Any]:
            body = args.body()
            if args.wait_ms == 0:
                return await self._forward("POST", leader, path, timeout_s, orjson.dumps(body))
            t0 = time.monotonic()
            wait_s = min(args.wait_ms / 1000, timeout_s)
            async with self.broker.peer_client.long_poll_slot(wait_s) as left_s:
                if left_s is None:
                    return {"messages": []}
                body["wait_ms"] = int(left_s * 1000)
                rest_s = max(0.1, timeout_s - (time.monotonic() - t0))
                return await self._forward(
                    "POST", leader, path, rest_s, orjson.dumps(body), lane="poll"
                )

        return await self._on_leader(local, remote, budget_s, True)

    async def _hold(self, handles: Sequence[str], context: Any) -> list[str]:
        """The handles to act on: the newest of renewed hand-outs (see :meth:`_release`)."""
        if self.renewer is None:
            return list(handles)
        return await self.renewer.hold(handles, self._budget_s(context) / 2)

    def _release(self, handles: Sequence[str], reasons: Sequence[StopReason | None]) -> None:
        if self.renewer is not None:
            self.renewer.release(handles, reasons)

    def _group_path(self, group: str, what: str) -> str:
        import urllib.parse

        return f"/v1/groups/{urllib.parse.quote(group, safe='')}/{what}"

    async def ReceiveMessage(self, request: Any, context: Any) -> AsyncIterator[Any]:
        t0 = time.perf_counter()
        name = "ReceiveMessage"
        try:
            gone = self.broker.removed_error()
            if gone is not None:
                raise gone
            self._saw(context)
            group = check_group(request.group.name)
            remaining = context.time_remaining() if context is not None else None
            renewer = self.renewer if request.auto_renew else None
            args = receive_args(
                request,
                int(self._config.max_wait_ms),
                remaining,
                auto_renew_invisible_ms=int(self._config.default_invisible_time_ms),
                server_renews=self.renewer is not None,
            )
            reserved.check_group_read(args.topic, group)
            broker = self.broker

            async def local() -> dict[str, Any]:
                popped = await popcalls.receive(broker, group, args)
                return {"messages": [popcalls.popped_json(p) for p in popped]}

            if remaining is None:
                budget = args.wait_ms / 1000 + self._config.commit_timeout_ms / 1000 + 5
            else:
                budget = max(0.0, remaining - 0.1)
            answer = await self._receive_call(group, args, local, budget)
            messages = answer.get("messages")
            if not isinstance(messages, list):
                raise ApiError(500, "internal", "the receive answer has no messages")
            out = [message_pb(m) for m in messages]
            handed = [(str(m["receipt_handle"]), int(m["invisible_until_ms"])) for m in messages]
        except asyncio.CancelledError:
            self.metrics.observe(name, "CANCELLED", time.perf_counter() - t0)
            raise
        except Exception as exc:
            failure = codes.from_exception_or_none(exc)
            if failure is None:
                log.exception("unexpected error in %s", name)
                failure = codes.internal()
            self.metrics.observe(name, failure.name, time.perf_counter() - t0)
            yield spb.ReceiveMessageResponse(status=make_status(failure))
            return
        if not out:
            self.metrics.observe(name, "MESSAGE_NOT_FOUND", time.perf_counter() - t0)
            yield spb.ReceiveMessageResponse(
                status=pb.Status(code=Code.MESSAGE_NOT_FOUND, message="no new message")
            )
            return
        now_ms = time.time_ns() // 1_000_000
        logs = self.broker.logs
        if logs is not None:
            first = [m for m in messages if int(m["delivery_attempt"]) == 1]
            if first:
                logs.consumed(args.topic, first, now_ms)
        self.metrics.received.inc(len(out))
        self.metrics.observe(name, "OK", time.perf_counter() - t0)
        yield spb.ReceiveMessageResponse(status=make_status())
        for m in out:
            yield spb.ReceiveMessageResponse(message=m)
        yield spb.ReceiveMessageResponse(delivery_timestamp=timestamp_pb(now_ms))
        # Written to the client: renew from now on (RocketMQ's proxy registers its handles
        # once the answer is written; one the client never got comes back in time).
        if renewer is not None:
            renewer.track(group, args.topic, client_id_of(context), handed)

    @rpc(spb.AckMessageResponse)
    async def AckMessage(self, request: Any, context: Any) -> Any:
        group = check_group(request.group.name)
        record.validate_topic(request.topic.name, "topic")
        if not 0 < len(request.entries) <= models.MAX_ACK_HANDLES:
            raise bad_request(f"ack 1..{models.MAX_ACK_HANDLES} entries at a time", "entries")
        originals = [e.receipt_handle for e in request.entries]
        for i, h in enumerate(originals):
            check_handle(h, f"entries[{i}].receipt_handle")
        broker = self.broker
        handles = await self._hold(originals, context)

        async def local() -> dict[str, Any]:
            results = await popcalls.ack(broker, group, handles)
            return {
                "results": [
                    {"receipt_handle": r.receipt_handle, "status": r.status.value} for r in results
                ]
            }

        try:
            answer = await self._pop_call(
                self._group_path(group, "ack"),
                {"receipt_handles": handles},
                local,
                self._budget_s(context),
            )
            results = answer.get("results")
            if not isinstance(results, list) or len(results) != len(handles):
                raise ApiError(500, "internal", "the ack answer does not match the request")
        except BaseException:
            self._release(originals, [None] * len(originals))
            raise
        self._release(originals, [_ack_stop(r.get("status")) for r in results])
        entries = []
        failed = 0
        for e, r in zip(request.entries, results, strict=True):
            ok = r.get("status") in ("acked", "already_acked")
            failed += not ok
            entries.append(
                spb.AckMessageResultEntry(
                    message_id=e.message_id,
                    receipt_handle=e.receipt_handle,
                    status=make_status() if ok else expired(),
                )
            )
        self.metrics.acked.inc(len(entries) - failed)
        if failed == 0:
            top = make_status()
        elif failed == len(entries):
            top = entries[0].status
        else:
            top = pb.Status(code=Code.MULTIPLE_RESULTS, message="some entries failed")
        return spb.AckMessageResponse(status=top, entries=entries)

    @rpc(spb.ChangeInvisibleDurationResponse)
    async def ChangeInvisibleDuration(self, request: Any, context: Any) -> Any:
        group = check_group(request.group.name)
        record.validate_topic(request.topic.name, "topic")
        handle = check_handle(request.receipt_handle)
        invisible_ms = invisible_ms_of(request.invisible_duration)
        broker = self.broker
        original = handle
        (handle,) = await self._hold([original], context)

        async def local() -> dict[str, Any]:
            return popcalls.change_json(
                await popcalls.change_invisible(broker, group, handle, invisible_ms)
            )

        try:
            answer = await self._pop_call(
                self._group_path(group, "invisible"),
                {"receipt_handle": handle, "invisible_ms": invisible_ms},
                local,
                self._budget_s(context),
            )
        except BaseException:
            self._release([original], [None])
            raise
        changed = answer.get("status") == "changed" and bool(answer.get("receipt_handle"))
        # The client holds the new handle from now on and manages its time itself.
        self._release([original], [StopReason.CHANGED if changed else StopReason.STALE])
        if not changed:
            return spb.ChangeInvisibleDurationResponse(status=expired())
        return spb.ChangeInvisibleDurationResponse(
            status=make_status(), receipt_handle=str(answer["receipt_handle"])
        )

    @rpc(spb.ForwardMessageToDeadLetterQueueResponse)
    async def ForwardMessageToDeadLetterQueue(self, request: Any, context: Any) -> Any:
        group = check_group(request.group.name)
        record.validate_topic(request.topic.name, "topic")
        handle = check_handle(request.receipt_handle)
        broker = self.broker
        original = handle
        (handle,) = await self._hold([original], context)

        async def local() -> dict[str, Any]:
            result = await popcalls.forward_to_dlq(broker, group, handle)
            return {"status": result.status.value}

        try:
            answer = await self._pop_call(
                self._group_path(group, "dlq"),
                {"receipt_handle": handle},
                local,
                self._budget_s(context),
            )
        except BaseException:
            self._release([original], [None])
            raise
        forwarded = answer.get("status") == "forwarded"
        self._release([original], [StopReason.DLQ if forwarded else StopReason.STALE])
        if not forwarded:
            return spb.ForwardMessageToDeadLetterQueueResponse(status=expired())
        return spb.ForwardMessageToDeadLetterQueueResponse(status=make_status())
