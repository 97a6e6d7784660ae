"""The pop decisions, pure: what to hand out, what an ack or a change does, what a due CK does.

Every function takes a :class:`~chronomq.pop.state.QueueState` and changes it in place, with the
command's propose time as ``now_ms`` and its Raft index as the new pop id; nothing here reads a
clock, a file or the store (the machine passes the queue's offsets in). Apply runs them on every
replica in log order, so every replica reaches the same state.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from chronomq.pop.state import MAX_HELD, Inflight, QueueState


class AckStatus(Enum):
    ACKED = "acked"
    ALREADY_ACKED = "already_acked"
    EXPIRED = "expired"
    """The hand-out this handle names is over: revived, handed out again, changed, sent to the
    DLQ, or acked so long ago that it is forgotten."""
    INVALID = "invalid"


class ReviveAction(Enum):
    STALE = "stale"
    """Acked, re-handed or changed since the CK was written: nothing to do."""
    REARM = "rearm"
    """Not due yet by this command's time (a leader whose clock is behind): a new CK."""
    REVIVED = "revived"
    """Visible again, with the next attempt."""
    DLQ = "dlq"
    """Delivered ``max_reconsume_times + 1`` times and never acked: to the DLQ."""


@dataclass(frozen=True, slots=True)
class Picked:
    """One message a pop hands out."""

    offset: int
    attempt: int
    pop_id: int
    until_ms: int


def pick(
    st: QueueState,
    *,
    n: int,
    pop_id: int,
    until_ms: int,
    min_offset: int,
    max_offset: int,
    accept: Callable[[int], bool | None] | None = None,
    max_skip: int = 0,
) -> tuple[list[Picked], int]:
    """Hand out up to ``n`` visible messages of the queue ``[min_offset, max_offset)``:
    revived ones first (lowest offset first), then never-popped ones from the cursor, never
    beyond :data:`~chronomq.pop.state.MAX_HELD` held at once. Returns what was picked and how
    many revived messages were dropped because retention deleted them.

    ``accept(offset)``: the group's filter (its tags; ``None``: not looked at, stop there). A
    never-popped message it refuses is passed over for good (the cursor moves past it, as
    RocketMQ's pop does for a subscription that does not match), at most ``max_skip`` of them
    per call. Revived messages matched when first handed out and are not filtered again."""
    out: list[Picked] = []
    dropped = 0
    for offset in sorted(st.revived):
        if len(out) >= n:
            break
        attempt = st.revived.pop(offset)
        if offset < min_offset:
            dropped += 1
            continue
        st.inflight[offset] = Inflight(pop_id, attempt, until_ms)
        out.append(Picked(offset, attempt, pop_id, until_ms))
    if st.cursor < min_offset:
        st.cursor = min_offset
    skipped = 0
    while len(out) < n and st.cursor < max_offset and st.held < MAX_HELD:
        offset = st.cursor
        verdict = True if accept is None else accept(offset)
        if verdict is None:
            break  # the filter has not looked that far: the next pop goes on from here
        if not verdict:
            if skipped >= max_skip:
                break
            skipped += 1
            st.cursor += 1
            continue
        st.cursor += 1
        st.inflight[offset] = Inflight(pop_id, 1, until_ms)
        out.append(Picked(offset, 1, pop_id, until_ms))
    return out, dropped


def visible(st: QueueState, *, min_offset: int, max_offset: int) -> int:
    """How many messages a pop could hand out now (for metrics and long polling)."""
    fresh = max(0, max_offset - max(st.cursor, min_offset))
    room = max(0, MAX_HELD - st.held)
    return sum(1 for o in st.revived if o >= min_offset) + min(fresh, room)


def ack(st: QueueState, offset: int, pop_id: int) -> AckStatus:
    entry = st.inflight.get(offset)
    if entry is not None and entry.pop_id == pop_id:
        del st.inflight[offset]
        st.remember_ack(offset, pop_id)
        return AckStatus.ACKED
    if (offset, pop_id) in st.acked:
        return AckStatus.ALREADY_ACKED
    return AckStatus.EXPIRED


def change(
    st: QueueState, offset: int, pop_id: int, *, new_pop_id: int, until_ms: int
) -> Inflight | None:
    """Give the hand-out ``(offset, pop_id)`` a new invisible time under ``new_pop_id``;
    ``None`` when that hand-out is over (the old handle is stale either way afterwards)."""
    entry = st.inflight.get(offset)
    if entry is None or entry.pop_id != pop_id:
        return None
    changed = Inflight(new_pop_id, entry.attempt, until_ms)
    st.inflight[offset] = changed
    return changed


def take(st: QueueState, offset: int, pop_id: int) -> Inflight | None:
    """Remove the hand-out ``(offset, pop_id)`` for a forward to the DLQ; ``None`` when over."""
    entry = st.inflight.get(offset)
    if entry is None or entry.pop_id != pop_id:
        return None
    del st.inflight[offset]
    return entry


def revive(
    st: QueueState, offset: int, pop_id: int, *, now_ms: int, max_reconsume_times: int
) -> tuple[ReviveAction, Inflight | None]:
    """What a due CK naming ``(offset, pop_id)`` does (see :class:`ReviveAction`); the entry
    it acted on (for REARM its deadline, for DLQ its attempt)."""
    entry = st.inflight.get(offset)
    if entry is None or entry.pop_id != pop_id:
        return ReviveAction.STALE, None
    if entry.until_ms > now_ms:
        return ReviveAction.REARM, entry
    del st.inflight[offset]
    if entry.attempt > max_reconsume_times:
        return ReviveAction.DLQ, entry
    st.revived[offset] = entry.attempt + 1
    return ReviveAction.REVIVED, entry
