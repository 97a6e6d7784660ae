"""The pop apply extension (``pop``): what every replica does with a pop command.

Decodes the command (see the package docstring for the payloads), loads the touched queues'
state from kv, runs :mod:`chronomq.pop.core` with the command's propose time and Raft index,
writes the CK timer messages and DLQ copies as derived records, and stores the state back, all
in one apply. Total: a payload or item that breaks a rule is answered ``invalid`` (counted,
logged), never raised; only a fault of this node escapes.

What apply reads of the store is the committed log: queue max offsets, ConsumeQueue units (tags
codes, for a filter; ConsumeQueue files are never deleted), the revive topic and, for a DLQ
copy, the original record (both kept by retention, :mod:`chronomq.pop.hold`). It never uses this
node's retention view (the queue's min offset differs between replicas while their retention
runs at different moments): the leader carries its min offsets in the ``pop`` command.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson

from chronomq.pop import core, state
from chronomq.pop.core import AckStatus, ReviveAction
from chronomq.pop.state import (
    MAX_INVISIBLE_MS,
    MAX_ITEMS_PER_COMMAND,
    MAX_POP_MESSAGES,
    MAX_POP_QUEUES,
    MAX_RECONSUME_TIMES_CEILING,
    MAX_REVIVE_PER_COMMAND,
    MIN_INVISIBLE_MS,
    REVIVE_OFFSET_KEY,
    REVIVE_QUEUE,
    REVIVE_TOPIC,
    Inflight,
    QueueState,
)
from chronomq.raftlog import record
from chronomq.raftlog.consumequeue import tags_hash
from chronomq.raftlog.errors import InvalidInput
from chronomq.raftlog.extension import ApplyContext, DerivedRecord
from chronomq.raftlog.store import Store
from chronomq.schedule import properties as sprops
from chronomq.schedule.errors import InvalidRetryRequest
from chronomq.schedule.retry import dlq_topic
from chronomq.timer import message as tm

log = logging.getLogger(__name__)

NAME = "pop"
DLQ_QUEUE = 0
QueueKey = tuple[str, str, int]
#: Most ConsumeQueue units a filtered ``pop`` looks at per queue: it passes over at most this
#: many messages of other tags in one command (the next receive goes on from there).
MAX_FILTER_SCAN = 1024
#: Most tags one filter names (``TagA || TagB``).
MAX_FILTER_TAGS = 32


@dataclass(frozen=True, slots=True)
class PickedRef:
    """One message a ``pop`` command handed out."""

    queue: int
    offset: int
    attempt: int
    pop_id: int
    until_ms: int


@dataclass(frozen=True, slots=True)
class PopOutcome:
    picked: tuple[PickedRef, ...] = ()
    invalid: str | None = None


@dataclass(frozen=True, slots=True)
class ItemAnswer:
    """The answer to one item of an ``ack``/``chg``/``dlq`` command; ``entry`` is the new
    hand-out after a change."""

    status: AckStatus
    entry: Inflight | None = None
    reason: str = ""


@dataclass(frozen=True, slots=True)
class ItemsOutcome:
    answers: tuple[ItemAnswer, ...] = ()
    invalid: str | None = None


@dataclass(slots=True)
class ReviveOutcome:
    read: int = 0
    revived: int = 0
    rearmed: int = 0
    dead: int = 0
    stale: int = 0
    malformed: int = 0
    revive_offset: int = 0
    invalid: str | None = None


@dataclass(slots=True)
class PopStats:
    """This node's counts of what apply did (not replicated; for metrics)."""

    counts: dict[str, int] = field(default_factory=dict)

    def add(self, name: str, n: int = 1) -> None:
        if n:
            self.counts[name] = self.counts.get(name, 0) + n


def _int(v: object, lo: int, hi: int) -> int | None:
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        return None
    return v


def group_problem(group: object) -> str | None:
    try:
        dlq_topic(group)  # type: ignore[arg-type]
    except InvalidRetryRequest as exc:
        return str(exc)
    return None


def topic_problem(topic: object) -> str | None:
    try:
        record.validate_topic(topic)
    except InvalidInput as exc:
        return str(exc)
    return None


