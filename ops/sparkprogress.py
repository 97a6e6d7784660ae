"""Progress of a long Spark job on the terminal: phase, stages done, tasks, lines read.

A daemon thread polls the driver's monitoring REST API (``/api/v1/applications/<id>/stages``,
served by the Spark UI) for stage states and input records, and falls back to the
``SparkStatusTracker`` (stages and tasks only) when the UI is off or unreachable. On a terminal
one status line is redrawn in place; otherwise a line is printed at most every
``plain_interval_s``. Spark Connect sessions have no local driver to poll: only the phases
are printed.
"""

from __future__ import annotations

import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TextIO

import orjson

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

_REST_TIMEOUT_S = 10.0
_REST_MAX_FAILURES = 5


@dataclass(frozen=True, slots=True)
class Snapshot:
    stages_done: int
    stages_running: int
    tasks_done: int
    tasks_total: int
    lines_read: int | None


def _fmt_duration(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes:02d}:{secs:02d}"


class SparkProgress:
    """Use as a context manager around the job; call :meth:`phase` as the job moves on."""

    def __init__(
        self,
        spark: SparkSession | None,
        *,
        stream: TextIO | None = None,
        enabled: bool = True,
        interval_s: float = 2.0,
        plain_interval_s: float = 15.0,
    ) -> None:
        self._stream = stream if stream is not None else sys.stderr
        self._enabled = enabled
        self._interval_s = interval_s
        self._plain_interval_s = plain_interval_s
        self._tty = bool(getattr(self._stream, "isatty", lambda: False)())
        self._started = time.monotonic()
        self._phase = "starting"
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._last_plain = 0.0
        self._drawn = False
        self._sc: Any = None
        self._rest_url: str | None = None
        self._rest_failures = 0
        self._rest_retry_at = 0.0
        if spark is not None:
            try:
                self._sc = spark.sparkContext
            except Exception:  # Spark Connect: no SparkContext on this side
                self._sc = None
        if self._sc is not None:
            ui = self._sc.uiWebUrl
            if ui:
                self._rest_url = f"{ui}/api/v1/applications/{self._sc.applicationId}/stages"

    # -- public ------------------------------------------------------------------------------

    def phase(self, name: str, detail: str = "") -> None:
        """Start a new phase; prints it on its own line."""
        with self._lock:
            self._phase = name
            if self._enabled:
                self._clear()
                elapsed = _fmt_duration(time.monotonic() - self._started)
                text = f"{name}: {detail}" if detail else name
                self._stream.write(f"[{elapsed}] {text}\n")
                self._stream.flush()

    def note(self, text: str) -> None:
        """A message between phases (warnings about the input, for example)."""
        with self._lock:
            if self._enabled:
                self._clear()
                self._stream.write(text + "\n")
                self._stream.flush()

    def snapshot(self) -> Snapshot | None:
        """Stage and task counts now, or None when there is no local driver to ask."""
        if self._sc is None:
            return None
        now = time.monotonic()
        if self._rest_url is not None and now >= self._rest_retry_at:
            snap = self._from_rest()
            if snap is not None:
                self._rest_failures = 0
                return snap
            # The UI answers late while the JVM warms up: back off, give up after a few tries.
            self._rest_failures += 1
            self._rest_retry_at = now + 5.0 * self._rest_failures
            if self._rest_failures >= _REST_MAX_FAILURES:
                self._rest_url = None
        return self._from_tracker()

    def __enter__(self) -> SparkProgress:
        if self._enabled and self._sc is not None:
            self._thread = threading.Thread(target=self._run, name="spark-progress", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        with self._lock:
            self._clear()

    # -- polling -----------------------------------------------------------------------------

    def _from_rest(self) -> Snapshot | None:
        assert self._rest_url is not None
        try:
            with urllib.request.urlopen(self._rest_url, timeout=_REST_TIMEOUT_S) as answer:
                stages = orjson.loads(answer.read())
        except (OSError, ValueError):
            return None
        if not isinstance(stages, list):
            return None
        done = running = tasks_done = tasks_total = lines = 0
        for stage in stages:
            status = stage.get("status")
            lines += int(stage.get("inputRecords", 0) or 0)
            if status == "COMPLETE":
                done += 1
            elif status == "ACTIVE":
                running += 1
                tasks_done += int(stage.get("numCompleteTasks", 0) or 0)
                tasks_total += int(stage.get("numTasks", 0) or 0)
        return Snapshot(done, running, tasks_done, tasks_total, lines)

    def _from_tracker(self) -> Snapshot | None:
        try:
            tracker = self._sc.statusTracker()
            active = tracker.getActiveStageIds()
            infos = [tracker.getStageInfo(s) for s in active]
        except Exception:
            return None
        infos = [i for i in infos if i is not None]
        return Snapshot(
            stages_done=-1,
            stages_running=len(infos),
            tasks_done=sum(i.numCompletedTasks for i in infos),
            tasks_total=sum(i.numTasks for i in infos),
            lines_read=None,
        )

    def _line(self, snap: Snapshot) -> str:
        parts = [f"[{_fmt_duration(time.monotonic() - self._started)}] {self._phase}"]
        if snap.stages_done >= 0:
            parts.append(f"stages done {snap.stages_done}")
        if snap.stages_running:
            parts.append(
                f"running {snap.stages_running} (tasks {snap.tasks_done}/{snap.tasks_total})"
            )
        if snap.lines_read is not None:
            parts.append(f"lines read {snap.lines_read:,}")
        return " | ".join(parts)

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            snap = self.snapshot()
            if snap is None:
                continue
            line = self._line(snap)
            with self._lock:
                if self._stop.is_set():
                    break
                if self._tty:
                    self._stream.write("\r\033[K" + line)
                    self._drawn = True
                else:
                    now = time.monotonic()
                    if now - self._last_plain < self._plain_interval_s:
                        continue
                    self._last_plain = now
                    self._stream.write(line + "\n")
                self._stream.flush()

    def _clear(self) -> None:
        if self._drawn:
            self._stream.write("\r\033[K")
            self._drawn = False
