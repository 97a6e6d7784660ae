"""The disk of a node: CommitLog retention and the produce guard (RocketMQ's model).

- **Retention** (``file_reserved_time_h``, ``disk_max_used_space_ratio``): a thread deletes
  whole CommitLog segments from the head, decided by :func:`chronomq.raftlog.retention.plan_retention`
  against the lowest CommitLog offset still needed (:meth:`DiskService.needed_offset`).
  Deletion is local: segments are this node's files, the replicated state (CommitLog length,
  hash chain, tables) does not change, so digests stay equal on every replica whatever each
  one deleted.
- **Guard** (``disk_space_warning_level_ratio``): the leader admits a produce only when a
  majority of the members, itself among them, would still have :func:`reserve_bytes` free
  (the ratio's share of the disk, at least four times the floor of :mod:`chronomq.raftlog.room`)
  after everything admitted and not yet written, this request included. What a request needs
  is counted per message (:func:`disk_need`): its record in the CommitLog and in the Raft
  journal, its ConsumeQueue unit, and for a delayed message its delivered copy (journal and
  CommitLog again), its TimerLog record and that record's copy. Followers report their free
  space with every acknowledgement (``raftlog/transport.py``); a member with no report in the
  last :data:`REPORT_STALE_S` counts as without room. Otherwise produce answers 507
  ``disk_full`` naming the nodes short of room, with ``Retry-After``; delivery, consumption and
  admin go on. Below the guard, every node pauses by itself at the floor (raftlog/room.py).

What "still needed" means, lowest of:

- the delay levels: the ConsumeQueue unit at each level's replicated offset
  (:mod:`chronomq.schedule.hold`);
- the timer: the timer topic's unit at the replicated enqueue offset and the TimerLog records
  the replicated read cursor has not passed (:mod:`chronomq.timer.hold`);
- pop consumption: the messages a group holds (in flight or revived) and the revive topic's
  CKs not read yet (:mod:`chronomq.pop.hold`);
- a restart: pysyncobj replays the journal from this node's last snapshot, and that replay
  reads what the state *then* needed. Each pass records ``(applied index, needed offset)``;
  a pass deletes only up to the offset recorded at or before the last snapshot's index
  (needed offsets only grow with the index), and never the hash chain's last block or the
  tail the snapshot checks (:data:`chronomq.raftlog.chain.BLOCK_BYTES`) before the snapshot's length.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from chronomq.cluster.config.nodeconfig import NodeConfig
from chronomq.cluster.node.errors import ApiError
from chronomq.pop import lowest_needed_offset as pop_needed
from chronomq.raftlog.chain import BLOCK_BYTES
from chronomq.raftlog.node import NewMessage, RaftLog
from chronomq.raftlog.retention import (
    RetentionDecision,
    RetentionPolicy,
    SegmentInfo,
    plan_retention,
)
from chronomq.raftlog.room import floor_bytes as room_floor
from chronomq.raftlog.snapshot import COMPARE_WINDOW_BYTES, TAIL_DIGEST_BYTES
from chronomq.raftlog.store import Store
from chronomq.schedule.hold import lowest_needed_offset as schedule_needed
from chronomq.schedule.levels import SCHEDULE_TOPIC
from chronomq.timer.hold import TimerHold
from chronomq.timer.message import TIMER_QUEUE, TIMER_TOPIC

log = logging.getLogger(__name__)

SAMPLE_INTERVAL_S = 1.0
#: Within this fraction of the warning level the disk is sampled ten times as often.
NEAR_MARGIN = 0.10
#: Bytes this node writes per CommitLog byte (the CommitLog and the Raft journal): the guard
#: adds the writes since the last sample to it, so a burst between samples counts.
WRITE_AMPLIFICATION = 2
RETENTION_INTERVAL_S = 2.0
#: A follower's free space reported longer ago than this is not trusted (it reports with
#: every acknowledgement, many times a second).
REPORT_STALE_S = 2.0
#: Bytes of a message record besides its topic, body and properties (layout, ids, times).
RECORD_OVERHEAD_BYTES = 128
#: Raft journal + CommitLog: every record is written twice until the journal is compacted.
COPIES = 2
CQ_UNIT_BYTES = 20
#: A timer's TimerLog record and its copy in the CommitLog's TimerLog topic.
TIMER_BYTES = 80 + 81
#: ``(applied index, needed offset)`` pairs kept while waiting for a snapshot to pass them.
HISTORY_MAX = 256
RETRY_AFTER_S = 5


@dataclass(frozen=True, slots=True)
class DiskUsage:
    total_bytes: int
    free_bytes: int

    @property
    def used_ratio(self) -> float:
        if self.total_bytes <= 0:
            return 0.0
        return 1.0 - self.free_bytes / self.total_bytes


class DiskGauge:
    """``os.statvfs`` of a directory, sampled at most every ``interval_s`` (thread-safe)."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        interval_s: float = SAMPLE_INTERVAL_S,
        near_ratio: float = 1.0,
        written: Callable[[], int] = lambda: 0,
        statvfs: Callable[[str], Any] = os.statvfs,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``near_ratio``: above it, sample every ``interval_s / 10``. ``written``: a running
        count of bytes this node wrote, read at each sample (see :meth:`projected_ratio`)."""
        self._path = os.fspath(path)
        self._interval_s = interval_s
        self._near_ratio = near_ratio
        self._written = written
        self._statvfs = statvfs
        self._clock = clock
        self._lock = threading.Lock()
        self._at = float("-inf")
        self._usage = DiskUsage(0, 0)
        self._written_at_sample = 0
        self.samples = 0

    def sample(self) -> DiskUsage:
        now = self._clock()
        with self._lock:
            interval = self._interval_s
            if self._usage.used_ratio >= self._near_ratio:
                interval /= 10
            if now - self._at >= interval:
                try:
                    st = self._statvfs(self._path)
                    self._usage = DiskUsage(st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize)
                    self._written_at_sample = self._written()
                    self.samples += 1
                except OSError as exc:
                    log.warning("statvfs of %s failed: %s", self._path, exc)
                self._at = now
            return self._usage

    def projected_ratio(self) -> float:
        """The used ratio of the last sample plus what this node wrote since (times
        :data:`WRITE_AMPLIFICATION`): no system call."""
        usage = self.sample()
        if usage.total_bytes <= 0:
            return 0.0
        grown = max(0, self._written() - self._written_at_sample) * WRITE_AMPLIFICATION
        return min(1.0, usage.used_ratio + grown / usage.total_bytes)


def reserve_bytes(total_bytes: int, warning_level_ratio: float) -> int:
    """Free space the guard keeps on every member of the majority it needs."""
    return max(int(total_bytes * (1 - warning_level_ratio)), 4 * room_floor(total_bytes))


def disk_need(messages: Iterable[NewMessage]) -> int:
    """Bytes a node writes for ``messages`` until they are delivered (see the module)."""
    need = 0
    for m in messages:
        props = sum(len(k) + len(v) + 2 for k, v in m.properties.items())
        record_bytes = len(m.body) + len(m.topic) + props + RECORD_OVERHEAD_BYTES
        need += COPIES * record_bytes + CQ_UNIT_BYTES
        if m.topic in (SCHEDULE_TOPIC, TIMER_TOPIC):
            need += COPIES * record_bytes + CQ_UNIT_BYTES + TIMER_BYTES
    return need


@dataclass(frozen=True, slots=True)
class MemberRoom:
    """What the guard knows of one member's disk."""

    node: str  # "node 2 (this node)", "node 1"
    free_bytes: int | None  # projected: less what was written and admitted since it was read
    total_bytes: int | None
    ok: bool

    def describe(self) -> str:
        if self.free_bytes is None or self.total_bytes is None:
            return f"{self.node}: no recent report"
        return (
            f"{self.node}: {max(0, self.free_bytes) / 2**20:.1f} MiB free of "
            f"{self.total_bytes / 2**20:.0f} MiB"
        )


