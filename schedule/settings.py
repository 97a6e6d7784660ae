"""Settings of the schedule service (one node's; the replicated controls are in
:mod:`chronomq.schedule.state`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from chronomq.schedule.levels import DelayLevelTable
from chronomq.schedule.pending import PendingConfig


@dataclass(frozen=True, slots=True)
class ScheduleSettings:
    levels: DelayLevelTable
    async_deliver: bool = False
    """The mode while no one has switched it at runtime (``sched/mode`` unset)."""
    pending: PendingConfig = field(default_factory=PendingConfig)
    batch_max_messages: int = 128
    """Deliveries per Raft command in async mode."""
    scan_max: int = 512
    """ConsumeQueue units read per scan."""
    poll_ms: int = 50
    """How often an idle level looks for new entries and a changed mode. New entries are due a
    whole level delay (>= 1 s) after they are stored, so this never makes a delivery late."""
    commit_wait_s: float = 15.0
    """Upper bound on waiting for one command (the committer times out well before)."""
