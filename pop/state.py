"""The replicated pop state of one (group, topic, queue), its limits and its kv encoding.

One kv entry per queue a group pops from, ``pop/q/{group}/{topic}/{queue}``, holding compact
JSON ``{"c": cursor, "f": [[offset, pop_id, attempt, until_ms], ...], "r": [[offset, attempt],
...], "a": [[offset, pop_id], ...]}`` (see the package docstring for what each part means).
Decoding is total: an entry that does not parse gives an empty state plus a reason, the same on
every replica (kv only ever holds what :func:`encode` wrote, so that is a fault, logged).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

import orjson

KV_PREFIX: Final = "pop/q/"
REVIVE_OFFSET_KEY: Final = "pop/revive"
REVIVE_TOPIC: Final = "%POP_REVIVE%"
"""Where the timer delivers the CKs (queue 0). An ordinary topic name on purpose: the timer
delivers only to non-system topics, and a forged CK can do nothing a real one would not."""
REVIVE_QUEUE: Final = 0

MAX_HELD: Final = 1024
"""Most messages of one (group, topic, queue) in flight or revived at once: a pop hands out no
new message beyond it (RocketMQ bounds its in-flight checkpoints per queue likewise)."""
MAX_POP_MESSAGES: Final = 32
"""Most messages one receive hands out (RocketMQ's proxy caps ``max_message_num`` at 32)."""
MAX_POP_QUEUES: Final = 64
"""Most queues one ``pop`` command may try."""
MAX_ACKED_MEMORY: Final = 256
"""Acks remembered per queue, so a repeated ack answers ``already_acked``; older ones answer
``expired`` (harmless: the message is not handed out again either way)."""
MAX_ITEMS_PER_COMMAND: Final = 64
"""Most handles one ``ack``/``chg``/``dlq`` command carries."""
MAX_REVIVE_PER_COMMAND: Final = 64
"""Most CKs one ``revive`` command reads (each names at most :data:`MAX_POP_MESSAGES`)."""
MIN_INVISIBLE_MS: Final = 1_000
MAX_INVISIBLE_MS: Final = 12 * 3_600_000
"""Bounds of an invisible duration (RocketMQ's proxy: 10 s .. 12 h by default; we allow 1 s
for tests). The timer's ``timer_max_delay_s`` must cover the maximum."""
MAX_RECONSUME_TIMES_CEILING: Final = 1_000


@dataclass(frozen=True, slots=True)
class Inflight:
    """One message handed out and not acked."""

    pop_id: int
    attempt: int
    until_ms: int


@dataclass(slots=True)
class QueueState:
    """What one group has done with one queue (mutable; the machine copies before changing)."""

    cursor: int = 0
    inflight: dict[int, Inflight] = field(default_factory=dict)
    revived: dict[int, int] = field(default_factory=dict)
    """offset -> the attempt its next hand-out gets."""
    acked: dict[tuple[int, int], None] = field(default_factory=dict)
    """(offset, pop id) of recent acks, oldest first (an ordered set)."""

    @property
    def held(self) -> int:
        return len(self.inflight) + len(self.revived)

    def copy(self) -> QueueState:
        return QueueState(self.cursor, dict(self.inflight), dict(self.revived), dict(self.acked))

    def remember_ack(self, offset: int, pop_id: int) -> None:
        self.acked[(offset, pop_id)] = None
        while len(self.acked) > MAX_ACKED_MEMORY:
            del self.acked[next(iter(self.acked))]

    def is_empty(self) -> bool:
        return self.cursor == 0 and not self.inflight and not self.revived and not self.acked


def kv_key(group: str, topic: str, queue: int) -> str:
    return f"{KV_PREFIX}{group}/{topic}/{queue}"


def parse_kv_key(key: str) -> tuple[str, str, int] | None:
    """``(group, topic, queue)`` of a pop kv key (group and topic never contain ``/``)."""
    if not key.startswith(KV_PREFIX):
        return None
    parts = key[len(KV_PREFIX) :].split("/")
    if len(parts) != 3 or not parts[2].isdigit():
        return None
    return parts[0], parts[1], int(parts[2])


def encode(st: QueueState) -> str:
    return orjson.dumps(
        {
            "c": st.cursor,
            "f": [[o, e.pop_id, e.attempt, e.until_ms] for o, e in sorted(st.inflight.items())],
            "r": sorted([o, a] for o, a in st.revived.items()),
            "a": [list(k) for k in st.acked],
        }
    ).decode()


def _ints(item: object, n: int) -> list[int] | None:
    if not isinstance(item, list) or len(item) != n:
        return None
    if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in item):
        return None
    return item


def decode(text: object) -> tuple[QueueState, str | None]:
    """The state ``text`` encodes, or an empty one and why it could not be read."""
    if text is None:
        return QueueState(), None
    try:
        raw = orjson.loads(text if isinstance(text, str) else b"")
    except orjson.JSONDecodeError:
        return QueueState(), "pop state is not JSON"
    if not isinstance(raw, dict):
        return QueueState(), "pop state is not an object"
    st = QueueState()
    cursor = raw.get("c")
    if not isinstance(cursor, int) or isinstance(cursor, bool) or cursor < 0:
        return QueueState(), "pop state has no cursor"
    st.cursor = cursor
    for item in raw.get("f") or []:
        f = _ints(item, 4)
        if f is None:
            return QueueState(), "pop state has a malformed in-flight entry"
        st.inflight[f[0]] = Inflight(f[1], f[2], f[3])
    for item in raw.get("r") or []:
        r = _ints(item, 2)
        if r is None:
            return QueueState(), "pop state has a malformed revived entry"
        st.revived[r[0]] = r[1]
    for item in raw.get("a") or []:
        a = _ints(item, 2)
        if a is None:
            return QueueState(), "pop state has a malformed ack entry"
        st.acked[(a[0], a[1])] = None
    return st, None