class _Queues:
    """The queue states one apply touches, loaded once and written back if changed."""

    def __init__(self, ctx: ApplyContext, stats: PopStats) -> None:
        self._ctx = ctx
        self._stats = stats
        self._states: dict[QueueKey, QueueState] = {}

    def get(self, key: QueueKey) -> QueueState:
        st = self._states.get(key)
        if st is None:
            st, problem = state.decode(self._ctx.kv_get(state.kv_key(*key)))
            if problem is not None:
                log.error("pop state of %s unreadable (%s): starting it empty", key, problem)
                self._stats.add("state_unreadable")
            self._states[key] = st
        return st

    def save(self) -> None:
        for key, st in self._states.items():
            self._ctx.kv_set(state.kv_key(*key), None if st.is_empty() else state.encode(st))


class PopMachine:
    """The :class:`~chronomq.raftlog.extension.ApplyExtension` of pop consumption."""

    def __init__(self) -> None:
        self.stats = PopStats()
        self.store: Store | None = None

    @property
    def name(self) -> str:
        return NAME

    def attach(self, store: Store) -> None:
        # Everything lives in kv: nothing local to align.
        self.store = store

    def before_snapshot(self, index: int) -> None:
        pass

    def close(self) -> None:
        pass

    # ------------------------------------------------------------------ reads for others

    def queue_state(self, group: str, topic: str, queue: int) -> QueueState:
        """The committed state of one queue (a fresh copy; any thread)."""
        if self.store is None:
            return QueueState()
        return state.decode(self.store.kv.get(state.kv_key(group, topic, queue)))[0]

    def revive_offset(self) -> int:
        if self.store is None:
            return 0
        v = self.store.kv.get(REVIVE_OFFSET_KEY, 0)
        return v if isinstance(v, int) else 0

    def queue_keys(self) -> Iterator[QueueKey]:
        if self.store is None:
            return
        for key in list(self.store.kv):
            parsed = state.parse_kv_key(key)
            if parsed is not None:
                yield parsed

    def digest(self) -> str:
        """A hash of the whole replicated pop state, to compare replicas."""
        h = hashlib.sha256()
        if self.store is not None:
            for key in sorted(k for k in self.store.kv if k.startswith("pop/")):
                h.update(f"{key}={self.store.kv[key]}\n".encode())
        return h.hexdigest()

    # ------------------------------------------------------------------ apply

    def apply(self, ctx: ApplyContext, payload: Any) -> Any:
        op = payload.get("op") if isinstance(payload, dict) else None
        if op == "pop":
            return self._pop(ctx, payload)
        if op in ("ack", "chg", "dlq"):
            return self._items(ctx, op, payload)
        if op == "revive":
            return self._revive(ctx, payload)
        self.stats.add("invalid")
        log.error("pop command at index %d ignored: unknown op %r", ctx.index, str(op)[:20])
        return ItemsOutcome(invalid="unknown op")

    def _invalid_pop(self, ctx: ApplyContext, reason: str) -> PopOutcome:
        self.stats.add("invalid")
        log.error("pop command at index %d ignored: %s", ctx.index, reason)
        return PopOutcome(invalid=reason)

    def _pop(self, ctx: ApplyContext, p: dict[str, Any]) -> PopOutcome:
        group, topic, qs = p.get("g"), p.get("t"), p.get("qs")
        n = _int(p.get("n"), 1, MAX_POP_MESSAGES)
        inv = _int(p.get("inv_ms"), MIN_INVISIBLE_MS, MAX_INVISIBLE_MS)
        mrt = _int(p.get("mrt"), 0, MAX_RECONSUME_TIMES_CEILING)
        problem = group_problem(group) or topic_problem(topic)
        if problem is not None:
            return self._invalid_pop(ctx, problem)
        if n is None or inv is None or mrt is None or not isinstance(qs, list):
            return self._invalid_pop(ctx, "n, inv_ms, mrt or qs out of range")
        assert isinstance(group, str) and isinstance(topic, str)
        wanted = _tag_codes(p.get("tags"))
        if isinstance(wanted, str):
            return self._invalid_pop(ctx, wanted)
        queues = ctx.store.queue_count(topic)
        if queues is None:
            return self._invalid_pop(ctx, f"unknown topic {topic}")
        until = ctx.propose_ms + inv
        touched = _Queues(ctx, self.stats)
        picked: list[PickedRef] = []
        cks: list[DerivedRecord] = []
        for item in qs[:MAX_POP_QUEUES]:
            if len(picked) >= n:
                break
            if not isinstance(item, list) or len(item) != 2:
                continue
            q, lowest = _int(item[0], 0, queues - 1), _int(item[1], 0, 1 << 62)
            if q is None or lowest is None:
                continue
            st = touched.get((group, topic, q))
            accept = None
            if wanted is not None:
                units = ctx.store.read_units(topic, q, max(st.cursor, lowest), MAX_FILTER_SCAN)
                codes = {u.queue_offset: u.tags_code for u in units}
                accept = _accepting(codes, wanted)
            got, dropped = core.pick(
                st,
                n=n - len(picked),
                pop_id=ctx.index,
                until_ms=until,
                min_offset=lowest,
                max_offset=ctx.store.max_offset(topic, q),
                accept=accept,
                max_skip=MAX_FILTER_SCAN,
            )
            self.stats.add("dropped_by_retention", dropped)
            if got:
                picked.extend(PickedRef(q, g.offset, g.attempt, g.pop_id, g.until_ms) for g in got)
                cks.append(
                    _ck(
                        ctx,
                        len(cks),
                        group,
                        topic,
                        q,
                        ctx.index,
                        [g.offset for g in got],
                        until,
                        mrt,
                    )
                )
        if cks:
            ctx.ensure_topic(tm.TIMER_TOPIC, 1)
            ctx.append(cks)  # counts as messages: wakes the timer driver
        touched.save()  # last: a write that fails leaves the state as it was
        self.stats.add("popped", len(picked))
        return PopOutcome(tuple(picked))

    def _items(self, ctx: ApplyContext, op: str, p: dict[str, Any]) -> ItemsOutcome:
        items = p.get("items")
        mrt = _int(p.get("mrt", 0), 0, MAX_RECONSUME_TIMES_CEILING)
        if not isinstance(items, list) or len(items) > MAX_ITEMS_PER_COMMAND or mrt is None:
            self.stats.add("invalid")
            return ItemsOutcome(invalid=f"items must be a list of at most {MAX_ITEMS_PER_COMMAND}")
        touched = _Queues(ctx, self.stats)
        answers: list[ItemAnswer] = []
        extra: list[DerivedRecord] = []
        cks = 0
        for item in items:
            parsed = _item(item, with_inv=op == "chg")
            if isinstance(parsed, str):
                answers.append(ItemAnswer(AckStatus.INVALID, reason=parsed))
                continue
            group, topic, q, offset, pop_id, inv = parsed
            st = touched.get((group, topic, q))
            if op == "ack":
                answers.append(ItemAnswer(core.ack(st, offset, pop_id)))
            elif op == "chg":
                until = ctx.propose_ms + inv
                entry = core.change(st, offset, pop_id, new_pop_id=ctx.index, until_ms=until)
                if entry is None:
                    answers.append(ItemAnswer(AckStatus.EXPIRED))
                    continue
                extra.append(_ck(ctx, cks, group, topic, q, ctx.index, [offset], until, mrt))
                cks += 1
                answers.append(ItemAnswer(AckStatus.ACKED, entry))
            else:
                taken = core.take(st, offset, pop_id)
                if taken is None:
                    answers.append(ItemAnswer(AckStatus.EXPIRED))
                    continue
                dead = self._dead_letter(ctx, group, topic, q, offset, taken.attempt)
                if dead is not None:
                    extra.append(dead)
                answers.append(ItemAnswer(AckStatus.ACKED, taken))
        if cks:
            ctx.ensure_topic(tm.TIMER_TOPIC, 1)
        if extra:
            ctx.append(extra)
        touched.save()
        self.stats.add(op, sum(1 for a in answers if a.status is AckStatus.ACKED))
        return ItemsOutcome(tuple(answers))

    def _revive(self, ctx: ApplyContext, p: dict[str, Any]) -> ReviveOutcome:
        out = ReviveOutcome()
        upto = _int(p.get("upto"), 0, 1 << 62)
        start = self.revive_offset_in(ctx)
        out.revive_offset = start
        if upto is None:
            out.invalid = "upto must be a queue offset"
            self.stats.add("invalid")
            return out
        end = min(
            upto, ctx.store.max_offset(REVIVE_TOPIC, REVIVE_QUEUE), start + MAX_REVIVE_PER_COMMAND
        )
        if end <= start:
            return out
        touched = _Queues(ctx, self.stats)
        extra: list[DerivedRecord] = []
        ck_seq = 0
        msgs = ctx.store.read_messages(REVIVE_TOPIC, REVIVE_QUEUE, start, end - start)
        for msg in msgs:
            if msg.queue_offset >= end:
                break
            out.read += 1
            ck = _parse_ck(msg.body)
            if ck is None:
                out.malformed += 1
                continue
            group, topic, q, pop_id, offsets, mrt = ck
            st = touched.get((group, topic, q))
            rearm: list[int] = []
            rearm_until = 0
            for offset in offsets:
                action, entry = core.revive(
                    st, offset, pop_id, now_ms=ctx.propose_ms, max_reconsume_times=mrt
                )
                if action is ReviveAction.STALE:
                    out.stale += 1
                elif action is ReviveAction.REARM:
                    assert entry is not None
                    rearm.append(offset)
                    rearm_until = max(rearm_until, entry.until_ms)
                elif action is ReviveAction.REVIVED:
                    out.revived += 1
                else:
                    assert entry is not None
                    out.dead += 1
                    dead = self._dead_letter(ctx, group, topic, q, offset, entry.attempt)
                    if dead is not None:
                        extra.append(dead)
            if rearm:
                out.rearmed += len(rearm)
                extra.append(_ck(ctx, ck_seq, group, topic, q, pop_id, rearm, rearm_until, mrt))
                ck_seq += 1
        # Records of [start, end) that retention removed are skipped too (retention must keep
        # what pop still needs: see the package docstring).
        new_offset = end
        if ck_seq:
            ctx.ensure_topic(tm.TIMER_TOPIC, 1)
        if extra:
            ctx.append(extra)
        touched.save()
        ctx.kv_set(REVIVE_OFFSET_KEY, new_offset)
        out.revive_offset = new_offset
        for name in ("revived", "rearmed", "dead", "stale", "malformed"):
            self.stats.add(name, getattr(out, name))
        return out

    @staticmethod
    def revive_offset_in(ctx: ApplyContext) -> int:
        v = ctx.kv_get(REVIVE_OFFSET_KEY)
        return v if isinstance(v, int) else 0

    def _dead_letter(
        self, ctx: ApplyContext, group: str, topic: str, q: int, offset: int, attempt: int
    ) -> DerivedRecord | None:
        """The copy of ``topic``/``q``/``offset`` for ``%DLQ%{group}``, or ``None`` when the
        record is gone (retention must keep held messages: see the package docstring)."""
        found = ctx.store.read_messages(topic, q, offset, 1)
        if not found or found[0].queue_offset != offset:
            self.stats.add("dead_letter_missing")
            log.error("pop: %s/%d offset %d for the DLQ of %s is gone", topic, q, offset, group)
            return None
        msg = found[0]
        props = dict(msg.properties)
        props.setdefault(sprops.RETRY_TOPIC, topic)
        props.setdefault(sprops.ORIGIN_MESSAGE_ID, msg.msg_id_hex)
        props[sprops.RECONSUME_TIME] = str(attempt)
        dlq = dlq_topic(group)
        ctx.ensure_topic(dlq, 1)
        data = record.encode(
            topic=dlq,
            queue_id=DLQ_QUEUE,
            msg_id=msg.msg_id,
            body=msg.body,
            properties=props,
            flag=msg.flag,
            sys_flag=msg.sys_flag,
            born_ms=msg.born_ms,
            store_ms=ctx.propose_ms,
            reconsume_times=attempt,
            tags_code=tags_hash(props.get(record.PROPERTY_TAGS)),
            max_message_bytes=max(len(msg.body), record.DEFAULT_MAX_MESSAGE_BYTES),
        )
        return DerivedRecord(dlq, DLQ_QUEUE, data)


