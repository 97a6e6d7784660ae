"""How a node runs its leader-only work: the one place that turns a
:class:`~chronomq.raftlog.leadership.TermToken` into running loops.

A stepped driver (the timer's dequeue/enqueue driver, pop revive) is a plain object with four
calls, :class:`Stepped`: ``begin(token)`` when a term's work starts, ``step()`` as long as the
token is current (it answers how long it may sleep; a :class:`Wake` cuts the sleep short),
``failed()`` after a step that raised (the loop retries after :data:`RETRY_S`), and ``end()``
once the term is over (drop what is in flight: the next term plans from committed state).
:class:`SteppedWork` takes such a driver through terms as one piece of
:class:`~chronomq.raftlog.leadership.Work`: the token the owner hands over is taken up at the
next :meth:`SteppedWork.turn`, and a stale one is left (``end()``, the loop counted stopped, the
owner told) before the next is taken up. Whoever holds it turns it: :func:`run_turns` on a
thread of its own, or a test with a fake clock, one turn at a time.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, Protocol

from chronomq.raftlog.leadership import TermToken

log = logging.getLogger(__name__)

#: How long a stepped driver waits before it steps again after a step raised.
RETRY_S: Final = 0.2


class Stepped(Protocol):
    """A leader-only driver made of steps (see the module's text)."""

    def begin(self, token: TermToken) -> None: ...

    def step(self) -> float: ...

    def failed(self) -> None: ...

    def end(self) -> None: ...


@dataclass(frozen=True, slots=True)
class Steps:
    """A :class:`Stepped` driver made of four callables."""

    on_begin: Callable[[TermToken], None]
    on_step: Callable[[], float]
    on_failed: Callable[[], None]
    on_end: Callable[[], None]

    def begin(self, token: TermToken) -> None:
        self.on_begin(token)

    def step(self) -> float:
        return self.on_step()

    def failed(self) -> None:
        self.on_failed()

    def end(self) -> None:
        self.on_end()


class Wake:
    """A wake-up call that any thread may make (a commit, a switch): the driver's sleep ends."""

    def __init__(self) -> None:
        self._event = threading.Event()

    def set(self) -> None:
        self._event.set()

    def wait(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for a wake-up, and consume it."""
        self._event.wait(timeout_s)
        self._event.clear()


class SteppedWork:
    """A :class:`Stepped` driver as one piece of leader-only work, turned by whoever holds it."""

    def __init__(self, work: str, loop: str, driver: Stepped, wake: Wake) -> None:
        self.work = work
        self.loop = loop
        self.driver = driver
        self.wake_up = wake
        self._lock = threading.Lock()
        self._next: TermToken | None = None
        """Handed over by the owner, taken up at the next turn."""
        self._token: TermToken | None = None
        """The term the driver works for (turning thread only)."""
        self._closed = False

    @property
    def name(self) -> str:
        return self.work

    # ------------------------------------------------------------------ the owner's calls

    def start(self, token: TermToken) -> None:
        """The owner starts the work of ``token.term`` (any thread; returns at once)."""
        with self._lock:
            if self._closed:
                stale, refused = None, token
            else:
                stale, self._next, refused = self._next, token, None
        if refused is not None:
            refused.exited(self.work)
        if stale is not None:  # never taken up: the owner ended it before the driver looked
            stale.exited(self.work)
        self.wake_up.set()

    def wake(self) -> None:
        self.wake_up.set()

    # ------------------------------------------------------------------ turning

    def turn(self) -> float:
        """Leave an ended term, take up the one handed over, then one step of the driver;
        how long it may sleep (a wake cuts it short)."""
        self._take()
        return self.driver.step()

    def close(self) -> None:
        """Refuse further terms and leave the current one (after the last turn)."""
        with self._lock:
            self._closed = True
        self.leave()

    def _take(self) -> None:
        token = self._token
        if token is not None and not token.is_current():
            self.leave()
        if self._token is not None:
            return
        with self._lock:
            token, self._next = self._next, None
            closed = self._closed
        if token is None:
            return
        if not token.is_current() or closed:
            token.exited(self.work)
            return
        token.enter_loop(self.work, self.loop)
        self._token = token
        self.driver.begin(token)

    def leave(self) -> None:
        """Stop the driver's leader work (``end()``) and tell the owner."""
        token, self._token = self._token, None
        with self._lock:
            pending, self._next = self._next, None
        if pending is not None:
            pending.exited(self.work)
        if token is None:
            return
        try:
            self.driver.end()
        finally:
            token.exit_loop(self.loop)
            token.exited(self.work)


def run_turns(work: SteppedWork, stop: threading.Event, what: str) -> None:
    """A stepping thread's loop: turn ``work`` until ``stop`` is set, sleeping as long as each
    turn allows (its :class:`Wake` cuts the sleep short); a turn that raises is logged, the
    driver's ``failed()`` resets what it had in flight, and it turns again after
    :data:`RETRY_S`. The term in hand is left on the way out."""
    timeout = 0.0
    try:
        while not stop.is_set():
            work.wake_up.wait(timeout)
            if stop.is_set():
                return
            try:
                timeout = work.turn()
            except Exception:
                log.exception("%s step failed; retrying", what)
                work.driver.failed()
                timeout = RETRY_S
    finally:
        work.close()