def chain_floor(length: int) -> int:
    """The lowest offset a restore at ``length`` reads: the hash chain's last partial block,
    the snapshot's tail digest and the window compared with peers."""
    return max(
        0,
        min(
            length - length % BLOCK_BYTES, length - TAIL_DIGEST_BYTES, length - COMPARE_WINDOW_BYTES
        ),
    )


class DiskService:
    """Retention thread and produce guard of one node (see the module docstring)."""

    def __init__(self, config: NodeConfig, raftlog: RaftLog, broker: Any) -> None:
        self.config = config
        self.store: Store = raftlog.store
        self.raftlog = raftlog
        self.broker = broker
        self.gauge = DiskGauge(
            config.data_dir,
            near_ratio=config.disk_space_warning_level_ratio - NEAR_MARGIN,
            written=lambda: self.store.commitlog.length,
        )
        self._timer_hold = TimerHold()
        self._history: collections.deque[tuple[int, int | None]] = collections.deque()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.rejected = 0
        self.reserved_bytes = 0  # admitted produce requests not yet answered (see admit)
        self.passes = 0
        self.last: RetentionDecision | None = None
        self.last_needed: int | None = None
        self.last_error: str | None = None

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="disk-retention", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    # ------------------------------------------------------------------ guard

    @contextlib.contextmanager
    def admit(self, need_bytes: int) -> Iterator[None]:
        """Hold ``need_bytes`` of every member's disk while a produce is written; 507
        ``disk_full`` when a majority would not keep :func:`reserve_bytes` free."""
        self.check_produce(need_bytes)
        self.reserved_bytes += need_bytes
        try:
            yield
        finally:
            self.reserved_bytes -= need_bytes

    def members_room(self, need_bytes: int = 0) -> list[MemberRoom]:
        """Each member's projected free space after what is admitted and ``need_bytes``."""
        ratio = self.config.disk_space_warning_level_ratio
        machine = self.raftlog.machine
        pending = self.reserved_bytes + need_bytes
        own = machine.room_gauge.room()
        own_free = own.free_bytes - pending
        rows = [
            MemberRoom(
                f"node {self.config.node_id} (this node)",
                own_free,
                own.total_bytes,
                own.total_bytes <= 0 or own_free >= reserve_bytes(own.total_bytes, ratio),
            )
        ]
        now = time.monotonic()
        written = self.store.commitlog.length
        for peer in self.broker.peers():
            report = machine.peer_rooms.get(peer.raft)
            if report is None or now - report[1] > REPORT_STALE_S:
                rows.append(MemberRoom(f"node {peer.id}", None, None, False))
                continue
            room, _at, written_then = report
            free = room.free_bytes - COPIES * max(0, written - written_then) - pending
            ok = room.total_bytes <= 0 or free >= reserve_bytes(room.total_bytes, ratio)
            rows.append(MemberRoom(f"node {peer.id}", free, room.total_bytes, ok))
        return rows

    def check_produce(self, need_bytes: int = 0) -> None:
        """507 ``disk_full`` unless this node and enough others for a majority would keep
        :func:`reserve_bytes` free after what is admitted and ``need_bytes``."""
        rows = self.members_room(need_bytes)
        majority = len(rows) // 2 + 1
        with_room = sum(1 for r in rows if r.ok)
        if rows[0].ok and with_room >= majority:
            return
        self.rejected += 1
        short = "; ".join(r.describe() for r in rows if not r.ok)
        ratio = self.config.disk_space_warning_level_ratio
        raise ApiError(
            507,
            "disk_full",
            f"produce refused: a write must fit on this node and on a majority ({majority} of "
            f"{len(rows)}) while each keeps {1 - ratio:.0%} of its disk free "
            f"(disk_space_warning_level_ratio {ratio}), after the "
            f"{self.reserved_bytes / 2**20:.1f} MiB already admitted and this request's "
            f"{need_bytes / 2**20:.1f} MiB; short of room: {short}. Retry once retention frees "
            "space or the disks grow; delivery and consumption go on",
            None,
            {"Retry-After": str(RETRY_AFTER_S)},
        )

    # ------------------------------------------------------------------ retention

    def needed_offset(self) -> int | None:
        """The lowest CommitLog offset a waiting delayed or timer message lives at now
        (None: nothing waits)."""
        lows = [schedule_needed(self.store)]
        timer = getattr(self.broker, "timer", None)
        machine = getattr(timer, "machine", None)
        if machine is not None and machine.name in self.store.extensions:
            lows.append(self._timer_hold.lowest_needed_offset(machine, self.store))
        else:  # no timer here: everything ever put into the timer topic may still wait
            units = self.store.read_units(TIMER_TOPIC, TIMER_QUEUE, 0, 1)
            lows.append(units[0].commitlog_offset if units else None)
        if getattr(self.broker, "pop", None) is not None:
            lows.append(pop_needed(self.store))
        found = [x for x in lows if x is not None]
        return min(found) if found else None

    def floor(self) -> int | None:
        """Below this offset segments may go; None: none may go yet (no snapshot passed a
        recorded pass)."""
        needed = self.needed_offset()
        # Read after: every part of ``needed`` was computed at an index at or below this.
        index = self.store.applied_index
        self.last_needed = needed
        self._history.append((index, needed))
        snap_index, snap_length = self.store.snapshot_index, self.store.snapshot_length
        while len(self._history) > 1 and self._history[1][0] <= snap_index:
            self._history.popleft()
        while len(self._history) > HISTORY_MAX:
            del self._history[1]  # the oldest stays: it is the lowest, so always safe
        first_index, first_needed = self._history[0]
        if first_index > snap_index or snap_index == 0:
            return None
        limit = min(chain_floor(snap_length), chain_floor(self.store.applied_length))
        return limit if first_needed is None else min(limit, first_needed)

    def run_once(self, now_ms: int | None = None) -> RetentionDecision | None:
        commitlog = self.store.commitlog
        commitlog.close_retired()
        floor = self.floor()
        self.passes += 1
        if floor is None:
            return None
        segments = [
            SegmentInfo(base, end, int(mtime * 1000)) for base, end, mtime in commitlog.segments()
        ]
        decision = plan_retention(
            segments,
            needed_offset=floor,
            now_ms=int(time.time() * 1000) if now_ms is None else now_ms,
            used_ratio=self.gauge.sample().used_ratio,
            policy=RetentionPolicy(
                reserved_ms=int(self.config.file_reserved_time_h * 3_600_000),
                max_used_ratio=self.config.disk_max_used_space_ratio,
            ),
        )
        self.last = decision
        if decision.delete:
            last_base = decision.delete[-1]
            commitlog.delete_head(last_base + commitlog.segment_bytes)
        return decision

    def _run(self) -> None:
        while not self._stop.wait(RETENTION_INTERVAL_S):
            try:
                self.run_once()
                self.last_error = None
            except Exception as exc:  # retention must never stop the node
                self.last_error = f"{type(exc).__name__}: {exc}"
                log.exception("CommitLog retention pass failed")

    # ------------------------------------------------------------------ status

    def _admits(self) -> bool:
        try:
            self.check_produce()
        except ApiError:
            self.rejected -= 1  # a look, not a refusal
            return False
        return True

    def stats(self) -> dict[str, Any]:
        usage = self.gauge.sample()
        commitlog = self.store.commitlog
        last = self.last
        return {
            "data_dir": str(Path(self.config.data_dir)),
            "used_ratio": round(usage.used_ratio, 4),
            "free_bytes": usage.free_bytes,
            "total_bytes": usage.total_bytes,
            "warning_level_ratio": self.config.disk_space_warning_level_ratio,
            "max_used_space_ratio": self.config.disk_max_used_space_ratio,
            "file_reserved_time_h": self.config.file_reserved_time_h,
            "produce_refused": not self._admits(),
            "produce_rejections": self.rejected,
            "reserved_bytes": self.reserved_bytes,
            "reserve_bytes": reserve_bytes(
                usage.total_bytes, self.config.disk_space_warning_level_ratio
            ),
            "members": [
                {
                    "node": r.node,
                    "free_bytes": r.free_bytes,
                    "total_bytes": r.total_bytes,
                    "ok": r.ok,
                }
                for r in self.members_room()
            ],
            "paused": self.raftlog.machine.room_watch.pause is not None,
            "commitlog_min_offset": commitlog.min_offset,
            "commitlog_max_offset": commitlog.length,
            "segments": len(commitlog.segments()),
            "segments_deleted": commitlog.segments_deleted,
            "bytes_deleted": commitlog.bytes_deleted,
            "needed_offset": self.last_needed,
            "last_stop": None if last is None else last.stop.value,
            "pressure": bool(last and last.pressure),
            "last_error": self.last_error,
            "timerlog": self.timerlog(),
        }

    def timerlog(self) -> dict[str, int] | None:
        """The TimerLog's size on disk and reclaim progress; None without a timer."""
        machine = getattr(getattr(self.broker, "timer", None), "machine", None)
        if machine is None or machine.name not in self.store.extensions:
            return None
        stats: dict[str, int] = machine.timerlog_stats()
        return stats


