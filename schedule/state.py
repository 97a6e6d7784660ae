"""The schedule's replicated state: entries of the log's kv table, so a new leader keeps them.

- ``sched/off/{level}``: the level's offset in the schedule topic, moved by the same command
  that delivers the range before it (progress and effect in one command);
- ``sched/mode``: the delivery mode, ``sync`` or ``async`` (unset: the node's
  ``enable_schedule_async_deliver``);
- ``sched/paused``: 1 while delivery is paused cluster-wide.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

OFFSET_PREFIX: Final = "sched/off/"
MODE_KEY: Final = "sched/mode"
PAUSED_KEY: Final = "sched/paused"
SYNC: Final = "sync"
ASYNC: Final = "async"
MODES: Final = (SYNC, ASYNC)


def offset_key(level: int) -> str:
    """The replicated kv key holding ``level``'s offset in the schedule topic."""
    return f"{OFFSET_PREFIX}{level}"


def level_offset(kv: Mapping[str, object], level: int) -> int:
    """``level``'s offset in the schedule topic (0 until set)."""
    value = kv.get(offset_key(level), 0)
    return value if isinstance(value, int) else 0


def delivery_mode(kv: Mapping[str, object], async_by_default: bool) -> str:
    """The delivery mode: the replicated one once switched, else the node's default."""
    value = kv.get(MODE_KEY)
    if value in MODES:
        return str(value)
    return ASYNC if async_by_default else SYNC


def is_paused(kv: Mapping[str, object]) -> bool:
    return kv.get(PAUSED_KEY) == 1
