"""One owner for the leader-only work of a node: started for a confirmed term, stopped before
the next one starts.

:class:`chronomq.raftlog.node.RaftLog` reports leadership as ``listener(is_leader, term)`` (confirmed
by a barrier committed in ``term``; lost on a term change or a lapsed lease). The work that
runs only on the leader (the schedule service's level loops, the timer's dequeue/enqueue driver,
pop revive) runs on the node's :class:`chronomq.raftlog.leaderloop.LeaderRuntime`, the one
:class:`Work` registered with its :class:`Leadership`, instead of listening itself. The owner
then keeps one rule:

    the work of term ``T`` starts only after every piece of the work of the term before it has
    reported that it exited.

For each confirmed term it hands every piece a :class:`TermToken`. A piece checks
:meth:`TermToken.is_current` after every wait (a commit, a sleep) and before every proposal,
and leaves as soon as the token is stale: a loop of an ended term exits instead of retrying.
Cancellation may be used to cut a wait short, but it is never what stops a loop: in Python 3.11
``asyncio.wait_for`` can swallow a cancel when the awaited future completes at the same moment,
and a loop that only relied on the cancel went on running without an owner.

Each long-running loop enters :meth:`TermToken.loop` with its piece and name for as long as it runs; the
owner counts them (``GET /v1/admin/schedule``, ``/metrics``) and refuses a second loop of the
same name while one runs, whatever its term. A piece that has not exited within
``stop_bound_ms`` of its stop is reported (an ERROR line naming it and ``stuck`` in
:meth:`Leadership.stats`), and the next term still waits for it: two sets of loops never run.

A piece plugs in with three calls: ``start(token)`` (non-blocking: hand the token to the
piece's own loop), ``wake()`` (non-blocking: the token just went stale, look at it now) and,
from the piece, :meth:`TermToken.exited` once all its loops returned. The runtime is such a
piece; so is a stepped driver turned by hand in a test
(:class:`chronomq.raftlog.leaderloop.SteppedWork`).

The owner does no I/O and reads no clock of its own: ``now_ms`` is the caller's (the node's
clock) and the stop bound is checked by a timer the caller provides (a thread timer by
default, a fake in tests).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Final, Protocol

log = logging.getLogger(__name__)

#: How long a piece may take to exit after its term ended before it is reported as stuck.
DEFAULT_STOP_BOUND_MS: Final = 10_000
#: Most loops one term may run (schedule levels are capped far below this).
MAX_LOOPS: Final = 4096


class LeadershipError(RuntimeError):
    """A loop broke the one-owner rule (a second loop of a name, too many loops)."""


class Work(Protocol):
    """A piece of leader-only work."""

    @property
    def name(self) -> str: ...

    def start(self, token: TermToken) -> None:
        """Begin the work of ``token.term``; must not block. Call ``token.exited(name)`` when
        done (also when the token is already stale)."""

    def wake(self) -> None:
        """The current token went stale: look at it now. Must not block."""


@dataclass(frozen=True, slots=True)
class Piece:
    """A :class:`Work` made of two callables (what a service registers)."""

    name: str
    on_start: Callable[[TermToken], None]
    on_wake: Callable[[], None]

    def start(self, token: TermToken) -> None:
        self.on_start(token)

    def wake(self) -> None:
        self.on_wake()


@dataclass(frozen=True, slots=True)
class LoopsView:
    """A snapshot of the running leader-only loops, for the admin view and metrics."""

    term: int | None
    """The term the running work belongs to (None when nothing runs)."""
    running: int
    by_work: dict[str, int]
    started_total: int
    stopped_total: int
    terms_started_total: int
    stopping: bool
    """The term's work was told to stop and has not exited yet."""
    stuck: tuple[str, ...]
    """Pieces that did not exit within the stop bound."""

    def as_dict(self) -> dict[str, Any]:
        return {
            "term": self.term,
            "running": self.running,
            "by_work": dict(self.by_work),
            "started": self.started_total,
            "stopped": self.stopped_total,
            "terms_started": self.terms_started_total,
            "stopping": self.stopping,
            "stuck": list(self.stuck),
        }


