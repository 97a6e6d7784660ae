"""Timer messages as records: the timer topic, its properties, timer message ids, and the records
apply derives from a timer message (delivered copy, rolled re-put, cancel).

A timer message waits in :data:`TIMER_TOPIC` queue 0 with RocketMQ's properties (seed 003):
``TIMER_OUT_MS`` (absolute deliver time), ``REAL_TOPIC``, ``REAL_QID``; a rolled copy also has
``TIMER_ROLL_TIMES``; a cancel carries ``TIMER_DEL_UNIQKEY`` (the msg id it cancels) and the
target's ``TIMER_OUT_MS``. The ConsumeQueue unit's tagsCode is the deliver time.

**Timer message ids** carry the deliver time, so ``DELETE /v1/timers/{msg_id}`` finds the slot
of its target without an index (an in-memory msg id -> time map would grow with the backlog)::

     0                        6            8                                   16
    +------------------------+------------+-----------------------------------+
    | deliver_ms (48 bits)   | check u16  | random (64 bits)                  |
    +------------------------+------------+-----------------------------------+

``check`` is a keyed 16-bit hash of the other 14 bytes: an id that was never a timer id
(a plain message's, a typo) passes with probability 1/65536 and is answered ``unknown``. Ids
of timer messages therefore sort by deliver time, not by store time. A delivered message keeps
its id.

Everything here is pure: the apply path passes the command's propose time, never a clock.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Final

from chronomq.raftlog import record
from chronomq.raftlog.applycheck import RecordFacts
from chronomq.raftlog.consumequeue import tags_hash
from chronomq.raftlog.errors import InvalidInput
from chronomq.raftlog.extension import DerivedRecord

TIMER_TOPIC: Final = "rmq_sys_wheel_timer"
TIMER_QUEUE: Final = 0
TIMER_OUT_MS: Final = "TIMER_OUT_MS"
REAL_TOPIC: Final = "REAL_TOPIC"
REAL_QID: Final = "REAL_QID"
TIMER_ROLL_TIMES: Final = "TIMER_ROLL_TIMES"
TIMER_DEL_UNIQKEY: Final = "TIMER_DEL_UNIQKEY"
#: On a cancel written by apply itself: it was put into the wheel by that same apply, so the
#: enqueue of the timer topic skips it. Dropped when a rolled cancel is re-put.
TIMER_ENQUEUED: Final = "TIMER_ENQUEUED"

#: Properties set by the timer; a producer's values for them are replaced.
RESERVED: Final = frozenset(
    {TIMER_OUT_MS, REAL_TOPIC, REAL_QID, TIMER_ROLL_TIMES, TIMER_DEL_UNIQKEY, TIMER_ENQUEUED}
)

#: Topics a timer message may not be delivered to: RocketMQ's system topics and the delay
#: levels' topic (named here: ``timer`` never imports ``schedule``).
SYSTEM_TOPIC_PREFIX: Final = "rmq_sys_"
SCHEDULE_TOPIC: Final = "SCHEDULE_TOPIC_XXXX"
#: Most queues a topic may have; ``REAL_QID`` must be below it (and below the real topic's
#: queue count when the topic exists).
MAX_QUEUES: Final = 1024
#: Properties only apply writes (rolled copies, cancels); a produced timer message has none.
APPLY_ONLY: Final = frozenset({TIMER_ROLL_TIMES, TIMER_DEL_UNIQKEY, TIMER_ENQUEUED})

_ID_KEY = b"chronomq/timer-id/v1"
_MAX_DELIVER_MS = (1 << 48) - 1


def _check(head: bytes) -> bytes:
    return hashlib.blake2b(head, digest_size=2, key=_ID_KEY).digest()


def new_timer_id(deliver_ms: int, rng: random.Random) -> bytes:
    """A fresh 16-byte id for a timer message due at ``deliver_ms`` (see the module docstring)."""
    if not 0 <= deliver_ms <= _MAX_DELIVER_MS:
        raise ValueError(f"deliver_ms {deliver_ms} does not fit 48 bits")
    tail = rng.getrandbits(64).to_bytes(8, "big")
    head = deliver_ms.to_bytes(6, "big")
    return head + _check(head + tail) + tail


def timer_id_deliver_ms(msg_id: bytes) -> int | None:
    """The deliver time a timer message id carries, or ``None`` if it is not a timer id."""
    if len(msg_id) != 16:
        return None
    head, check, tail = msg_id[:6], msg_id[6:8], msg_id[8:]
    if _check(head + tail) != check:
        return None
    return int.from_bytes(head, "big")


@dataclass(frozen=True, slots=True)
class TimerFields:
    """What the timer reads from a record of the timer topic."""

    deliver_ms: int
    #: Uniq key: the message's own id, or for a cancel the id it cancels (hex).
    key: str
    real_topic: str
    roll_times: int
    tombstone: bool
    pre_enqueued: bool


def destination_problem(
    props: Mapping[str, str], queue_count: Callable[[str], int | None] | None = None
) -> tuple[str, str] | None:
    """Why ``REAL_TOPIC``/``REAL_QID`` cannot be delivered to, as ``(reason, property)``.

    ``REAL_TOPIC`` must be a legal topic name (so no path, no NUL) and not a system topic;
    ``REAL_QID`` plain ASCII decimal below :data:`MAX_QUEUES` and, when ``queue_count`` knows
    the topic, below its queue count.
    """
    topic = props.get(REAL_TOPIC, "")
    try:
        record.validate_topic(topic)
    except InvalidInput as exc:
        return f"{REAL_TOPIC} {topic[:40]!r}: {exc}", REAL_TOPIC
    if topic.startswith(SYSTEM_TOPIC_PREFIX) or topic == SCHEDULE_TOPIC:
        return f"{REAL_TOPIC} {topic} is a system topic", REAL_TOPIC
    raw = props.get(REAL_QID, "")
    if not raw.isascii() or not raw.isdigit() or len(raw) > 4 or int(raw) >= MAX_QUEUES:
        return f"{REAL_QID} {raw[:20]!r} is not a queue id 0..{MAX_QUEUES - 1}", REAL_QID
    queues = queue_count(topic) if queue_count is not None else None
    if queues is not None and int(raw) >= queues:
        return f"{REAL_QID} {raw}: topic {topic} has queues 0..{queues - 1}", REAL_QID
    return None


def _deliver_ms(props: Mapping[str, str]) -> int | None:
    raw = props.get(TIMER_OUT_MS, "")
    if not raw.isascii() or not raw.isdigit() or len(raw) > 15:
        return None
    return int(raw)


def produced_problem(
    props: Mapping[str, str], queue_count: Callable[[str], int | None]
) -> tuple[str, str] | None:
    """Why a record appended to the timer topic by a produce is not a timer message, as
    ``(reason, property)``; apply rejects such a batch (see :func:`apply_rule`)."""
    for name in APPLY_ONLY:
        if name in props:
            return f"{name} is set by apply only", name
    if _deliver_ms(props) is None:
        raw = props.get(TIMER_OUT_MS, "")
        return f"{TIMER_OUT_MS} {raw[:20]!r} is not a time in ms", TIMER_OUT_MS
    return destination_problem(props, queue_count)


def apply_rule(
    facts: RecordFacts, queue_count: Callable[[str], int | None]
) -> tuple[str, str] | None:
    """The apply rule for records of :data:`TIMER_TOPIC` (:mod:`chronomq.raftlog.applycheck`)."""
    problem = produced_problem(facts.properties, queue_count)
    if problem is None:
        return None
    reason, name = problem
    return reason, f"properties.{name}"


def timer_fields(msg_id: bytes, props: Mapping[str, str]) -> TimerFields | None:
    """Parse the timer properties of a timer-topic record; ``None`` if they are unusable (a
    record produced straight into the timer topic, an illegal destination): apply drops those,
    on every replica, counting them as ``skipped`` (as RocketMQ's timer drops a message its
    put answers ``PUT_NO_RETRY``)."""
    deliver_ms = _deliver_ms(props)
    if deliver_ms is None:
        return None
    rolls = props.get(TIMER_ROLL_TIMES, "0")
    roll_times = int(rolls) if rolls.isascii() and rolls.isdigit() and len(rolls) < 10 else 0
    target = props.get(TIMER_DEL_UNIQKEY)
    if target is not None:
        if len(target) != 32:
            return None
        return TimerFields(deliver_ms, target, "", roll_times, True, TIMER_ENQUEUED in props)
    real_topic = props.get(REAL_TOPIC, "")
    if destination_problem(props) is not None:
        return None
    return TimerFields(deliver_ms, record.msg_id_hex(msg_id), real_topic, roll_times, False, False)


def timer_properties(
    properties: Mapping[str, str], *, real_topic: str, real_queue: int, deliver_ms: int
) -> dict[str, str]:
    """Properties of a timer message produced to ``real_topic``/``real_queue``."""
    props = {k: v for k, v in properties.items() if k not in RESERVED}
    props[TIMER_OUT_MS] = str(deliver_ms)
    props[REAL_TOPIC] = real_topic
    props[REAL_QID] = str(real_queue)
    return props


def delivered_record(
    data: bytes, props: Mapping[str, str], *, queue_count: int, store_ms: int
) -> DerivedRecord:
    """The copy of a due timer message (its record bytes ``data``) that goes to its real topic.

    Keeps the msg id, body, born time and every property (``REAL_TOPIC``/``REAL_QID``/
    ``TIMER_OUT_MS`` stay, as in RocketMQ, so a consumer can tell it waited); the store time is
    the delivery command's. A queue id beyond the topic's queues wraps.
    """
    topic = props[REAL_TOPIC]
    queue_id = int(props[REAL_QID]) % queue_count
    copy = record.retarget(
        data,
        topic=topic,
        queue_id=queue_id,
        store_ms=store_ms,
        tags_code=tags_hash(props.get(record.PROPERTY_TAGS)),
    )
    return DerivedRecord(topic, queue_id, copy)


def reput_record(msg: record.Message, *, deliver_ms: int, store_ms: int) -> DerivedRecord:
    """A rolled timer message (or cancel) put back into the timer topic, roll count + 1."""
    props = {k: v for k, v in msg.properties.items() if k != TIMER_ENQUEUED}
    rolls = props.get(TIMER_ROLL_TIMES, "0")
    props[TIMER_ROLL_TIMES] = str((int(rolls) if rolls.isdigit() else 0) + 1)
    props[TIMER_OUT_MS] = str(deliver_ms)
    data = record.encode(
        topic=TIMER_TOPIC,
        queue_id=TIMER_QUEUE,
        msg_id=msg.msg_id,
        body=msg.body,
        properties=props,
        flag=msg.flag,
        sys_flag=msg.sys_flag,
        born_ms=msg.born_ms,
        store_ms=store_ms,
        reconsume_times=msg.reconsume_times,
        tags_code=deliver_ms,
        max_message_bytes=max(len(msg.body), record.DEFAULT_MAX_MESSAGE_BYTES),
    )
    return DerivedRecord(TIMER_TOPIC, TIMER_QUEUE, data)


def cancel_record(
    target_hex: str, *, deliver_ms: int, store_ms: int, index: int, seq: int
) -> DerivedRecord:
    """The cancel message apply stores for ``target_hex``, already put into the wheel.

    Its own id is derived from the target, the Raft index and its place in the command, so it
    is the same on every replica without randomness.
    """
    cancel_id = hashlib.blake2b(
        f"cancel/{target_hex}/{index}/{seq}".encode(), digest_size=16
    ).digest()
    data = record.encode(
        topic=TIMER_TOPIC,
        queue_id=TIMER_QUEUE,
        msg_id=cancel_id,
        body=b"",
        properties={
            TIMER_DEL_UNIQKEY: target_hex,
            TIMER_OUT_MS: str(deliver_ms),
            TIMER_ENQUEUED: "1",
        },
        born_ms=store_ms,
        store_ms=store_ms,
        tags_code=deliver_ms,
    )
    return DerivedRecord(TIMER_TOPIC, TIMER_QUEUE, data)
