"""How long the Raft thread's ticks take, and what took the time.

pysyncobj runs everything Raft does on one thread, one tick after another: the election check,
commit, apply, sending appends and heartbeats, snapshots, and reading the network. A leader
whose tick outlasts the followers' election timeout sends no heartbeat meanwhile, and they
elect another leader although nothing failed. :class:`TickWatch` measures each tick and the
parts known to be long (applying commands, writing a snapshot), so a slow tick is logged with
its cause and counted in the node's status.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(slots=True)
class TickReport:
    """Slow ticks since the last report."""

    slow: int
    worst_ms: float
    worst_apply_ms: float
    worst_applied: int
    worst_snapshot_ms: float

    def describe(self, slow_ms: float) -> str:
        return (
            f"{self.slow} Raft tick(s) over {slow_ms:.0f} ms; the longest took "
            f"{self.worst_ms:.0f} ms: applying {self.worst_applied} command(s) "
            f"{self.worst_apply_ms:.0f} ms, snapshot {self.worst_snapshot_ms:.0f} ms"
        )


class TickWatch:
    """Times ticks; :meth:`end` returns a report at most every ``report_every_s``."""

    def __init__(
        self,
        slow_ms: float,
        *,
        report_every_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.slow_ms = slow_ms
        self._report_every_s = report_every_s
        self._clock = clock
        self._started = 0.0
        self._apply_s = 0.0
        self._applied = 0
        self._snapshot_s = 0.0
        self._last_report = float("-inf")
        self._pending: TickReport | None = None
        #: Totals since start, for the node's status.
        self.ticks = 0
        self.slow_ticks = 0
        self.max_ms = 0.0

    def begin(self) -> None:
        self._started = self._clock()
        self._apply_s = 0.0
        self._applied = 0
        self._snapshot_s = 0.0

    def applied(self, seconds: float) -> None:
        self._apply_s += seconds
        self._applied += 1

    def snapshotted(self, seconds: float) -> None:
        self._snapshot_s += seconds

    def end(self) -> TickReport | None:
        now = self._clock()
        took_ms = (now - self._started) * 1000
        self.ticks += 1
        self.max_ms = max(self.max_ms, took_ms)
        if took_ms > self.slow_ms:
            self.slow_ticks += 1
            p = self._pending
            if p is None:
                p = self._pending = TickReport(0, 0.0, 0.0, 0, 0.0)
            p.slow += 1
            if took_ms > p.worst_ms:
                p.worst_ms = took_ms
                p.worst_apply_ms = self._apply_s * 1000
                p.worst_applied = self._applied
                p.worst_snapshot_ms = self._snapshot_s * 1000
        if self._pending is None or now - self._last_report < self._report_every_s:
            return None
        report, self._pending = self._pending, None
        self._last_report = now
        return report
