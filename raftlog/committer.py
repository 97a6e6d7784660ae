"""Group commit: many client batches, one Raft command.

Callers hand in batches (already encoded records plus conditions and state updates) from any
thread and get a ``concurrent.futures.Future``. One thread packs waiting batches into commands,
bounded by message count and bytes, keeps at most ``max_inflight`` commands proposed at once,
and resolves each batch's future from pysyncobj's callback. Every command has a deadline: when
it passes with no callback the batch fails with :class:`CommitTimeout` (its outcome is unknown,
so a retry must reuse the idempotency key, which apply honours).

Answers tell the truth: :class:`NotLeader` only for a batch that was never proposed (or whose
entry was replaced by another leader's), :class:`CommitOutcomeUnknown` for one proposed when
leadership changed or lapsed. Back-pressure counts messages, bytes and time: a batch is refused
with :class:`Overloaded` while ``max_pending_messages`` or ``max_pending_bytes`` are held, the
bytes counting every batch from submission until it is answered (queued or in flight), and
while the oldest batch not yet answered has waited more than a quarter of the commit timeout.
The byte bound assumes a commit rate; on a machine that commits slower than that (a disk busy
with another's writes, the cores with another's work) what it admits would wait past the
timeout and be answered 503 ``commit_timeout``, outcome unknown. The age bound refuses new
batches (429, nothing stored) as soon as commits fall that far behind, whatever the rate.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from pysyncobj import FAIL_REASON

from chronomq.raftlog import command as cmdcodec
from chronomq.raftlog.errors import (
    ApplyRejected,
    CommitOutcomeUnknown,
    CommitTimeout,
    ConditionFailed,
    IdempotencyKeyReused,
    NotLeader,
    Overloaded,
    ReplicationError,
    UnknownQueue,
)
from chronomq.raftlog.store import (
    BAD_QUEUE,
    CONDITION_FAILED,
    KEY_REUSED,
    REJECTED,
    ApplyResult,
    BatchOutcome,
)

log = logging.getLogger(__name__)

Propose = Callable[[bytes, Callable[[Any, int], None]], None]


@dataclass(slots=True)
class PendingBatch:
    key: str
    topics: list[str]
    messages: list[tuple[int, int, int]]  # (topic index in self.topics, queue id, size)
    blob: bytes
    expect: Mapping[str, cmdcodec.Scalar] | None = None
    updates: Mapping[str, cmdcodec.Scalar] | None = None
    creates: Mapping[str, int] | None = None
    fingerprint: str | None = None  # set for a client's idempotency key
    future: Future[BatchOutcome] = field(default_factory=Future)
    submitted: float = field(default_factory=time.monotonic)


@dataclass(slots=True)
class _InFlight:
    batches: list[PendingBatch]
    deadline: float
    proposed: float
    size: int = 0

    @property
    def oldest(self) -> float:
        """When its first batch (the one that waited longest: the queue is FIFO) came in."""
        return self.batches[0].submitted if self.batches else self.proposed


def split_batch(batch: PendingBatch, max_command_bytes: int) -> list[PendingBatch]:
    """A client's batch larger than ``max_command_bytes`` as parts of whole messages, each at
    most that large (a single larger message alone); ``[batch]`` when it fits or cannot be
    split (conditions and state updates stay in one command).

    Part ``i`` has the key ``<key>#<i>`` and, for a client's key, the fingerprint
    ``<fingerprint>#<i>``: each part is idempotent on its own, so a retry with the same key
    stores only the parts that did not commit, and answers the others from the CommitLog.
    """
    if (
        len(batch.blob) <= max_command_bytes
        or len(batch.messages) < 2
        or batch.expect
        or batch.updates
    ):
        return [batch]
    groups: list[tuple[int, int]] = []  # (first message, end message)
    start = 0
    size = 0
    for i, (_t, _q, n) in enumerate(batch.messages):
        if i > start and size + n > max_command_bytes:
            groups.append((start, i))
            start, size = i, 0
        size += n
    groups.append((start, len(batch.messages)))
    if len(groups) == 1:
        return [batch]
    parts = []
    offset = 0
    for number, (first, end) in enumerate(groups):
        metas = batch.messages[first:end]
        length = sum(n for _t, _q, n in metas)
        parts.append(
            PendingBatch(
                key=f"{batch.key}#{number}",
                topics=batch.topics,
                messages=metas,
                blob=batch.blob[offset : offset + length],
                creates=batch.creates if number == 0 else None,
                fingerprint=(
                    f"{batch.fingerprint}#{number}" if batch.fingerprint is not None else None
                ),
                submitted=batch.submitted,
            )
        )
        offset += length
    return parts


def _join_parts(parent: Future[BatchOutcome], parts: list[PendingBatch]) -> None:
    """Resolve ``parent`` once every part is answered: the parts' placements in order, or
    the first part's error; a failure after another part may have committed is an unknown
    outcome whatever the failing part's own error says."""
    remaining = [len(parts)]
    lock = threading.Lock()

    def one_done(_f: Future[BatchOutcome]) -> None:
        with lock:
            remaining[0] -= 1
            if remaining[0]:
                return
        if parent.done():
            return
        errors = [p.future.exception() for p in parts]
        first = next((e for e in errors if e is not None), None)
        if first is None:
            outcomes = [p.future.result() for p in parts]
            parent.set_result(
                BatchOutcome(
                    key=parts[0].key.rpartition("#")[0],
                    status=outcomes[0].status,
                    placed=tuple(pl for o in outcomes for pl in o.placed),
                    duplicate=all(o.duplicate for o in outcomes),
                )
            )
            return
        stored = any(e is None or isinstance(e, CommitTimeout) for e in errors)
        if stored and isinstance(first, ReplicationError) and not isinstance(first, CommitTimeout):
            first = CommitOutcomeUnknown(
                f"part of the request may have committed ({first}); "
                "retry with the same idempotency key"
            )
        _set_exception(parent, first)

    for p in parts:
        p.future.add_done_callback(one_done)


