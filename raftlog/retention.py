"""CommitLog retention: which whole segments may be deleted now (RocketMQ's CleanCommitLogService).

A pure core: the caller lists the segments (base, end, last write time), says the lowest
CommitLog offset something still needs, the time and how full the disk is, and gets back the
segments to delete. Nothing here reads a clock or a file.

The rules, in order:

- only a prefix of the log goes (oldest first), so the CommitLog stays one contiguous range
  ``[min_offset, length)``; the first segment that must stay stops the walk;
- the last segment (the one being written) never goes;
- a segment goes only when all its bytes lie below ``needed_offset``: the lowest offset still
  needed by a message waiting in a delay level or in the timer wheel, by a replay of the
  Raft journal from the last snapshot, or by the hash chain's last block (the caller works it
  out, see ``cluster/node/disk.py``);
- a segment goes only when it is *expired*: its last write is at least ``reserved_ms`` old
  (RocketMQ's ``fileReservedTime``);
- below ``max_used_ratio`` at most ``batch_max`` segments go per pass (deletion is spread
  out, as RocketMQ's ``deleteCommitLogFilesInterval`` does); above it every expired segment
  goes at once (RocketMQ deletes expired files at once when ``diskMaxUsedSpaceRatio`` is
  passed instead of waiting for ``deleteWhen``).

Unlike RocketMQ, a segment that has not expired is never deleted to make room (RocketMQ's
``diskSpaceCleanForciblyRatio``): an acknowledged message stays readable for its whole
retention, and a full disk refuses produce instead (``disk_space_warning_level_ratio``).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SegmentInfo:
    """One CommitLog segment file: ``[base, end)`` and when it was last written (ms)."""

    base: int
    end: int
    mtime_ms: int


@dataclass(frozen=True, slots=True)
class RetentionPolicy:
    reserved_ms: int
    max_used_ratio: float
    batch_max: int = 10

    def __post_init__(self) -> None:
        if self.reserved_ms < 0:
            raise ValueError(f"reserved_ms must be >= 0, got {self.reserved_ms}")
        if not 0.0 < self.max_used_ratio <= 1.0:
            raise ValueError(f"max_used_ratio must be in (0, 1], got {self.max_used_ratio}")
        if self.batch_max < 1:
            raise ValueError(f"batch_max must be >= 1, got {self.batch_max}")


class Stop(enum.Enum):
    """Why the walk stopped at the first segment it kept."""

    NOTHING = "nothing_to_delete"  # no segment but the active one
    ACTIVE = "active_segment"
    NEEDED = "holds_needed_data"
    NOT_EXPIRED = "not_expired"
    BATCH = "batch_limit"


@dataclass(frozen=True, slots=True)
class RetentionDecision:
    #: Bases of the segments to delete, oldest first (a prefix of the log).
    delete: tuple[int, ...]
    stop: Stop
    #: Whether the disk was above ``max_used_ratio`` (every expired segment may go).
    pressure: bool


def plan_retention(
    segments: Sequence[SegmentInfo],
    *,
    needed_offset: int,
    now_ms: int,
    used_ratio: float,
    policy: RetentionPolicy,
) -> RetentionDecision:
    """The segments to delete now (see the module docstring)."""
    pressure = used_ratio > policy.max_used_ratio
    limit = len(segments) if pressure else policy.batch_max
    delete: list[int] = []
    if len(segments) <= 1:
        return RetentionDecision((), Stop.NOTHING, pressure)
    stop = Stop.ACTIVE
    for i, seg in enumerate(segments):
        if i == len(segments) - 1:
            stop = Stop.ACTIVE
            break
        if seg.end > needed_offset:
            stop = Stop.NEEDED
            break
        if now_ms - seg.mtime_ms < policy.reserved_ms:
            stop = Stop.NOT_EXPIRED
            break
        if len(delete) >= limit:
            stop = Stop.BATCH
            break
        delete.append(seg.base)
    return RetentionDecision(tuple(delete), stop, pressure)