def _tag_codes(tags: object) -> frozenset[int] | str | None:
    """The tags_codes a ``pop`` accepts (``None``: every message), or why ``tags`` is bad."""
    if tags is None:
        return None
    if not isinstance(tags, list) or not 0 < len(tags) <= MAX_FILTER_TAGS:
        return f"tags must be a list of 1..{MAX_FILTER_TAGS} tags"
    if not all(isinstance(t, str) and 0 < len(t) <= 255 for t in tags):
        return "a tag is a string of 1..255 characters"
    return frozenset(tags_hash(t) for t in tags)


def _accepting(codes: dict[int, int], wanted: frozenset[int]) -> Callable[[int], bool | None]:
    # Beyond the units read (MAX_FILTER_SCAN): unknown, pick stops there.
    return lambda offset: None if offset not in codes else codes[offset] in wanted


def _item(item: object, *, with_inv: bool) -> tuple[str, str, int, int, int, int] | str:
    """``(group, topic, queue, offset, pop_id, inv_ms)`` of one handle item, or why not."""
    n = 6 if with_inv else 5
    if not isinstance(item, list) or len(item) != n:
        return f"an item is a list of {n} values"
    group, topic = item[0], item[1]
    problem = group_problem(group) or topic_problem(topic)
    if problem is not None:
        return problem
    q, offset, pop_id = _int(item[2], 0, 1023), _int(item[3], 0, 1 << 62), _int(item[4], 0, 1 << 62)
    inv = _int(item[5], MIN_INVISIBLE_MS, MAX_INVISIBLE_MS) if with_inv else 0
    if q is None or offset is None or pop_id is None or inv is None:
        return "queue, offset, pop id or invisible time out of range"
    return group, topic, q, offset, pop_id, inv