def _failure(reason: int) -> ReplicationError:
    if reason in (FAIL_REASON.NOT_LEADER, FAIL_REASON.MISSING_LEADER):
        return NotLeader(f"this node does not lead: nothing was proposed (reason {reason})")
    if reason == FAIL_REASON.DISCARDED:
        # Another leader's entry was applied at this command's index: it did not commit.
        return NotLeader("leadership changed and the command was discarded, not committed")
    if reason == FAIL_REASON.LEADER_CHANGED:
        return CommitOutcomeUnknown(
            "leadership changed after the command was proposed; it may have committed: "
            "retry with the same idempotency key"
        )
    if reason == FAIL_REASON.QUEUE_FULL:
        return Overloaded("the Raft command queue is full")
    if reason == FAIL_REASON.UNKNOWN_OUTCOME:
        return CommitTimeout(
            "the command's outcome is unknown; retry with the same idempotency key"
        )
    return ReplicationError(f"the command failed (reason {reason})")


class GroupCommitter:
    def __init__(
        self,
        propose: Propose,
        *,
        max_messages: int,
        max_bytes: int,
        max_inflight: int,
        max_pending_messages: int,
        commit_timeout_ms: int,
        now_ms: Callable[[], int],
        idem: cmdcodec.IdemLimits | None = None,
        max_pending_bytes: int | None = None,
        max_command_bytes: int | None = None,
    ) -> None:
        """``max_command_bytes``: a client batch larger than this is split into commands of
        whole messages (:func:`split_batch`), and no more than this many bytes of commands are
        proposed and uncommitted at once (one command always may be): what one Raft tick sends
        and a follower receives, journals and applies stays near one append batch, whatever
        the request's size."""
        self._propose = propose
        self._max_messages = max_messages
        self._max_bytes = max_bytes
        self._max_inflight = max_inflight
        self._max_pending = max_pending_messages
        self._max_pending_bytes = max_pending_bytes
        self._max_command_bytes = max_command_bytes
        self._inflight_bytes = 0
        self._bytes_lock = threading.Lock()
        self._pending_bytes = 0  # blobs of batches submitted and not yet answered
        self._timeout_s = commit_timeout_ms / 1000
        #: New batches are refused while the oldest unanswered one has waited longer.
        self.max_behind_s = self._timeout_s / 4
        self._now_ms = now_ms
        self._idem = idem
        self._cond = threading.Condition()
        self._queue: collections.deque[PendingBatch] = collections.deque()
        self._queued_messages = 0
        self._inflight: dict[int, _InFlight] = {}
        self._seq = 0
        self._closed = False
        self._held_until: float | None = None  # time.monotonic; see hold()
        self.last_commit_monotonic = 0.0
        self.commands_proposed = 0
        self.commands_committed = 0
        self.on_committed: list[Callable[[ApplyResult, float], None]] = []
        self._thread = threading.Thread(target=self._run, name="group-commit", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ API

    def submit(self, batch: PendingBatch) -> Future[BatchOutcome]:
        with self._cond:
            if self._closed:
                raise NotLeader("this node is shutting down")
            if self._queued_messages + len(batch.messages) > self._max_pending and self._queue:
                raise Overloaded(
                    f"{self._queued_messages} messages are waiting for commit (limit {self._max_pending})"
                )
            refusal = self._behind_refusal(time.monotonic())
            if refusal is not None:
                raise Overloaded(refusal)
            size = len(batch.blob)
            with self._bytes_lock:
                held = self._pending_bytes
                limit = self._max_pending_bytes
                # One batch alone is always taken (its size is bounded by the request limit).
                if limit is not None and held and held + size > limit:
                    raise Overloaded(
                        f"{held} bytes are waiting for commit (max_pending_bytes {limit})"
                    )
                self._pending_bytes += size
            batch.future.add_done_callback(lambda _f: self._release(size))
            parts = [batch]
            if self._max_command_bytes is not None:
                parts = split_batch(batch, self._max_command_bytes)
                if len(parts) > 1:
                    _join_parts(batch.future, parts)
            self._queue.extend(parts)
            self._queued_messages += len(batch.messages)
            self._cond.notify()
        return batch.future

    def _release(self, size: int) -> None:
        with self._bytes_lock:
            self._pending_bytes -= size

    @property
    def pending_bytes(self) -> int:
        """Bytes of the batches submitted and not yet answered (queued or in flight)."""
        return self._pending_bytes

    def would_overload(self, size: int) -> bool:
        """True if a batch of ``size`` bytes would now be refused for bytes (a cheap early check,
        before a request body is read)."""
        limit = self._max_pending_bytes
        held = self._pending_bytes
        return limit is not None and held > 0 and held + size > limit

    def _behind_refusal(self, now: float) -> str | None:
        """Why a new batch is refused for time (the oldest batch not yet answered waited past
        :attr:`max_behind_s`), or None; under ``self._cond``."""
        if self._inflight:
            oldest = next(iter(self._inflight.values())).oldest
        elif self._queue:
            oldest = self._queue[0].submitted
        else:
            return None
        behind = now - oldest
        if behind <= self.max_behind_s:
            return None
        return (
            f"commits are {behind:.1f} s behind: the oldest write not yet committed waited that "
            f"long (limit {self.max_behind_s:.1f} s, a quarter of commit_timeout_ms)"
        )

    def behind(self) -> str | None:
        """The check of :meth:`submit` for time, early (before a request body is read): why a
        new batch would now be refused, or None."""
        with self._cond:
            return self._behind_refusal(time.monotonic())

    @property
    def queued_messages(self) -> int:
        return self._queued_messages

    @property
    def inflight_commands(self) -> int:
        return len(self._inflight)

    def hold(self, until_s: float) -> None:
        """Propose nothing new until ``until_s`` (``time.monotonic``) or :meth:`release`:
        batches submitted meanwhile wait in the queue (limits apply as usual), never proposed.

        A leadership transfer holds the leader's writes while the target catches up to the
        last index: if the leadership moves, the leadership watch fails them with
        :class:`NotLeader` (``fail_all``), and the client goes to the new leader; if it does
        not, they are proposed on release. Commands already proposed go on committing."""
        with self._cond:
            self._held_until = until_s
            self._cond.notify_all()

    def release(self) -> None:
        with self._cond:
            self._held_until = None
            self._cond.notify_all()

    @property
    def held(self) -> bool:
        until = self._held_until
        return until is not None and time.monotonic() < until

    def fail_all(self, exc: Exception, inflight_exc: Exception | None = None) -> None:
        """Fail everything queued or in flight (leadership lost, shutting down).

        Queued batches were never proposed and get ``exc``; proposed ones may still commit
        and get ``inflight_exc`` (an outcome-unknown error) when given.
        """
        with self._cond:
            queued = list(self._queue)
            self._queue.clear()
            self._queued_messages = 0
            inflight = list(self._inflight.values())
            self._inflight.clear()
            self._inflight_bytes = 0
            self._cond.notify_all()
        for b in queued:
            _set_exception(b.future, exc)
        for f in inflight:
            for b in f.batches:
                _set_exception(b.future, inflight_exc if inflight_exc is not None else exc)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=5)
        self.fail_all(
            NotLeader("this node is shutting down"),
            CommitOutcomeUnknown(
                "this node shut down after the command was proposed; it may have committed: "
                "retry with the same idempotency key"
            ),
        )

    # ------------------------------------------------------------------ loop

    def _take(self) -> list[PendingBatch]:
        taken: list[PendingBatch] = []
        n = 0
        size = 0
        while self._queue:
            nxt = self._queue[0]
            if taken and (
                n + len(nxt.messages) > self._max_messages
                or size + len(nxt.blob) > self._max_bytes
                or (
                    self._max_command_bytes is not None
                    and size + len(nxt.blob) > self._max_command_bytes
                )
            ):
                break
            taken.append(self._queue.popleft())
            n += len(nxt.messages)
            size += len(nxt.blob)
        self._queued_messages -= n
        return taken

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closed and (not self._queue or self._inflight_full() or self.held):
                    self._cond.wait(timeout=0.05)
                    self._expire()
                if self._closed:
                    return
                batches = self._take()
                self._seq += 1
                seq = self._seq
                now = time.monotonic()
                size = sum(len(b.blob) for b in batches)
                self._inflight[seq] = _InFlight(batches, now + self._timeout_s, now, size)
                self._inflight_bytes += size
            try:
                data = self._encode(batches)
                self.commands_proposed += 1
                self._propose(data, self._callback(seq))
            except Exception as exc:
                log.exception("proposing a command failed")
                self._finish(seq, None, exc)

    def _inflight_full(self) -> bool:
        if len(self._inflight) >= self._max_inflight:
            return True
        limit = self._max_command_bytes
        return (
            limit is not None
            and self._inflight_bytes > 0
            and self._inflight_bytes + len(self._queue[0].blob) > limit
        )

    def _encode(self, batches: list[PendingBatch]) -> bytes:
        topics: list[str] = []
        index: dict[str, int] = {}
        messages: list[tuple[int, int, int]] = []
        for b in batches:
            for tidx, qid, size in b.messages:
                name = b.topics[tidx]
                i = index.get(name)
                if i is None:
                    i = index[name] = len(topics)
                    topics.append(name)
                messages.append((i, qid, size))
        cmd = cmdcodec.Command(
            kind=cmdcodec.Kind.APPEND,
            propose_ms=self._now_ms(),
            batches=tuple(
                cmdcodec.Batch(
                    b.key, len(b.messages), b.expect, b.updates, b.creates, b.fingerprint
                )
                for b in batches
            ),
            topics=tuple(topics),
            messages=tuple(messages),
            blob=b"".join(b.blob for b in batches),
            idem=self._idem,
        )
        return cmdcodec.encode(cmd)

    def _expire(self) -> None:
        now = time.monotonic()
        for seq in [s for s, f in self._inflight.items() if f.deadline < now]:
            f = self._inflight.pop(seq)
            self._inflight_bytes -= f.size
            log.warning(
                "command with %d batches timed out after %.1f s", len(f.batches), self._timeout_s
            )
            for b in f.batches:
                _set_exception(
                    b.future, CommitTimeout("no commit before the deadline; outcome unknown")
                )
            self._cond.notify_all()

    def _callback(self, seq: int) -> Callable[[Any, int], None]:
        def done(res: Any, err: int) -> None:
            self._done(seq, res, err)

        return done

    def _done(self, seq: int, res: Any, err: int) -> None:
        if err == FAIL_REASON.SUCCESS:
            self._finish(seq, res, None)
        else:
            self._finish(seq, None, _failure(err))

    def _finish(self, seq: int, res: ApplyResult | None, exc: Exception | None) -> None:
        with self._cond:
            f = self._inflight.pop(seq, None)
            if f is not None:
                self._inflight_bytes -= f.size
            self._cond.notify_all()
        if f is None:
            return  # timed out already
        if exc is not None:
            for b in f.batches:
                _set_exception(b.future, exc)
            return
        assert res is not None
        now = time.monotonic()
        self.last_commit_monotonic = now
        self.commands_committed += 1
        # Apply gives one outcome per batch, in order; two batches may share a key (a retry
        # queued behind the original), so match by position, not by key.
        outcomes: list[BatchOutcome | None] = list(res.outcomes)
        if [o.key for o in res.outcomes] != [b.key for b in f.batches]:
            by_key = {o.key: o for o in reversed(res.outcomes)}
            outcomes = [by_key.get(b.key) for b in f.batches]
        for b, o in zip(f.batches, outcomes, strict=True):
            if o is None:
                _set_exception(
                    b.future, ReplicationError(f"batch {b.key} missing from the apply result")
                )
            elif o.status == CONDITION_FAILED:
                _set_exception(b.future, ConditionFailed(o.detail))
            elif o.status == KEY_REUSED:
                _set_exception(b.future, IdempotencyKeyReused(o.detail, "Idempotency-Key"))
            elif o.status == BAD_QUEUE:
                _set_exception(b.future, UnknownQueue(o.detail, "queue"))
            elif o.status == REJECTED:
                _set_exception(b.future, ApplyRejected(o.detail, o.field or None))
            elif not o.duplicate and len(o.placed) != len(b.messages):
                # Applied while this node was not leading (followers skip building results):
                # the batch is stored, but its placements must come from a retry with the
                # same key, which apply answers from the CommitLog.
                _set_exception(
                    b.future,
                    CommitTimeout("committed while leadership changed; retry with the same key"),
                )
            elif not b.future.done():
                b.future.set_result(o)
        for listener in self.on_committed:
            try:
                listener(res, (now - f.proposed) * 1000)
            except Exception:
                log.exception("commit listener failed")


def _set_exception(future: Future[Any], exc: BaseException) -> None:
    if not future.done():
        with contextlib.suppress(Exception):  # raced with another resolution
            future.set_exception(exc)
