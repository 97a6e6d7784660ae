"""What a level's delivery loop should do next, decided from its ConsumeQueue and ``now_ms``.

A level's ConsumeQueue holds its messages in store order, and within a level store order is
deliver order (same delay for all), so the loop reads from the level's offset and stops at the
first entry that is not yet due: everything behind it is not due either (seed 001, "每个
TimerTask在检查消息是否到期时..."; seed 000, ``executeOnTimeup``). An entry is due when
``deliver_ms <= now_ms``; nothing is ever delivered early, unless the caller opts into the
clock-skew correction below.

The offset correction follows ``executeOnTimeup``'s ``resetOffset``: an offset below the queue's
minimum (old segments deleted) moves up to the minimum, one above its maximum (the queue was
truncated or the offset table is from elsewhere) moves down to the maximum. The driver logs the
correction and persists it through Raft.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from chronomq.schedule.errors import ScheduleInternalError


@dataclass(frozen=True, slots=True)
class ScheduleEntry:
    """One ConsumeQueue unit of a schedule-topic queue."""

    queue_offset: int
    commitlog_offset: int
    size_bytes: int
    deliver_ms: int
    """The unit's tagsCode: store time plus the level's delay."""


class StopReason(Enum):
    NOT_DUE = "not_due"
    """Stopped at an entry whose deliver time is still ahead."""
    LIMIT = "limit"
    """Took ``limit`` due entries; more may be due."""
    END = "end"
    """Every entry given was due."""


@dataclass(frozen=True, slots=True)
class ScanPlan:
    """The decision for one scan of a level."""

    offset: int
    """Where the scan started (the level's offset)."""
    due: tuple[ScheduleEntry, ...]
    """Entries to deliver now, in queue order."""
    next_offset: int
    """The offset after the due entries: where the next scan starts, and the level offset to
    record in the same Raft command as the deliveries of ``due`` (sync mode)."""
    stop: StopReason
    next_due_ms: int | None
    """The earliest time the next scan can find something due: the deliver time of the first
    entry left behind; ``now_ms`` when the limit cut the scan short at the end of the entries
    given; None with ``stop`` END (wait for new entries, or poll)."""
    skew_corrected: int = 0
    """How many due entries were due only because of the clock-skew correction."""

    def wait_ms(self, now_ms: int) -> int | None:
        """How long the driver may sleep before the next scan; None if nothing is known."""
        if self.next_due_ms is None:
            return None
        return max(0, self.next_due_ms - now_ms)


def plan_scan(
    offset: int,
    entries: Sequence[ScheduleEntry],
    now_ms: int,
    *,
    limit: int | None = None,
    max_delay_ms: int | None = None,
) -> ScanPlan:
    """Decide which entries, read from ``offset`` on, are due at ``now_ms``.

    ``entries`` must start at ``offset`` and be contiguous (a ConsumeQueue has no gaps); fewer
    entries than the queue holds is fine, the plan then ends with ``StopReason.END``.
    ``limit`` bounds the due entries taken in one plan (a batch size).

    ``max_delay_ms`` turns on RocketMQ's ``correctDeliverTimestamp``: an entry whose deliver
    time lies more than ``max_delay_ms`` (the level's delay) after ``now_ms`` can only have been
    stamped by a clock running ahead, and is treated as due now rather than holding the whole
    level back. Leave it None to keep the strict never-early rule.
    """
    if limit is not None and limit <= 0:
        raise ValueError(f"limit must be positive, got {limit}")
    if max_delay_ms is not None and max_delay_ms < 0:
        raise ValueError(f"max_delay_ms must be >= 0, got {max_delay_ms}")
    _check_contiguous(offset, entries)

    due: list[ScheduleEntry] = []
    skew_corrected = 0
    for entry in entries:
        effective_ms = _effective_deliver_ms(entry.deliver_ms, now_ms, max_delay_ms)
        if limit is not None and len(due) == limit:
            return ScanPlan(
                offset=offset,
                due=tuple(due),
                next_offset=entry.queue_offset,
                stop=StopReason.LIMIT,
                next_due_ms=effective_ms,
                skew_corrected=skew_corrected,
            )
        if effective_ms > now_ms:
            return ScanPlan(
                offset=offset,
                due=tuple(due),
                next_offset=entry.queue_offset,
                stop=StopReason.NOT_DUE,
                next_due_ms=effective_ms,
                skew_corrected=skew_corrected,
            )
        if entry.deliver_ms > now_ms:
            skew_corrected += 1
        due.append(entry)

    cut_short = limit is not None and len(due) == limit
    return ScanPlan(
        offset=offset,
        due=tuple(due),
        next_offset=offset + len(due),
        stop=StopReason.LIMIT if cut_short else StopReason.END,
        next_due_ms=now_ms if cut_short else None,
        skew_corrected=skew_corrected,
    )


class OffsetFix(Enum):
    NONE = "none"
    BELOW_MIN = "below_min"
    ABOVE_MAX = "above_max"


@dataclass(frozen=True, slots=True)
class OffsetCorrection:
    """A level offset checked against its queue's ``[min_offset, max_offset]``."""

    level: int
    requested: int
    offset: int
    """The offset to use (equal to ``requested`` unless corrected)."""
    min_offset: int
    max_offset: int
    fix: OffsetFix

    @property
    def corrected(self) -> bool:
        return self.fix is not OffsetFix.NONE

    def describe(self) -> str:
        """A log line for a correction."""
        if self.fix is OffsetFix.BELOW_MIN:
            bound = f"below the queue minimum {self.min_offset}"
        elif self.fix is OffsetFix.ABOVE_MAX:
            bound = f"above the queue maximum {self.max_offset}"
        else:
            return f"schedule level {self.level} offset {self.offset} is valid"
        return (
            f"schedule level {self.level} offset {self.requested} is {bound}; "
            f"corrected to {self.offset}"
        )


def correct_offset(level: int, offset: int, min_offset: int, max_offset: int) -> OffsetCorrection:
    """Clamp a level offset into its queue's ``[min_offset, max_offset]`` and say if it moved.

    ``max_offset`` is the offset the next appended entry will get, so an offset equal to it is
    valid (nothing to read yet).
    """
    if min_offset < 0 or max_offset < min_offset:
        raise ScheduleInternalError(
            f"schedule level {level} queue bounds are inconsistent: "
            f"min {min_offset}, max {max_offset}"
        )
    if offset < min_offset:
        fixed, fix = min_offset, OffsetFix.BELOW_MIN
    elif offset > max_offset:
        fixed, fix = max_offset, OffsetFix.ABOVE_MAX
    else:
        fixed, fix = offset, OffsetFix.NONE
    return OffsetCorrection(
        level=level,
        requested=offset,
        offset=fixed,
        min_offset=min_offset,
        max_offset=max_offset,
        fix=fix,
    )


def _effective_deliver_ms(deliver_ms: int, now_ms: int, max_delay_ms: int | None) -> int:
    if max_delay_ms is not None and deliver_ms > now_ms + max_delay_ms:
        return now_ms
    return deliver_ms


def _check_contiguous(offset: int, entries: Sequence[ScheduleEntry]) -> None:
    for expected, entry in enumerate(entries, start=offset):
        if entry.queue_offset != expected:
            raise ScheduleInternalError(
                f"schedule entries must be contiguous from offset {offset}: "
                f"expected queue offset {expected}, got {entry.queue_offset}"
            )