def install_metrics(
    registry: Any, collectors: list[Callable[[], None]], service: DiskService
) -> None:
    from prometheus_client import Gauge

    used = Gauge(
        "chronomq_disk_used_ratio", "Used fraction of the data directory's disk", registry=registry
    )
    free = Gauge(
        "chronomq_disk_free_bytes", "Free bytes on the data directory's disk", registry=registry
    )
    cl_min = Gauge(
        "chronomq_commitlog_min_offset", "First CommitLog offset still held", registry=registry
    )
    cl_max = Gauge(
        "chronomq_commitlog_max_offset",
        "CommitLog length (one past the last byte)",
        registry=registry,
    )

    tl_bytes = Gauge(
        "chronomq_timerlog_bytes", "Bytes the TimerLog's segment files hold", registry=registry
    )
    tl_segments = Gauge(
        "chronomq_timerlog_segments", "TimerLog segment files on disk", registry=registry
    )
    paused = Gauge(
        "chronomq_disk_paused",
        "1 while this node takes no Raft entries for want of disk room",
        registry=registry,
    )
    reserved = Gauge(
        "chronomq_produce_admitted_bytes",
        "Disk bytes held for produce requests admitted and not yet answered",
        registry=registry,
    )

    def collect() -> None:
        usage = service.gauge.sample()
        used.set(usage.used_ratio)
        free.set(usage.free_bytes)
        paused.set(int(service.raftlog.machine.room_watch.pause is not None))
        reserved.set(service.reserved_bytes)
        cl_min.set(service.store.commitlog.min_offset)
        cl_max.set(service.store.commitlog.length)
        timerlog = service.timerlog()
        if timerlog is not None:
            tl_bytes.set(timerlog["bytes"])
            tl_segments.set(timerlog["segments"])

    collectors.append(collect)
    registry.register(_DiskCounters(service))


class _DiskCounters:
    """The disk guard's running totals, read on every scrape."""

    def __init__(self, service: DiskService) -> None:
        self._service = service

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily

        yield CounterMetricFamily(
            "chronomq_commitlog_segments_deleted",
            "CommitLog segments deleted by retention since start",
            value=self._service.store.commitlog.segments_deleted,
        )
        timerlog = self._service.timerlog()
        if timerlog is not None:
            yield CounterMetricFamily(
                "chronomq_timerlog_segments_deleted",
                "TimerLog segments deleted since start: no unread slot, pending roll or "
                "needed cancel reached into them",
                value=timerlog["segments_deleted"],
            )
        yield CounterMetricFamily(
            "chronomq_produce_disk_full_rejections",
            "Produce requests refused with 507 disk_full since start",
            value=self._service.rejected,
        )