def _ck(
    ctx: ApplyContext,
    seq: int,
    group: str,
    topic: str,
    q: int,
    pop_id: int,
    offsets: list[int],
    until_ms: int,
    mrt: int,
) -> DerivedRecord:
    """The CK timer message: due at ``until_ms``, delivered by the timer to the revive topic."""
    body = orjson.dumps({"g": group, "t": topic, "q": q, "p": pop_id, "o": offsets, "mrt": mrt})
    msg_id = hashlib.blake2b(f"pop-ck/{ctx.index}/{seq}".encode(), digest_size=16).digest()
    data = record.encode(
        topic=tm.TIMER_TOPIC,
        queue_id=tm.TIMER_QUEUE,
        msg_id=msg_id,
        body=body,
        properties={
            tm.TIMER_OUT_MS: str(until_ms),
            tm.REAL_TOPIC: REVIVE_TOPIC,
            tm.REAL_QID: str(REVIVE_QUEUE),
        },
        born_ms=ctx.propose_ms,
        store_ms=ctx.propose_ms,
        tags_code=until_ms,
    )
    return DerivedRecord(tm.TIMER_TOPIC, tm.TIMER_QUEUE, data)


def _parse_ck(body: bytes) -> tuple[str, str, int, int, list[int], int] | None:
    try:
        raw = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(raw, dict):
        return None
    group, topic, offsets = raw.get("g"), raw.get("t"), raw.get("o")
    q, pop_id = _int(raw.get("q"), 0, 1023), _int(raw.get("p"), 0, 1 << 62)
    mrt = _int(raw.get("mrt"), 0, MAX_RECONSUME_TIMES_CEILING)
    if group_problem(group) or topic_problem(topic) or q is None or pop_id is None or mrt is None:
        return None
    if not isinstance(offsets, list) or not 0 < len(offsets) <= MAX_POP_MESSAGES:
        return None
    checked = [o for o in offsets if _int(o, 0, 1 << 62) is not None]
    if len(checked) != len(offsets):
        return None
    assert isinstance(group, str) and isinstance(topic, str)
    return group, topic, q, pop_id, checked, mrt
