"""Stopping a drill: where it is (:class:`DrillState`, announced as ``[drill] phase NAME``)
and what Ctrl-C and SIGTERM do in each phase (:class:`Stopper`).

The first signal stops the drill: while its event loop runs, by cancelling the drill's task
(the workload stops, the history is closed); while the checker reads the history, or while
nodes and namespaces are being set up, by raising KeyboardInterrupt; while the drill is
already cleaning up, it only notes it. The clean-up then stops the nodes
(:data:`INTERRUPT_NODE_STOP_S`), removes namespaces and mounts, and the drill prints a partial
report. A second signal, or :data:`INTERRUPT_GRACE_S` after the first, kills the nodes,
removes the namespaces and mounts and exits at once. The exit status is 128 + the signal's
number: 130 for Ctrl-C, 143 for SIGTERM.

The signals are taken back whatever the drill inherited (ignored, or blocked: see
:func:`~chronomq.cluster.process.stopping.take_signals`), and a thread of the drill's own acts on them:
every signal, whichever thread the kernel hands it to, writes its number to a pipe
(``signal.set_wakeup_fd``) that this thread reads. A Python handler runs only on the main
thread and only between its bytecodes, and a signal that the kernel hands to another thread
does not wake a main thread asleep in a blocking call: a second Ctrl-C sent while the
clean-up slept was seen only by the watchdog, 9 s later (under load). The reading thread
counts the signals and exits at a second one whatever the main thread is doing; what must
happen on the main thread (KeyboardInterrupt) is asked of it with ``_thread.interrupt_main``
(as :data:`NUDGE`, so that the pipe's reader does not count it) and decided there, by the
phase it is in when it sees it.
"""

from __future__ import annotations

import _thread
import asyncio
import os
import signal
import sys
import threading
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any, Literal

from chronomq.cluster.process.launcher import LocalCluster
from chronomq.cluster.process.stopping import SIGNALS, take_signals
from chronomq.ops.drill import netns
from chronomq.ops.drill.powercut import mount as powercut

INTERRUPT_GRACE_S = 9.0
"""After the first Ctrl-C, the time the drill has to stop its workload, nodes, namespaces and
mounts and to write its partial report; then it exits as at a second Ctrl-C."""
TASKS_STOP_S = 1.0
"""Interrupted: how long the workload's tasks get to end once cancelled."""
GRPC_CLOSE_S = 2.0
"""Interrupted or not: how long the official clients get to shut down."""
INTERRUPT_NODE_STOP_S = 2.0
"""Interrupted: SIGTERM to SIGKILL for the nodes (they flush their ops logs on SIGTERM)."""


def progress(msg: str) -> None:
    print(f"[drill] {msg}", file=sys.stderr, flush=True)


HOLD_PHASE_ENV = "CHRONOMQ_DRILL_HOLD_PHASE"
"""For tests: the drill waits up to :data:`HOLD_PHASE_S` when it enters the phase this names
(``warm-up``, ``fault kill-leader``, ``kill-leader held``, ``healing``, ``draining``,
``checking``, ``stopping``, ...; every phase is announced as ``[drill] phase NAME``), so that
a Ctrl-C can be sent while it is in that phase. A Ctrl-C ends the wait, except in
``stopping`` (the clean-up), where only a second one or the watchdog ends the drill."""
HOLD_PHASE_S = 60.0
HOLD_SLICE_S = 0.05


@dataclass
class DrillState:
    """Where a drill is, whether it was interrupted, and what it found so far (the partial
    report of an interrupted drill is made of it)."""

    phase: str = "starting"
    started: float = field(default_factory=time.monotonic)
    found: dict[str, Any] = field(default_factory=dict)
    interrupted: str | None = None
    """The phase the first Ctrl-C came in, once it came."""
    interrupted_after_s: float | None = None
    signal_number: int | None = None
    """The first stop signal's number, once it came."""
    hold: str | None = field(default_factory=lambda: os.environ.get(HOLD_PHASE_ENV) or None)

    def _entered(self, phase: str) -> bool:
        self.phase = phase
        progress(f"phase {phase}")
        return phase == self.hold

    async def enter(self, phase: str) -> None:
        if self._entered(phase):
            await asyncio.sleep(HOLD_PHASE_S)

    def enter_blocking(self, phase: str) -> None:
        if self._entered(phase):
            # In short sleeps: a KeyboardInterrupt asked of the main thread is raised between
            # two of them (a signal taken by another thread does not cut a sleep short).
            deadline = time.monotonic() + HOLD_PHASE_S
            while time.monotonic() < deadline:
                time.sleep(HOLD_SLICE_S)

    def interrupt(self, signum: int) -> None:
        if self.interrupted is None:
            self.signal_number = signum
            self.interrupted = self.phase
            self.interrupted_after_s = round(time.monotonic() - self.started, 1)


