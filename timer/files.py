"""The timer's node-local files (TimerLog, TimerWheel, checkpoint) and how they are kept equal
to what the replicated log says.

Both files are *derived*: the TimerLog is appended in log order by the apply of timer
commands, and the wheel is a function of a TimerLog prefix. Writing ``W(P)`` for the wheel
that linking the records ``[start, P)`` in position order gives (:func:`rebuild_wheel` does
exactly what the live appends did, lap takeovers included), the files are right for a
replicated state whose TimerLog ends at ``P`` (kv ``timer/tl``) when the TimerLog holds exactly
``[start, P)`` and the wheel is ``W(P)``.

:meth:`TimerFiles.align` makes that so from whatever is on disk:

* the TimerLog is cut at ``P`` when longer (a restart replays the journal after the snapshot,
  which appends those records again) or completed when shorter (a node that installed a
  snapshot never applied the commands that wrote them; its TimerLog files were lost or torn):
  first from the node's own CommitLog, which holds a copy of every TimerLog record
  (:mod:`chronomq.timer.logtopic`, passed in as ``local``), and only for what that lacks (segments
  removed by retention, data written before the copy existed) from a peer (``fetch``);
* the wheel is known to be ``W(F)`` for some ``F`` (:attr:`TimerFiles.wheel_pos`); when
  ``F <= P`` the records ``[F, P)`` are linked onto it, otherwise it is rebuilt from nothing
  (a wheel cell a later lap took over cannot be given back).

On disk the wheel is written only by :meth:`TimerFiles.persist`, which runs when the Raft
snapshot is taken, so after a restart the wheel file is normally ``W(P)`` of the snapshot the
node restarts from and nothing needs linking at all. ``persist`` marks the wheel file dirty
while it writes it, so a crash half-way is noticed and the wheel rebuilt instead of trusted.

**Reclaim.** ``persist`` also deletes the whole TimerLog segments that end at or before both
the replicated reclaim position (kv ``timer/rc``, below which no apply reads) and the flushed
end, *as they stood at the checkpoint before this one*: a restart begins from a snapshot no
older than that one, and the journal it replays reads nothing below its reclaim position, nor
needs the TimerLog cut anywhere before its end. A TimerLog that nonetheless starts after the
end a snapshot needs (the node restarted from an older snapshot still) starts again at the
reclaim position's segment and is completed as a short one is.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from chronomq.raftlog import durable
from chronomq.timer.checkpoint import (
    CHECKPOINT_FILE,
    TIMERLOG_DIR,
    WHEEL_FILE,
    Checkpoint,
    load_checkpoint,
    rebuild_wheel,
    save_checkpoint,
)
from chronomq.timer.config import TimerConfig
from chronomq.timer.cursor import ReadCursor
from chronomq.timer.errors import TimerConfigMismatch, TimerCorruptionError, TimerStateError
from chronomq.timer.logtopic import LocalCopy
from chronomq.timer.timerlog import RECORD_SIZE, TimerLog, decode_record
from chronomq.timer.wheel import TimerWheel

log = logging.getLogger(__name__)

DIRTY_MARKER = "timerwheel.dirty"

#: ``fetch(start, end, sink)``: get TimerLog records ``[start, end)`` from a peer, handing raw
#: records to ``sink`` in order; raises when no peer can serve them.
Fetch = Callable[[int, int, Callable[[bytes], None]], None]
#: ``local(log, end)``: append to ``log`` what the node itself holds of ``[log.end_pos, end)``
#: (:func:`chronomq.timer.logtopic.rebuild_from_store`); says how many and why it stopped short.
Local = Callable[[TimerLog, int], LocalCopy]


@dataclass(frozen=True, slots=True)
class AlignReport:
    target_end: int
    truncated_bytes: int
    fetched_records: int
    linked_from: int
    rebuilt: bool
    linked: int
    seconds: float = 0.0
    #: TimerLog records copied back from this node's own CommitLog.
    local_records: int = 0


class TimerFiles:
    """Open timer files under ``root``; see the module docstring. Not thread-safe."""

    def __init__(self, root: Path | str, config: TimerConfig) -> None:
        self.root = Path(root)
        durable.make_dirs(self.root)
        self.config = config
        cp = self._load_checkpoint()
        self.log = TimerLog.open(
            self.root / TIMERLOG_DIR,
            segment_bytes=config.timer_log_segment_bytes,
            verify_from_pos=cp.timerlog_flush_pos if cp is not None else 0,
        )
        marker = self.root / DIRTY_MARKER
        trusted = (
            cp is not None
            and not marker.exists()
            and cp.precision_ms == config.timer_precision_ms
            and cp.timerlog_flush_pos <= self.log.end_pos
        )
        try:
            self.wheel = TimerWheel.open(self.root / WHEEL_FILE, config.geometry)
        except TimerConfigMismatch:
            self.log.close()
            raise
        except TimerCorruptionError as exc:
            log.warning("timer wheel unreadable (%s): rebuilding it", exc)
            self._set_aside_wheel()
            self.wheel = TimerWheel.open(self.root / WHEEL_FILE, config.geometry)
            trusted = False
        #: The wheel is W(wheel_pos): every record before it is linked, none after.
        self.wheel_pos = self.log.start_pos
        if trusted and cp is not None:
            self.wheel_pos = cp.timerlog_flush_pos
        else:
            self._recreate_wheel()
        self.checkpoint = cp
        self.last_align: AlignReport | None = None
        #: (reclaim position, flushed end) of the last checkpoint this process wrote: the
        #: next one deletes the segments below both.
        self._reclaim_after: tuple[int, int] | None = None
        self.reclaimed_segments = 0

    def _load_checkpoint(self) -> Checkpoint | None:
        try:
            return load_checkpoint(self.root / CHECKPOINT_FILE)
        except TimerCorruptionError as exc:
            log.warning("timer checkpoint unreadable (%s): rebuilding the wheel", exc)
            return None

    # ------------------------------------------------------------------ alignment

    def align(
        self,
        target_end: int,
        fetch: Fetch | None,
        local: Local | None = None,
        reclaim_pos: int = 0,
    ) -> AlignReport:
        """Make the TimerLog end at ``target_end`` and the wheel ``W(target_end)``.

        A TimerLog that is short is completed from ``local`` (this node's CommitLog) first;
        ``fetch`` (a peer) gets only what that could not give. One that starts after
        ``target_end`` starts again at the segment of ``reclaim_pos`` (nothing before it is
        read) and is completed so.
        """
        import time

        t0 = time.monotonic()
        rebuilt = False
        self._reclaim_after = None  # the next checkpoint deletes nothing: this one is new
        if self.log.start_pos > target_end:
            restart = min(reclaim_pos, target_end)
            log.warning(
                "TimerLog starts at %d, after the end %d the replicated state needs: starting "
                "it again at the segment of %d",
                self.log.start_pos,
                target_end,
                restart,
            )
            self.log.restart_at(restart)
            self._recreate_wheel()
            rebuilt = True
        if self.wheel_pos > target_end:
            self._recreate_wheel()
            rebuilt = True
        truncated = 0
        if self.log.end_pos > target_end:
            truncated = self.log.end_pos - target_end
            self.log.truncate(target_end)
        fetched = local_records = 0
        if self.log.end_pos < target_end and local is not None:
            local_records = self._copy_local(target_end, local, may_fetch=fetch is not None)
        if self.log.end_pos < target_end:
            if fetch is None:
                raise TimerStateError(
                    f"TimerLog ends at {self.log.end_pos}, the replicated state needs "
                    f"{target_end}, this node's CommitLog does not hold the rest, and there "
                    "is no peer to fetch it from"
                )
            fetched = self._fetch(target_end, fetch)
        linked_from = self.wheel_pos
        report = rebuild_wheel(self.wheel, self.log, linked_from)
        self.wheel_pos = self.log.end_pos
        out = AlignReport(
            target_end,
            truncated,
            fetched,
            linked_from,
            rebuilt,
            report.linked,
            round(time.monotonic() - t0, 3),
            local_records,
        )
        self.last_align = out
        if truncated or fetched or local_records or rebuilt or report.linked:
            log.info("timer files aligned to TimerLog end %d: %s", target_end, out)
        return out

    def _copy_local(self, target_end: int, local: Local, *, may_fetch: bool) -> int:
        start = self.log.end_pos
        try:
            copy = local(self.log, target_end)
        except TimerCorruptionError as exc:
            if not may_fetch:
                raise
            log.error(
                "TimerLog [%d, %d) cannot be rebuilt from this node's CommitLog (%s): "
                "fetching the rest from a peer",
                self.log.end_pos,
                target_end,
                exc,
            )
            # What was appended before the gap continues the TimerLog rightly: keep it.
            return sum(1 for _ in self.log.scan(start))
        log.info(
            "TimerLog rebuilt from this node's CommitLog: %d records, [%d, %d) of [%d, %d)%s",
            copy.records,
            start,
            self.log.end_pos,
            start,
            target_end,
            f"; stopped: {copy.stopped}" if copy.stopped else "",
        )
        return copy.records

    def _fetch(self, target_end: int, fetch: Fetch) -> int:
        count = 0
        start = self.log.end_pos

        def sink(data: bytes) -> None:
            nonlocal count
            if len(data) % RECORD_SIZE:
                raise TimerCorruptionError("fetched TimerLog data is not whole records")
            for at in range(0, len(data), RECORD_SIZE):
                if self.log.end_pos >= target_end:
                    raise TimerCorruptionError("a peer sent TimerLog records beyond the target")
                self.log.append(decode_record(data[at : at + RECORD_SIZE]))
                count += 1

        log.info("fetching TimerLog [%d, %d) from a peer", start, target_end)
        fetch(start, target_end, sink)
        if self.log.end_pos != target_end:
            raise TimerCorruptionError(
                f"fetched TimerLog ends at {self.log.end_pos}, expected {target_end}"
            )
        return count

    def sync_wheel_pos(self) -> None:
        """After live appends (each linked at once): the wheel covers the whole TimerLog."""
        self.wheel_pos = self.log.end_pos

    def _recreate_wheel(self) -> None:
        self.wheel.close()
        path = self.root / WHEEL_FILE
        path.unlink(missing_ok=True)
        self.wheel = TimerWheel.open(path, self.config.geometry)
        self.wheel_pos = self.log.start_pos

    def _set_aside_wheel(self) -> None:
        path = self.root / WHEEL_FILE
        with contextlib.suppress(FileNotFoundError):
            path.replace(path.with_name(path.name + ".corrupt"))

    # ------------------------------------------------------------------ persistence

    def persist(
        self,
        *,
        applied_index: int,
        enqueue_offset: int,
        cursor: ReadCursor,
        last_delivered_ms: int,
        reclaim_pos: int = 0,
    ) -> Checkpoint:
        """fsync the TimerLog, write the wheel's changed slots, save the checkpoint, then
        delete the segments the previous checkpoint's reclaim position allows (see the module
        docstring).

        The dirty marker exists while the wheel file is being written: a crash in between
        leaves it, and the next start rebuilds the wheel rather than trusting a half-written
        file. Its name is synced before the first slot is written, or a power cut could keep
        some of the slots and lose the marker.
        """
        marker = self.root / DIRTY_MARKER
        flush_pos = self.log.flush()
        if self.wheel.dirty_slots:
            fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                durable.fsync(fd, marker)
            finally:
                os.close(fd)
            durable.fsync_dir(self.root)
            self.wheel.flush(durable_log_end=flush_pos)
        cp = Checkpoint(
            precision_ms=self.config.timer_precision_ms,
            applied_index=applied_index,
            enqueue_offset=enqueue_offset,
            timerlog_flush_pos=flush_pos,
            cursor=cursor,
            last_delivered_ms=last_delivered_ms,
        )
        save_checkpoint(self.root / CHECKPOINT_FILE, cp)
        marker.unlink(missing_ok=True)
        self.checkpoint = cp
        if self._reclaim_after is not None:
            dropped = self.log.drop_segments_before(min(self._reclaim_after))
            if dropped:
                self.reclaimed_segments += dropped
                log.info(
                    "TimerLog: deleted %d segment(s) before position %d; it now starts at %d",
                    dropped,
                    min(self._reclaim_after),
                    self.log.start_pos,
                )
        self._reclaim_after = (reclaim_pos, flush_pos)
        return cp

    def close(self) -> None:
        """Close without persisting: what is not in a checkpoint is derived again from the
        Raft journal on the next start."""
        self.wheel.close()
        self.log.close()