class TermToken:
    """What one piece of work holds for one term. Thread-safe."""

    __slots__ = ("term", "_owner", "_ended")

    def __init__(self, owner: Leadership, term: int) -> None:
        self.term = term
        self._owner = owner
        self._ended = threading.Event()

    def __repr__(self) -> str:
        return f"TermToken(term={self.term}, current={self.is_current()})"

    def is_current(self) -> bool:
        """True until the owner ends this term (leadership lost, or another term confirmed)."""
        return not self._ended.is_set()

    @contextlib.contextmanager
    def loop(self, work: str, name: str) -> Iterator[None]:
        """Count a running loop of piece ``work`` named ``name`` (``schedule level 3``) while
        in the block.

        Raises :class:`LeadershipError` if a loop of that name already runs, in any term.
        """
        self.enter_loop(work, name)
        try:
            yield
        finally:
            self.exit_loop(name)

    def enter_loop(self, work: str, name: str) -> None:
        """:meth:`loop` for a loop that is not one block (a thread stepping a driver)."""
        self._owner.loop_entered(self, work, name)

    def exit_loop(self, name: str) -> None:
        self._owner.loop_exited(self, name)

    def exited(self, work: str) -> None:
        """The piece ``work`` has finished everything it ran for this term."""
        self._owner.exited(self, work)

    def end(self) -> None:
        self._ended.set()


CallLater = Callable[[float, Callable[[], None]], None]


def _thread_timer(delay_s: float, fn: Callable[[], None]) -> None:
    timer = threading.Timer(delay_s, fn)
    timer.daemon = True
    timer.start()