Mode = Literal["raise", "cancel", "note"]
"""What the first signal does: raise KeyboardInterrupt, cancel the loop's task, or note it."""


NUDGE = signal.SIGUSR1
"""The signal the reading thread raises on the main thread to have it act on the first stop
signal there (see the module docstring)."""


class Stopper:
    """Owns SIGINT and SIGTERM while a drill runs (see the module docstring)."""

    def __init__(self, state: DrillState) -> None:
        self.state = state
        self.mode: Mode = "raise"
        self.cluster: LocalCluster | None = None
        self.network: netns.Network | None = None
        self.disks: dict[int, powercut.PowerCutMount] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[Any] | None = None
        self._signals = 0
        self._exiting = threading.Lock()
        self._previous: dict[int, Any] = {}
        self._previous_wakeup = -1
        self._pipe: tuple[int, int] | None = None
        self._reader: threading.Thread | None = None

    def install(self) -> None:
        """Take the signals (on the main thread, before anything is made that the clean-up
        must remove): their numbers go to a pipe that a thread of its own reads."""
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        self._pipe = (read_fd, write_fd)
        self._previous_wakeup = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        self._previous = take_signals(self._on_signal)
        self._previous[NUDGE] = signal.signal(NUDGE, self._on_nudge)
        self._reader = threading.Thread(
            target=self._read, args=(read_fd,), name="drill-signals", daemon=True
        )
        self._reader.start()

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
        signal.set_wakeup_fd(self._previous_wakeup)
        if self._pipe is not None:
            read_fd, write_fd = self._pipe
            self._pipe = None
            os.close(write_fd)  # the reader sees the end of the pipe
            if self._reader is not None:
                self._reader.join(timeout=1.0)
            os.close(read_fd)

    def run_loop(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run ``coro`` to its end, or until the first Ctrl-C and its clean-up."""
        loop = asyncio.new_event_loop()
        try:
            task = loop.create_task(coro)
            self._loop, self._task = loop, task
            self.mode = "cancel"
            if self.state.interrupted:  # came while the loop was being made
                task.cancel()
            try:
                loop.run_until_complete(task)
            except asyncio.CancelledError:
                if not self.state.interrupted:
                    raise
            finally:
                self.mode = "note"
                self._loop = self._task = None
                left = asyncio.all_tasks(loop)
                for t in left:
                    t.cancel()
                if left:
                    loop.run_until_complete(asyncio.wait(left, timeout=TASKS_STOP_S))
                loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            # Also the default executor, without waiting for its threads.
            loop.close()

    @staticmethod
    def _on_signal(signum: int, frame: Any) -> None:
        """The Python handler of the stop signals: nothing to do (the reader acts); without
        one a Ctrl-C would raise KeyboardInterrupt anywhere, and an ignored signal would not
        reach the pipe."""

    def _on_nudge(self, signum: int, frame: Any) -> None:
        """On the main thread, asked by the reader: the first signal's effect here, by the
        phase the drill is in now."""
        if not self.state.interrupted:
            return
        if self.mode == "raise":
            raise KeyboardInterrupt
        if self.mode == "cancel" and self._task is not None:
            self._task.cancel()

    def _read(self, read_fd: int) -> None:
        while True:
            try:
                data = os.read(read_fd, 64)
            except OSError:
                return
            if not data:
                return
            for signum in data:
                if signum in SIGNALS:
                    self._signal(signum)

    def _signal(self, signum: int) -> None:
        """A stop signal (on the reading thread): the first stops the drill, a second exits."""
        self._signals += 1
        if self._signals > 1:
            self.exit_now("interrupted again")
            return
        self.state.interrupt(signum)
        progress(f"interrupted during {self.state.phase}: stopping (Ctrl-C again to exit at once)")
        threading.Thread(target=self._watchdog, name="drill-watchdog", daemon=True).start()
        loop, task = self._loop, self._task
        if self.mode == "cancel" and loop is not None and task is not None:
            try:
                loop.call_soon_threadsafe(task.cancel)
                return
            except RuntimeError:  # the loop closed meanwhile: the main thread decides
                pass
        if self.mode != "note":
            _thread.interrupt_main(NUDGE)

    def _watchdog(self) -> None:
        time.sleep(INTERRUPT_GRACE_S)
        self.exit_now(
            f"still stopping {INTERRUPT_GRACE_S:.0f} s after Ctrl-C (in {self.state.phase})"
        )

    def exit_now(self, why: str) -> None:
        """Kill the nodes, remove namespaces and mounts, exit: nothing is waited for."""
        if not self._exiting.acquire(blocking=False):
            return
        try:
            if self.cluster is not None:
                self.cluster.kill_now()
            for disk in self.disks.values():
                disk.kill_now()
            if self.network is not None:
                self.network.teardown()
            progress(f"{why}: nodes killed, namespaces and mounts removed; exiting")
        finally:
            sys.stderr.flush()
            os._exit(128 + (self.state.signal_number or signal.SIGINT))
