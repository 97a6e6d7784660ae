"""Bounded shutdown of a node process: SIGTERM or SIGINT stops it in any state.

A graceful stop (a leader first hands its leadership to a follower, within
:data:`HAND_OVER_TIMEOUT_S`; then finish in-flight requests, stop the services, close the Raft
log and the store) needs the event loop and the Raft thread to cooperate. A node can be in a state where
they do not: an apply waiting on something that never comes, a catch-up fetch from peers that
are all down, a restore half-way, a tick thread that never returns. Then the graceful path
would wait for ever and the process would outlive every ``kill`` but ``-9``.

:class:`StopSignals` takes the signals away from the main thread before any other thread
exists (they are blocked, and every thread started later inherits the mask) and waits for
them on a thread of its own with ``sigwait``, so a signal is seen whatever the main thread is
doing. The first one starts the graceful stop (the callbacks given) and arms a deadline; if
the process is still there when it passes, it logs what happened and exits at once with
:data:`EXIT_STOP_DEADLINE`. A second signal exits at once as well.

Nothing is lost by the hard exit that a SIGKILL would not lose: the CommitLog, the journal
and the derived files are made to survive a killed process, and a restart aligns them.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger("chronomq.node")

#: How long a graceful stop may take before the process exits anyway (below the 10 s that
#: supervisors such as Docker and ``cluster up`` wait before SIGKILL).
STOP_DEADLINE_S = 8.0
#: Exit status of a stop that did not finish in time (EX_TEMPFAIL: the files are fine).
EXIT_STOP_DEADLINE = 75
#: How long a stopping leader tries to hand its leadership to a follower before it stops
#: anyway (a hand-over under load takes tens of milliseconds; one that cannot happen, all
#: followers down or paused, must leave most of :data:`STOP_DEADLINE_S` to the rest).
HAND_OVER_TIMEOUT_S = 2.0

SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT})


def take_signals(
    handler: Callable[[int, Any], object], signals: frozenset[int] = SIGNALS
) -> dict[int, Any]:
    """Handle ``signals`` with ``handler`` in this (the main) thread, whatever the process
    inherited: started in the background by a non-interactive shell, a process begins with
    SIGINT ignored; started by a supervisor that waits for signals with ``sigwait`` (some CI
    runners do), with them blocked, and then a Ctrl-C stays pending for ever. The handler is
    installed and the signals unblocked; the previous handlers are returned."""
    previous = {sig: signal.signal(sig, handler) for sig in signals}
    signal.pthread_sigmask(signal.SIG_UNBLOCK, signals)
    return previous


def hard_exit(message: str, status: int = EXIT_STOP_DEADLINE) -> None:
    """Log ``message`` and leave now, whatever the other threads are doing."""
    log.critical("%s", message)
    logging.shutdown()
    os._exit(status)


class StopSignals:
    """Own SIGTERM/SIGINT for this process (see the module docstring).

    Construct it on the main thread before any other thread is started.
    """

    def __init__(
        self,
        deadline_s: float = STOP_DEADLINE_S,
        *,
        exit_now: Callable[[str], None] = hard_exit,
    ) -> None:
        self.deadline_s = deadline_s
        self._exit_now = exit_now
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[], object]] = []
        self.received: int | None = None
        signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
        self._thread = threading.Thread(target=self._wait, name="stop-signals", daemon=True)
        self._thread.start()

    def on_stop(self, callback: Callable[[], object]) -> None:
        """Run ``callback`` (on the signal thread) when the stop begins; at once if it has."""
        with self._lock:
            if self.received is None:
                self._callbacks.append(callback)
                return
        callback()

    @property
    def stopping(self) -> bool:
        return self.received is not None

    def _wait(self) -> None:
        while True:
            signum = signal.sigwait(SIGNALS)
            name = signal.Signals(signum).name
            with self._lock:
                first = self.received is None
                self.received = signum
                callbacks = list(self._callbacks) if first else []
                self._callbacks.clear()
            if not first:
                self._exit_now(f"{name} received again while stopping: exiting now")
                return
            log.info(
                "%s received: stopping (the process exits within %.0f s in any case)",
                name,
                self.deadline_s,
            )
            threading.Thread(
                target=self._expire, args=(name,), name="stop-deadline", daemon=True
            ).start()
            for callback in callbacks:
                try:
                    callback()
                except Exception:
                    log.exception("a stop callback failed")

    def _expire(self, name: str) -> None:
        threading.Event().wait(self.deadline_s)
        self._exit_now(
            f"still running {self.deadline_s:.0f} s after {name} (a stuck apply, fetch or "
            "restore): exiting without a graceful stop; the files are left as after a kill "
            "and the next start aligns them"
        )
