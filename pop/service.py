"""The leader's side of pop consumption: the API the RocketMQ gRPC layer calls, and the revive
driver.

API (call on the leader; a follower's proposal fails with :class:`chronomq.raftlog.errors.NotLeader`,
which the caller forwards as it does for produce). Every call validates at once and raises
:class:`PopError` (a bad argument, an unknown topic) or :class:`~chronomq.pop.handle.InvalidHandle`
(a handle that does not verify) before anything is proposed; otherwise it returns a
:class:`concurrent.futures.Future` of a typed answer, resolved once the command is committed
and applied on this node (wrap it with ``asyncio.wrap_future`` and bound the wait: pysyncobj may
never answer, and an unanswered receive only leaves its messages invisible until they revive).
The answer is built by the thread that completes the commit (pysyncobj's, on a real node): for
a receive that is reading at most :data:`~chronomq.pop.state.MAX_POP_MESSAGES` records and
signing their handles.

* :meth:`PopService.receive` -> ``list[Popped]``: one ``pop`` command; the messages are read
  from this node's store once applied. Long polling is the caller's: call again when the topic
  grows (:meth:`PopService.visible` says whether anything could be handed out now).
* :meth:`PopService.ack` -> ``list[AckResult]`` (one command for up to
  :data:`~chronomq.pop.state.MAX_ITEMS_PER_COMMAND` handles).
* :meth:`PopService.change_invisible` -> :class:`ChangeResult` with a new handle;
  :meth:`PopService.change_invisible_many` changes up to
  :data:`~chronomq.pop.state.MAX_ITEMS_PER_COMMAND` in one command.
* :meth:`PopService.forward_to_dlq` -> :class:`ForwardResult`.

Revive driver: leader-only work ``pop-revive`` owned by the node's
:class:`chronomq.raftlog.leadership.Leadership`, a loop of its
:class:`chronomq.raftlog.leaderloop.LeaderRuntime`. While its term token is current it proposes one
``revive`` command at a time whenever the revive topic holds CKs beyond the committed
``pop/revive`` offset (the timer delivered them); it wakes when a commit grows that topic on the
leader. :meth:`PopService.step` is one turn by hand (tests call it with a fake clock);
:meth:`start` runs it on the leader runtime.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from enum import Enum
from typing import Any, Final, TypeVar

from chronomq.pop import core
from chronomq.pop.core import AckStatus
from chronomq.pop.handle import Handle, HandleCodec
from chronomq.pop.machine import (
    MAX_FILTER_TAGS,
    NAME,
    ItemsOutcome,
    PopMachine,
    PopOutcome,
    ReviveOutcome,
    group_problem,
    topic_problem,
)
from chronomq.pop.state import (
    MAX_INVISIBLE_MS,
    MAX_ITEMS_PER_COMMAND,
    MAX_POP_MESSAGES,
    MAX_POP_QUEUES,
    MAX_RECONSUME_TIMES_CEILING,
    MIN_INVISIBLE_MS,
    REVIVE_QUEUE,
    REVIVE_TOPIC,
)
from chronomq.raftlog import record
from chronomq.raftlog.errors import RaftLogError
from chronomq.raftlog.leaderloop import LeaderRuntime, SteppedLoop, SteppedWork, Steps, Wake
from chronomq.raftlog.leadership import Leadership, TermToken
from chronomq.raftlog.node import RaftLog
from chronomq.raftlog.store import ApplyResult

log = logging.getLogger(__name__)

REVIVE_WORK: Final = "pop-revive"
REVIVE_LOOP: Final = "pop revive driver"
#: How long the driver sleeps when idle (a commit growing the revive topic wakes it sooner).
IDLE_S: Final = 1.0

T = TypeVar("T")
U = TypeVar("U")


class PopError(ValueError):
    """A caller's mistake: ``code`` is ``bad_request`` or ``unknown_topic``; ``field`` names
    the argument."""

    def __init__(self, code: str, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.field = field


@dataclass(frozen=True, slots=True)
class Popped:
    """One received message and what the consumer needs to ack it."""

    group: str
    topic: str
    queue: int
    offset: int
    delivery_attempt: int
    receipt_handle: str
    invisible_until_ms: int
    message: record.Message


@dataclass(frozen=True, slots=True)
class AckResult:
    receipt_handle: str
    status: AckStatus
    """ACKED, ALREADY_ACKED (a repeat: success too) or EXPIRED (its message was revived,
    handed out again, changed or sent to the DLQ: the ack did nothing)."""


class ChangeStatus(Enum):
    CHANGED = "changed"
    EXPIRED = "expired"


@dataclass(frozen=True, slots=True)
class ChangeResult:
    status: ChangeStatus
    receipt_handle: str | None
    """The new handle (the old one is stale from now on); ``None`` when EXPIRED."""
    invisible_until_ms: int | None


class ForwardStatus(Enum):
    FORWARDED = "forwarded"
    EXPIRED = "expired"


@dataclass(frozen=True, slots=True)
class ForwardResult:
    status: ForwardStatus


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


def _then(fut: Future[T], fn: Callable[[T], U]) -> Future[U]:
    out: Future[U] = Future()

    def done(f: Future[T]) -> None:
        if out.done():
            return
        exc = f.exception()
        if exc is not None:
            out.set_exception(exc)
            return
        try:
            out.set_result(fn(f.result()))
        except Exception as e:  # a bug in the transform must still answer the caller
            out.set_exception(e)

    fut.add_done_callback(done)
    return out


class PopService:
    """One node's pop consumption: the apply extension, the API and the revive driver."""

    def __init__(
        self,
        raftlog: RaftLog,
        secret: bytes,
        *,
        max_reconsume_times: int = 16,
        commit_timeout_ms: int = 10_000,
        runtime: LeaderRuntime | None = None,
    ) -> None:
        if not 0 <= max_reconsume_times <= MAX_RECONSUME_TIMES_CEILING:
            raise ValueError(f"max_reconsume_times must be 0..{MAX_RECONSUME_TIMES_CEILING}")
        self.raftlog = raftlog
        self.codec = HandleCodec(secret)
        self.max_reconsume_times = max_reconsume_times
        self.commit_timeout_ms = commit_timeout_ms
        self.machine = PopMachine()
        self._own_runtime = runtime is None
        self.runtime = runtime or LeaderRuntime(Leadership(now_ms=raftlog.clock.monotonic_ms))
        self.leadership = self.runtime.leadership
        self._rr: dict[tuple[str, str], itertools.count[int]] = {}
        self._wake = Wake()
        self._stop = threading.Event()
        self._token_lock = threading.Lock()
        self._token: TermToken | None = None
        steps = Steps(self._begin, self._step, self._failed, self._end)
        self.loop = SteppedLoop(REVIVE_WORK, REVIVE_LOOP, steps, self._wake, "pop revive driver")
        """The revive driver as a loop of the leader runtime."""
        self.work = SteppedWork(REVIVE_WORK, REVIVE_LOOP, steps, self._wake)
        """The revive driver as leader-only work turned by hand (tests with a fake clock)."""
        self._inflight: Future[ApplyResult] | None = None
        self._inflight_deadline_ms = 0.0
        self._seen_revive = 0
        self.revive_commands = 0
        self.last_revive: ReviveOutcome | None = None
        self._revived: asyncio.Future[None] | None = None

    # ------------------------------------------------------------------ lifecycle

    def register(self) -> None:
        """The apply extension and listener, with the revive driver turned by hand
        (:meth:`step`, tests with a fake clock)."""
        self._register()
        self.leadership.register(self.work)
        if self._own_runtime:
            self.raftlog.add_leader_listener(self.leadership.on_leader)

    def _register(self) -> None:
        self.raftlog.register_extension(self.machine)
        self.raftlog.add_apply_listener(self._on_apply)

    def start(self) -> None:
        """The apply extension and listener, and the revive driver on the leader runtime (the
        service's own, started here and fed by the log's leadership, if it was given none)."""
        self._register()
        self.runtime.add(self.loop.spec())
        if self._own_runtime:
            self.runtime.start()
            self.raftlog.add_leader_listener(self.leadership.on_leader)

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self.work.close()
        if self._own_runtime:
            self.runtime.close()

    def stats(self) -> dict[str, Any]:
        """This node's view: the revive topic read so far and behind, and what apply did."""
        committed = self.machine.revive_offset()
        end = self.raftlog.store.max_offset(REVIVE_TOPIC, REVIVE_QUEUE)
        return {
            "role": "leader" if self.raftlog.is_leader else "follower",
            "active": self._token is not None and self._token.is_current(),
            "revive_offset": committed,
            "revive_behind": max(0, end - committed),
            "revive_commands": self.revive_commands,
            "queues": sum(1 for _ in self.machine.queue_keys()),
            "applied": dict(sorted(self.machine.stats.counts.items())),
        }

    # ------------------------------------------------------------------ API

    def _check_names(self, group: str, topic: str) -> int:
        problem = group_problem(group)
        if problem is not None:
            raise PopError("bad_request", problem, "group")
        problem = topic_problem(topic)
        if problem is not None:
            raise PopError("bad_request", problem, "topic")
        queues = self.raftlog.store.queue_count(topic)
        if queues is None:
            raise PopError("unknown_topic", f"topic {topic} does not exist", "topic")
        return queues

    def _mrt(self, max_reconsume_times: int | None) -> int:
        if max_reconsume_times is None:
            return self.max_reconsume_times
        if (
            isinstance(max_reconsume_times, bool)
            or not isinstance(max_reconsume_times, int)
            or not 0 <= max_reconsume_times <= MAX_RECONSUME_TIMES_CEILING
        ):
            raise PopError(
                "bad_request",
                f"max_reconsume_times must be 0..{MAX_RECONSUME_TIMES_CEILING}",
                "max_reconsume_times",
            )
        return max_reconsume_times

    @staticmethod
    def _check_invisible(invisible_ms: int) -> None:
        if (
            isinstance(invisible_ms, bool)
            or not isinstance(invisible_ms, int)
            or not MIN_INVISIBLE_MS <= invisible_ms <= MAX_INVISIBLE_MS
        ):
            raise PopError(
                "bad_request",
                f"invisible duration must be {MIN_INVISIBLE_MS}..{MAX_INVISIBLE_MS} ms",
                "invisible_duration",
            )

    def receive(
        self,
        group: str,
        topic: str,
        max_messages: int,
        invisible_ms: int,
        *,
        queue: int | None = None,
        tags: Sequence[str] | None = None,
        max_reconsume_times: int | None = None,
    ) -> Future[list[Popped]]:
        """Hand out up to ``max_messages`` visible messages of ``topic`` to ``group``.

        ``queue``: only that queue (a ``MessageQueue`` the client names); ``None`` (or the
        protocol's ``-1``): every queue of the topic, starting at a rotating one.
        ``tags``: the subscription's tags (RocketMQ's ``TagA || TagB``); ``None`` for ``*``.
        Messages with other tags are passed over for this group for good, as RocketMQ does.
        ``max_reconsume_times``: the group's limit, if not the node's.
        """
        queues = self._check_names(group, topic)
        if (
            isinstance(max_messages, bool)
            or not isinstance(max_messages, int)
            or not 1 <= max_messages <= MAX_POP_MESSAGES
        ):
            raise PopError(
                "bad_request", f"max_message_num must be 1..{MAX_POP_MESSAGES}", "max_message_num"
            )
        self._check_invisible(invisible_ms)
        mrt = self._mrt(max_reconsume_times)
        tag_list = None if tags is None else list(tags)
        if tag_list is not None and (
            not 0 < len(tag_list) <= MAX_FILTER_TAGS
            or not all(isinstance(t, str) and 0 < len(t) <= 255 for t in tag_list)
        ):
            raise PopError(
                "bad_request", f"tags: 1..{MAX_FILTER_TAGS} tags of 1..255 characters", "tags"
            )
        start = next(self._rr.setdefault((group, topic), itertools.count()))
        store = self.raftlog.store
        if queue is None or queue == -1:
            order = [(start + i) % queues for i in range(min(queues, MAX_POP_QUEUES))]
        elif isinstance(queue, bool) or not isinstance(queue, int) or not 0 <= queue < queues:
            raise PopError("bad_request", f"topic {topic} has queues 0..{queues - 1}", "queue")
        else:
            order = [queue]
        payload = {
            "op": "pop",
            "g": group,
            "t": topic,
            "qs": [[q, store.min_offset(topic, q)] for q in order],
            "n": max_messages,
            "inv_ms": invisible_ms,
            "mrt": mrt,
            "tags": tag_list,
        }
        fut = self.raftlog.propose_extension(NAME, payload)
        return _then(fut, lambda res: self._popped(group, topic, res))

    def _popped(self, group: str, topic: str, res: ApplyResult) -> list[Popped]:
        out = res.ext
        if not isinstance(out, PopOutcome):
            raise PopError("bad_request", f"pop command answered {out!r}")
        if out.invalid is not None:
            raise PopError("bad_request", out.invalid)
        popped: list[Popped] = []
        store = self.raftlog.store
        for p in out.picked:
            found = store.read_messages(topic, p.queue, p.offset, 1)
            if not found or found[0].queue_offset != p.offset:
                # Gone by retention here: it stays in flight and revives (then the DLQ).
                log.warning("pop: %s/%d offset %d could not be read", topic, p.queue, p.offset)
                continue
            handle = self.codec.encode(
                Handle(group, topic, p.queue, p.offset, p.pop_id, p.attempt, p.until_ms)
            )
            popped.append(
                Popped(group, topic, p.queue, p.offset, p.attempt, handle, p.until_ms, found[0])
            )
        return popped

    def decode(self, receipt_handle: str) -> Handle:
        """The handle's content, verified (or :class:`InvalidHandle`)."""
        return self.codec.decode(receipt_handle)

    def ack(self, receipt_handles: Sequence[str]) -> Future[list[AckResult]]:
        if not 0 < len(receipt_handles) <= MAX_ITEMS_PER_COMMAND:
            raise PopError(
                "bad_request", f"ack 1..{MAX_ITEMS_PER_COMMAND} handles at a time", "entries"
            )
        handles = [self.codec.decode(h) for h in receipt_handles]
        items = [[h.group, h.topic, h.queue, h.offset, h.pop_id] for h in handles]
        fut = self.raftlog.propose_extension(NAME, {"op": "ack", "items": items})
        texts = list(receipt_handles)
        return _then(
            fut,
            lambda res: [
                AckResult(t, a.status) for t, a in zip(texts, self._answers(res), strict=True)
            ],
        )

    def change_invisible(
        self,
        receipt_handle: str,
        invisible_ms: int,
        *,
        max_reconsume_times: int | None = None,
    ) -> Future[ChangeResult]:
        fut = self.change_invisible_many(
            [receipt_handle], invisible_ms, max_reconsume_times=max_reconsume_times
        )
        return _then(fut, lambda results: results[0])

    def change_invisible_many(
        self,
        receipt_handles: Sequence[str],
        invisible_ms: int,
        *,
        max_reconsume_times: int | None = None,
    ) -> Future[list[ChangeResult]]:
        """One ``chg`` command for up to :data:`MAX_ITEMS_PER_COMMAND` handles (of any
        groups), each given ``invisible_ms`` from the command's propose time."""
        if not 0 < len(receipt_handles) <= MAX_ITEMS_PER_COMMAND:
            raise PopError(
                "bad_request",
                f"change 1..{MAX_ITEMS_PER_COMMAND} handles at a time",
                "receipt_handles",
            )
        handles = [self.codec.decode(h) for h in receipt_handles]
        self._check_invisible(invisible_ms)
        mrt = self._mrt(max_reconsume_times)
        items = [[h.group, h.topic, h.queue, h.offset, h.pop_id, invisible_ms] for h in handles]
        fut = self.raftlog.propose_extension(NAME, {"op": "chg", "items": items, "mrt": mrt})

        def answer(res: ApplyResult) -> list[ChangeResult]:
            out = []
            for h, a in zip(handles, self._answers(res), strict=True):
                if a.status is not AckStatus.ACKED or a.entry is None:
                    out.append(ChangeResult(ChangeStatus.EXPIRED, None, None))
                    continue
                e = a.entry
                new = Handle(h.group, h.topic, h.queue, h.offset, e.pop_id, e.attempt, e.until_ms)
                out.append(ChangeResult(ChangeStatus.CHANGED, self.codec.encode(new), e.until_ms))
            return out

        return _then(fut, answer)

    def forward_to_dlq(self, receipt_handle: str) -> Future[ForwardResult]:
        h = self.codec.decode(receipt_handle)
        item = [h.group, h.topic, h.queue, h.offset, h.pop_id]
        fut = self.raftlog.propose_extension(NAME, {"op": "dlq", "items": [item]})

        def answer(res: ApplyResult) -> ForwardResult:
            (a,) = self._answers(res)
            ok = a.status is AckStatus.ACKED
            return ForwardResult(ForwardStatus.FORWARDED if ok else ForwardStatus.EXPIRED)

        return _then(fut, answer)

    @staticmethod
    def _answers(res: ApplyResult) -> tuple[Any, ...]:
        out = res.ext
        if not isinstance(out, ItemsOutcome) or out.invalid is not None:
            raise PopError("bad_request", f"command answered {out!r}")
        for a in out.answers:
            if a.status is AckStatus.INVALID:
                raise PopError("bad_request", a.reason, "receipt_handle")
        return out.answers

    def visible(self, group: str, topic: str, queue: int | None = None) -> bool:
        """Whether a receive (of ``queue``, or of any queue) could hand out something now
        (committed state on this node)."""
        store = self.raftlog.store
        n = store.queue_count(topic) or 0
        for q in range(n) if queue is None else ([queue] if 0 <= queue < n else []):
            st = self.machine.queue_state(group, topic, q)
            lo, hi = store.min_offset(topic, q), store.max_offset(topic, q)
            if core.visible(st, min_offset=lo, max_offset=hi):
                return True
        return False

    # ------------------------------------------------------------------ revive driver

    def revived_future(self) -> asyncio.Future[None]:
        """On an event loop: a future resolved when a revive makes messages visible again on
        this node (a long-polling receive waits on it, as it waits on the queues for new
        messages: a revive grows no queue)."""
        loop = asyncio.get_running_loop()
        with self._token_lock:
            fut = self._revived
            if fut is None or fut.done() or fut.get_loop() is not loop:
                fut = self._revived = loop.create_future()
            return fut

    def _on_apply(self, result: ApplyResult) -> None:
        # Raft thread: cheap. Wake long polls when a revive made messages visible; wake the
        # driver when the revive topic grew on the leader.
        out = result.ext
        if isinstance(out, ReviveOutcome) and out.revived:
            with self._token_lock:
                fut, self._revived = self._revived, None
            if fut is not None and not fut.done():
                fut.get_loop().call_soon_threadsafe(_resolve, fut)
        if not result.messages or not self.raftlog.is_leader:
            return
        end = self.raftlog.store.max_offset(REVIVE_TOPIC, REVIVE_QUEUE)
        if end != self._seen_revive:
            self._seen_revive = end
            self._wake.set()

    def _begin(self, token: TermToken) -> None:
        self._token = token

    def _end(self) -> None:
        self._token = None
        self._inflight = None

    def step(self) -> float:
        """One turn of the revive driver; how long it may sleep (a wake cuts it short)."""
        return self.work.turn()

    def _step(self) -> float:
        token = self._token
        if token is None or self._stop.is_set():
            return IDLE_S
        now = self.raftlog.clock.monotonic_ms()
        if self._inflight is not None:
            if not self._inflight.done():
                if now < self._inflight_deadline_ms:
                    return 0.05
                log.warning("pop revive command not answered in time; proposing again")
            else:
                exc = self._inflight.exception()
                if exc is None:
                    out = self._inflight.result().ext
                    if isinstance(out, ReviveOutcome):
                        self.last_revive = out
                else:
                    log.info("pop revive command failed: %s", exc)
            self._inflight = None
        committed = self.machine.revive_offset()
        end = self.raftlog.store.max_offset(REVIVE_TOPIC, REVIVE_QUEUE)
        if end <= committed or not token.is_current():
            return IDLE_S
        # Safe to repeat: a revive applied twice finds the entries moved (STALE).
        try:
            fut = self.raftlog.propose_extension(NAME, {"op": "revive", "upto": end})
        except RaftLogError as exc:  # not the leader any more: the token will say so
            log.info("pop revive not proposed: %s", exc)
            return IDLE_S
        fut.add_done_callback(lambda _f: self._wake.set())
        self._inflight = fut
        self._inflight_deadline_ms = now + self.commit_timeout_ms
        self.revive_commands += 1
        return 0.0

    def _failed(self) -> None:
        self._inflight = None
