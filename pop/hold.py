"""What pop consumption still needs of the CommitLog, for retention (``cluster/node/disk.py``).

Apply reads two kinds of records later than they were written: a held message (in flight or
revived), when it is handed out again or copied to the DLQ, and the CKs of the revive topic
from ``pop/revive`` on. Retention must keep both on every replica, or replicas that deleted
different amounts would apply differently. Units are in CommitLog order within a queue, so the
unit of a queue's lowest held offset is the lowest CommitLog offset that queue still needs.
Messages never handed out are not held: retention deletes them as RocketMQ's does.
"""

from __future__ import annotations

from chronomq.pop import state
from chronomq.raftlog.store import Store


def _unit_offset(store: Store, topic: str, queue: int, offset: int) -> int | None:
    units = store.read_units(topic, queue, offset, 1)
    return units[0].commitlog_offset if units else None


def lowest_needed_offset(store: Store) -> int | None:
    """The lowest CommitLog offset pop still reads; ``None`` when it needs nothing."""
    lows: list[int] = []
    revive = store.kv.get(state.REVIVE_OFFSET_KEY, 0)
    at = _unit_offset(
        store, state.REVIVE_TOPIC, state.REVIVE_QUEUE, revive if isinstance(revive, int) else 0
    )
    if at is not None:
        lows.append(at)
    for key in list(store.kv):
        parsed = state.parse_kv_key(key)
        if parsed is None:
            continue
        st, _ = state.decode(store.kv.get(key))
        held = [*st.inflight, *st.revived]
        if not held:
            continue
        _group, topic, queue = parsed
        at = _unit_offset(store, topic, queue, min(held))
        if at is not None:
            lows.append(at)
    return min(lows) if lows else None