class Leadership:
    """Starts the registered :class:`Work` for each confirmed term, one term at a time.

    Feed it with :meth:`on_leader` (a :meth:`chronomq.raftlog.node.RaftLog.add_leader_listener`
    listener). Every method may be called from any thread; the pieces' ``start`` and ``wake``
    run outside the owner's lock.
    """

    def __init__(
        self,
        *,
        now_ms: Callable[[], float],
        stop_bound_ms: int = DEFAULT_STOP_BOUND_MS,
        call_later: CallLater = _thread_timer,
    ) -> None:
        self._now_ms = now_ms
        self.stop_bound_ms = stop_bound_ms
        self._call_later = call_later
        self._lock = threading.Lock()
        self._works: dict[str, Work] = {}
        self._desired: int | None = None
        """The confirmed term this node leads, or None."""
        self._active: TermToken | None = None
        """The token whose work was started (possibly ended and still stopping)."""
        self._waiting: set[str] = set()
        """Pieces of the active token that have not exited."""
        self._stop_asked_ms: float | None = None
        self._stuck: tuple[str, ...] = ()
        self._loops: dict[str, int] = {}
        """Running loops: name -> term."""
        self._loop_work: dict[str, str] = {}
        self._started_total = 0
        self._stopped_total = 0
        self._terms_started = 0
        self.violations = 0
        """Loops refused for breaking the one-owner rule (a bug if ever above 0)."""

    # ------------------------------------------------------------------ registration

    def register(self, work: Work) -> None:
        """Add a piece. If a term is running it starts at once for that term."""
        with self._lock:
            if work.name in self._works:
                raise LeadershipError(f"leader-only work {work.name!r} is registered twice")
            self._works[work.name] = work
            token = self._active
            if token is None or not token.is_current():
                return
            self._waiting.add(work.name)
        self._start(work, token)

    # ------------------------------------------------------------------ events

    def on_leader(self, is_leader: bool, term: int) -> None:
        """The leadership listener: ``is_leader`` confirmed in ``term``, or lost."""
        with self._lock:
            if is_leader:
                self._desired = term
            elif self._desired is None or self._desired <= term:
                # A loss names the term lost; an older loss arriving late changes nothing.
                self._desired = None
        self._advance()

    def exited(self, token: TermToken, work: str) -> None:
        with self._lock:
            if token is not self._active:
                return
            self._waiting.discard(work)
        self._advance()

    def check_stuck(self) -> None:
        """Report pieces that have not exited within the stop bound (the timer calls this)."""
        with self._lock:
            token, asked = self._active, self._stop_asked_ms
            if token is None or asked is None or not self._waiting:
                return
            if self._now_ms() - asked < self.stop_bound_ms:
                return
            stuck = tuple(sorted(self._waiting))
            if stuck == self._stuck:
                return
            self._stuck = stuck
            loops = sorted(n for n, t in self._loops.items() if t == token.term)
        log.error(
            "leader-only work of term %d did not stop within %d ms: %s still running "
            "(loops: %s); the next term's work waits for it",
            token.term,
            self.stop_bound_ms,
            ", ".join(stuck),
            ", ".join(loops) or "none",
        )

    def _advance(self) -> None:
        """Move towards the desired term: end the active one, then start the next."""
        to_wake: list[Work] = []
        to_start: list[Work] = []
        with self._lock:
            token = self._active
            # An ended token of the desired term (the lease lapsed and the same term was
            # confirmed again) is replaced as well: a stopped piece never resumes its token.
            if token is not None and (token.term != self._desired or not token.is_current()):
                if token.is_current():
                    token.end()
                    self._stop_asked_ms = self._now_ms()
                    to_wake = [self._works[n] for n in sorted(self._waiting)]
                    bound_s = self.stop_bound_ms / 1000
                    self._call_later(bound_s, self.check_stuck)
                if not self._waiting:
                    if self._stuck:
                        log.warning("leader-only work of term %d has stopped at last", token.term)
                    self._active = None
                    self._stop_asked_ms = None
                    self._stuck = ()
                    token = None
            if token is None and self._desired is not None:
                token = TermToken(self, self._desired)
                self._active = token
                self._waiting = set(self._works)
                self._terms_started += 1
                to_start = [self._works[n] for n in sorted(self._works)]
            start_token = token
        for work in to_wake:
            try:
                work.wake()
            except Exception:
                log.exception("waking leader-only work %s failed", work.name)
        if to_start and start_token is not None:
            log.info(
                "leader-only work starting for term %d: %s",
                start_token.term,
                ", ".join(w.name for w in to_start),
            )
            for work in to_start:
                self._start(work, start_token)

    def _start(self, work: Work, token: TermToken) -> None:
        try:
            work.start(token)
        except Exception:
            log.exception("starting leader-only work %s for term %d failed", work.name, token.term)
            self.exited(token, work.name)

    # ------------------------------------------------------------------ loops

    def loop_entered(self, token: TermToken, work: str, name: str) -> None:
        with self._lock:
            other = self._loops.get(name)
            if other is not None or len(self._loops) >= MAX_LOOPS:
                self.violations += 1
                why = (
                    f"loop {name!r} already runs for term {other}"
                    if other is not None
                    else f"more than {MAX_LOOPS} loops"
                )
                raise LeadershipError(f"refusing to start {name!r} for term {token.term}: {why}")
            self._loops[name] = token.term
            self._loop_work[name] = work
            self._started_total += 1

    def loop_exited(self, token: TermToken, name: str) -> None:
        with self._lock:
            if self._loops.get(name) == token.term:
                del self._loops[name]
                self._loop_work.pop(name, None)
                self._stopped_total += 1

    # ------------------------------------------------------------------ figures

    @property
    def term(self) -> int | None:
        """The term whose work runs now and is current (None while following or stopping)."""
        token = self._active
        return token.term if token is not None and token.is_current() else None

    def loops(self) -> dict[str, int]:
        """Running loops: name -> term."""
        with self._lock:
            return dict(self._loops)

    def stats(self) -> LoopsView:
        with self._lock:
            token = self._active
            by_work: dict[str, int] = {}
            for name in self._loops:
                kind = self._loop_work.get(name, name)
                by_work[kind] = by_work.get(kind, 0) + 1
            terms = set(self._loops.values())
            return LoopsView(
                term=max(terms) if terms else (token.term if token is not None else None),
                running=len(self._loops),
                by_work=by_work,
                started_total=self._started_total,
                stopped_total=self._stopped_total,
                terms_started_total=self._terms_started,
                stopping=token is not None and not token.is_current(),
                stuck=self._stuck,
            )
