"""The async-delivery pending queue of one level (seed 000, sections 3 and 4.2).

In async mode a level's delivery loop hands each due message to Raft without waiting and
records it here; completions come back later and in any order. This object is the bookkeeping
of RocketMQ's ``deliverPendingTable`` + ``PutResultProcess`` + ``HandlePutResultTask``, with the
I/O taken out: the driver reports what happened (``on_success``, ``on_failure``, ``on_missing``)
and calls :meth:`PendingQueue.settle`, which says which offset is now safe to record, what to
resend and when to look again.

Life of an entry::

    try_add ──> RUNNING ──on_success──> SUCCESS ──settle, at head──> popped, offset advances
                  ^   │
       settle,    │   ├─on_failure / on_missing──> EXCEPTION (resend after back-off)
       back-off   │   │
       elapsed ───┘   └─on_missing, 6th time───> SKIP ──settle, at head──> popped, logged

Rules:

- **Bounded.** At most ``schedule_async_deliver_max_pending_limit`` entries (default 2000).
  When full, ``try_add`` answers FULL: the loop backs off and rescans from
  :attr:`PendingQueue.next_offset` (seed 000, ``asyncDeliver`` flow control).
- **In order.** Settling walks from the head: SUCCESS and SKIP are popped and the safe offset
  becomes that entry's offset + 1; it stops at the first RUNNING or EXCEPTION entry. A later
  entry finishing first waits for the ones before it.
- **Resend with back-off.** A failed entry is resent after ``min(n * 100 ms, 60 s)``, ``n``
  being the resends already made (``Math.min(this.resendCount++ * 100, 60 * 1000)``: the first
  resend goes at once). Every failed entry whose back-off has elapsed is resent, not only the
  head, as RocketMQ's completion callbacks do.
- **Block.** Once a message has failed ``schedule_async_deliver_max_resend_num_to_blocked``
  times (default 3, the first send counted), the level is blocked: ``try_add`` answers BLOCKED
  until that message goes through (or is skipped). RocketMQ looks only at the head; we block on
  any pending entry, since any of them will eventually hold the head back.
- **Skip.** A message missing from the CommitLog (retention deleted it) is retried like any
  failure and skipped on the 6th miss, with a reason for the log line.

Our twist on RocketMQ: the level offset is written by Raft in the same command as deliveries,
so nothing here persists anything; :attr:`Settlement.safe_offset` is what may be recorded.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from enum import Enum

from chronomq.schedule.errors import ConfigError, ScheduleInternalError
from chronomq.schedule.planner import ScheduleEntry

MAX_PENDING_LIMIT_KEY = "schedule_async_deliver_max_pending_limit"
MAX_RESEND_NUM_TO_BLOCKED_KEY = "schedule_async_deliver_max_resend_num_to_blocked"
_PENDING_LIMIT_CEILING = 1_000_000


class ProcessStatus(Enum):
    RUNNING = "running"
    SUCCESS = "success"
    EXCEPTION = "exception"
    SKIP = "skip"


class AddResult(Enum):
    ADDED = "added"
    FULL = "full"
    """Flow control: the queue holds ``max_pending_limit`` entries. Back off, rescan."""
    BLOCKED = "blocked"
    """A message keeps failing; add nothing until it goes through. Back off, rescan."""


@dataclass(frozen=True, slots=True)
class PendingConfig:
    max_pending_limit: int = 2000
    max_resend_num_to_blocked: int = 3
    max_missing_tries: int = 6
    resend_backoff_step_ms: int = 100
    resend_backoff_max_ms: int = 60_000

    def __post_init__(self) -> None:
        if not 1 <= self.max_pending_limit <= _PENDING_LIMIT_CEILING:
            raise ConfigError(
                MAX_PENDING_LIMIT_KEY,
                f"must be in 1..{_PENDING_LIMIT_CEILING}, got {self.max_pending_limit}",
            )
        if self.max_resend_num_to_blocked < 1:
            raise ConfigError(
                MAX_RESEND_NUM_TO_BLOCKED_KEY,
                f"must be at least 1, got {self.max_resend_num_to_blocked}",
            )
        if self.max_missing_tries < 1:
            raise ValueError(f"max_missing_tries must be >= 1, got {self.max_missing_tries}")
        if self.resend_backoff_step_ms < 0 or self.resend_backoff_max_ms < 0:
            raise ValueError("resend back-off values must be >= 0")


def resend_backoff_ms(resends_made: int, config: PendingConfig) -> int:
    """Wait before the next resend of a message already resent ``resends_made`` times."""
    return min(resends_made * config.resend_backoff_step_ms, config.resend_backoff_max_ms)


@dataclass(frozen=True, slots=True)
class Resend:
    """Send this entry again now, and report the outcome with ``attempt``."""

    entry: ScheduleEntry
    attempt: int
    """2 for the first resend, and so on."""
    failures: int
    backoff_ms: int
    last_error: str | None


@dataclass(frozen=True, slots=True)
class Skipped:
    entry: ScheduleEntry
    reason: str


@dataclass(frozen=True, slots=True)
class Settlement:
    """What one settle step decided."""

    safe_offset: int
    """Every entry below it is delivered or skipped: the level offset that may be recorded."""
    advanced: bool
    delivered: int
    """Entries popped as SUCCESS."""
    skipped: tuple[Skipped, ...]
    """Entries popped as SKIP, each with a reason for a log line."""
    resends: tuple[Resend, ...]
    next_resend_ms: int | None
    """When the next back-off elapses (settle again then); None if nothing waits to resend."""
    blocked: bool


@dataclass(frozen=True, slots=True)
class BlockInfo:
    """The entry that blocks the level, for a log line and the admin endpoint."""

    entry: ScheduleEntry
    status: ProcessStatus
    failures: int
    last_error: str | None


@dataclass(frozen=True, slots=True)
class PendingStats:
    level: int
    pending: int
    running: int
    failed: int
    """Entries in EXCEPTION, waiting for their resend."""
    blocked: bool
    safe_offset: int
    next_offset: int
    added_total: int
    delivered_total: int
    failures_total: int
    resends_total: int
    skips_total: int


class _Entry:
    __slots__ = (
        "entry",
        "status",
        "attempt",
        "failures",
        "missing_tries",
        "retry_at_ms",
        "last_error",
        "skip_reason",
    )

    def __init__(self, entry: ScheduleEntry, status: ProcessStatus) -> None:
        self.entry = entry
        self.status = status
        self.attempt = 1
        self.failures = 0
        self.missing_tries = 0
        self.retry_at_ms = 0
        self.last_error: str | None = None
        self.skip_reason: str | None = None


class PendingQueue:
    """Pending async deliveries of one level, settled in queue order."""

    def __init__(self, level: int, start_offset: int, config: PendingConfig | None = None) -> None:
        if start_offset < 0:
            raise ValueError(f"start_offset must be >= 0, got {start_offset}")
        self._level = level
        self._config = config if config is not None else PendingConfig()
        self._queue: deque[_Entry] = deque()
        self._by_offset: dict[int, _Entry] = {}
        self._failed: dict[int, _Entry] = {}
        self._blocking: dict[int, _Entry] = {}
        self._safe_offset = start_offset
        self._next_offset = start_offset
        self._added_total = 0
        self._delivered_total = 0
        self._failures_total = 0
        self._resends_total = 0
        self._skips_total = 0

    @property
    def level(self) -> int:
        return self._level

    @property
    def config(self) -> PendingConfig:
        return self._config

    @property
    def safe_offset(self) -> int:
        """Every entry below it is settled; the level offset that may be recorded."""
        return self._safe_offset

    @property
    def next_offset(self) -> int:
        """The queue offset the next added entry must have: where the delivery loop scans."""
        return self._next_offset

    @property
    def blocked(self) -> bool:
        return bool(self._blocking)

    @property
    def failed_count(self) -> int:
        """Entries in EXCEPTION, waiting for their resend."""
        return len(self._failed)

    def __len__(self) -> int:
        return len(self._queue)

    def try_add(self, entry: ScheduleEntry) -> AddResult:
        """Record a delivery the driver is about to send (attempt 1), unless full or blocked."""
        return self._add(entry, ProcessStatus.RUNNING, None)

    def try_add_skip(self, entry: ScheduleEntry, reason: str) -> AddResult:
        """Record an entry the loop will not deliver (e.g. its message is corrupt).

        It is popped in order like any other, so the safe offset moves past it.
        """
        return self._add(entry, ProcessStatus.SKIP, reason)

    def try_add_delivered(self, entry: ScheduleEntry) -> AddResult:
        """Record an entry a previous leader already delivered (known from replicated state)."""
        return self._add(entry, ProcessStatus.SUCCESS, None)

    def on_success(self, queue_offset: int) -> ProcessStatus | None:
        """Any attempt of this entry committed. None if the entry was already settled."""
        item = self._lookup(queue_offset)
        if item is None:
            return None
        if item.status in (ProcessStatus.RUNNING, ProcessStatus.EXCEPTION):
            item.status = ProcessStatus.SUCCESS
            self._failed.pop(queue_offset, None)
            self._blocking.pop(queue_offset, None)
        return item.status

    def on_failure(
        self, queue_offset: int, attempt: int, now_ms: int, error: str
    ) -> ProcessStatus | None:
        """Attempt ``attempt`` of this entry failed; it will be resent after its back-off.

        A report for an attempt that is no longer the current one is ignored.
        """
        item = self._lookup(queue_offset)
        if item is None:
            return None
        if item.status is not ProcessStatus.RUNNING or attempt != item.attempt:
            return item.status
        self._fail(item, now_ms, error)
        return item.status

    def on_missing(self, queue_offset: int, attempt: int, now_ms: int) -> ProcessStatus | None:
        """The message of this entry was not found in the CommitLog on attempt ``attempt``."""
        item = self._lookup(queue_offset)
        if item is None:
            return None
        if item.status is not ProcessStatus.RUNNING or attempt != item.attempt:
            return item.status
        item.missing_tries += 1
        entry = item.entry
        if item.missing_tries >= self._config.max_missing_tries:
            item.status = ProcessStatus.SKIP
            item.skip_reason = (
                f"schedule level {self._level} queue offset {entry.queue_offset}: message "
                f"missing from the CommitLog (offset {entry.commitlog_offset}, "
                f"{entry.size_bytes} bytes) after {item.missing_tries} tries; skipped"
            )
            self._failures_total += 1
            self._blocking.pop(queue_offset, None)
        else:
            self._fail(item, now_ms, "message missing from the CommitLog")
        return item.status

    def settle(self, now_ms: int) -> Settlement:
        """Pop the settled head, advance the safe offset, and pick the resends now due."""
        before = self._safe_offset
        delivered = 0
        skipped: list[Skipped] = []
        while self._queue:
            head = self._queue[0]
            if head.status is ProcessStatus.SUCCESS:
                delivered += 1
            elif head.status is ProcessStatus.SKIP:
                reason = head.skip_reason or "skipped"
                skipped.append(Skipped(entry=head.entry, reason=reason))
            else:
                break
            self._queue.popleft()
            del self._by_offset[head.entry.queue_offset]
            self._safe_offset = head.entry.queue_offset + 1
        self._delivered_total += delivered
        self._skips_total += len(skipped)

        resends: list[Resend] = []
        next_resend_ms: int | None = None
        for queue_offset in sorted(self._failed):
            item = self._failed[queue_offset]
            if item.retry_at_ms > now_ms:
                if next_resend_ms is None or item.retry_at_ms < next_resend_ms:
                    next_resend_ms = item.retry_at_ms
                continue
            resends.append(
                Resend(
                    entry=item.entry,
                    attempt=item.attempt + 1,
                    failures=item.failures,
                    backoff_ms=resend_backoff_ms(item.attempt - 1, self._config),
                    last_error=item.last_error,
                )
            )
            item.attempt += 1
            item.status = ProcessStatus.RUNNING
            del self._failed[queue_offset]
        self._resends_total += len(resends)

        return Settlement(
            safe_offset=self._safe_offset,
            advanced=self._safe_offset != before,
            delivered=delivered,
            skipped=tuple(skipped),
            resends=tuple(resends),
            next_resend_ms=next_resend_ms,
            blocked=self.blocked,
        )

    def status_of(self, queue_offset: int) -> ProcessStatus | None:
        item = self._by_offset.get(queue_offset)
        return None if item is None else item.status

    def blocking_entry(self) -> BlockInfo | None:
        """The lowest entry that blocks the level, if any."""
        if not self._blocking:
            return None
        item = self._blocking[min(self._blocking)]
        return BlockInfo(
            entry=item.entry,
            status=item.status,
            failures=item.failures,
            last_error=item.last_error,
        )

    def stats(self) -> PendingStats:
        running = sum(1 for item in self._queue if item.status is ProcessStatus.RUNNING)
        return PendingStats(
            level=self._level,
            pending=len(self._queue),
            running=running,
            failed=len(self._failed),
            blocked=self.blocked,
            safe_offset=self._safe_offset,
            next_offset=self._next_offset,
            added_total=self._added_total,
            delivered_total=self._delivered_total,
            failures_total=self._failures_total,
            resends_total=self._resends_total,
            skips_total=self._skips_total,
        )

    def _add(self, entry: ScheduleEntry, status: ProcessStatus, reason: str | None) -> AddResult:
        if entry.queue_offset != self._next_offset:
            raise ScheduleInternalError(
                f"schedule level {self._level}: entries must be added in queue order; "
                f"expected offset {self._next_offset}, got {entry.queue_offset}"
            )
        if self._blocking:
            return AddResult.BLOCKED
        if len(self._queue) >= self._config.max_pending_limit:
            return AddResult.FULL
        item = _Entry(entry, status)
        item.skip_reason = reason
        self._queue.append(item)
        self._by_offset[entry.queue_offset] = item
        self._next_offset = entry.queue_offset + 1
        self._added_total += 1
        return AddResult.ADDED

    def _lookup(self, queue_offset: int) -> _Entry | None:
        if queue_offset >= self._next_offset:
            raise ScheduleInternalError(
                f"schedule level {self._level}: no delivery was added at offset {queue_offset} "
                f"(next offset {self._next_offset})"
            )
        return self._by_offset.get(queue_offset)

    def _fail(self, item: _Entry, now_ms: int, error: str) -> None:
        item.status = ProcessStatus.EXCEPTION
        item.failures += 1
        item.last_error = error
        item.retry_at_ms = now_ms + resend_backoff_ms(item.attempt - 1, self._config)
        self._failures_total += 1
        self._failed[item.entry.queue_offset] = item
        if item.failures >= self._config.max_resend_num_to_blocked:
            self._blocking[item.entry.queue_offset] = item
