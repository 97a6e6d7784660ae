"""What the delay levels still need of the CommitLog, for retention.

Every level reads its queue of ``SCHEDULE_TOPIC_XXXX`` from its replicated offset
(``sched/off/<level>``) on; the units from there on point at messages still waiting. Units
are in CommitLog order within a queue, so the unit at a level's offset is the lowest CommitLog
offset that level still needs. In-flight async deliveries lie past the offset too: it moves
only when they settle.
"""

from __future__ import annotations

from chronomq.raftlog.store import Store
from chronomq.schedule.levels import SCHEDULE_TOPIC
from chronomq.schedule.state import offset_key


def lowest_needed_offset(store: Store) -> int | None:
    """The lowest CommitLog offset of a message waiting in any delay level; None when none
    waits."""
    low: int | None = None
    for qid in range(store.queue_count(SCHEDULE_TOPIC) or 0):
        offset = store.kv.get(offset_key(qid + 1), 0)
        if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
            offset = 0
        units = store.read_units(SCHEDULE_TOPIC, qid, offset, 1)
        if units and (low is None or units[0].commitlog_offset < low):
            low = units[0].commitlog_offset
    return low
