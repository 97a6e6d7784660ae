"""How a node runs its leader-only work: one ``leader-work`` thread with one asyncio loop, the
one place that turns a :class:`~chronomq.raftlog.leadership.TermToken` into running loops.

:class:`LeaderRuntime` is created next to the node's
:class:`~chronomq.raftlog.leadership.Leadership` and registered with it as its only
:class:`~chronomq.raftlog.leadership.Work`. Each loop is a small module with one shape, a
:class:`LoopSpec` ``(work, name, run)`` where ``run(token, wake)`` works for ``token.term`` and
returns once the token is stale: the schedule's levels (:mod:`chronomq.schedule.level_loop`),
the timer driver (:mod:`chronomq.timer.driver`) and pop revive. For each term the runtime
starts one task per loop, each inside ``token.loop(work, name)``, and tells the owner the
term's work exited once every task is done (a done callback, not a ``finally``: a task
cancelled before its first step never enters its body). When the token goes stale the runtime
sets every loop's ``wake`` event and cancels the term's tasks; cancelling only cuts waits
short, the token is what stops a loop. The shared helpers wait the way every loop must:
:func:`sleep` and :func:`commit` under ``asyncio.timeout`` (``wait_for`` can swallow a cancel).

A stepped driver (the timer's dequeue/enqueue driver, pop revive) is a plain object with four
calls, :class:`Stepped`: ``begin(token)`` when a term's work starts, ``step()`` as long as the
token is current (it answers how long it may sleep; a :class:`Wake` cuts the sleep short),
``failed()`` after a step that raised (it steps again after :data:`RETRY_S`), and ``end()`` once
the term is over (drop what is in flight: the next term plans from committed state).
:class:`SteppedLoop` runs one as a loop of the runtime, its calls on a thread of the driver's
own. :class:`SteppedWork` takes one through terms by hand instead, for tests with a fake
clock: the token the owner hands over is taken up at the next :meth:`SteppedWork.turn`, and a
stale one is left (``end()``, the loop counted stopped, the owner told) before the next.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Final, Protocol, TypeVar

from chronomq.raftlog.leadership import Leadership, Piece, TermToken

log = logging.getLogger(__name__)

T = TypeVar("T")

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
    """A wake-up call that any thread may make (a commit, a switch): the driver's sleep on the
    runtime's loop ends (:meth:`bind`); nothing while no loop of the driver runs."""

    def __init__(self) -> None:
        self._target: tuple[asyncio.AbstractEventLoop, asyncio.Event] | None = None

    def set(self) -> None:
        target = self._target
        if target is not None:
            loop, event = target
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(event.set)

    def bind(self, loop: asyncio.AbstractEventLoop, event: asyncio.Event) -> None:
        """Wake-ups set ``event`` on ``loop`` too, until :meth:`unbind`."""
        self._target = (loop, event)

    def unbind(self) -> None:
        self._target = None


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


# ---------------------------------------------------------------------- the runtime

#: The runtime's name as leader-only work, and its thread's.
WORK: Final = "leader-work"

Run = Callable[[TermToken, asyncio.Event], Awaitable[None]]
"""A loop's body for one term: ``run(token, wake)``; it leaves once ``token`` is stale."""


@dataclass(frozen=True, slots=True)
class LoopSpec:
    """One leader-only loop, run once per term by :class:`LeaderRuntime`."""

    work: str
    """The piece it belongs to (``schedule``, ``timer``, ``pop-revive``): the owner counts
    loops by it."""
    name: str | None
    """The loop's name (``timer driver``), counted while it runs; None for a loop that counts
    the loops it runs itself (the schedule, one per level)."""
    run: Run
    on_wake: Callable[[], None] | None = None
    """Called on the runtime's loop when the term's token went stale (and on close)."""
    on_close: Callable[[], None] | None = None
    """Called once the runtime has stopped (release a thread, say)."""


async def sleep(wake: asyncio.Event, seconds: float) -> None:
    """Wait ``seconds`` or until ``wake`` is set, and consume the wake-up. ``asyncio.timeout``,
    not ``wait_for``: a cancel arriving with the timeout is never swallowed."""
    if seconds > 0 and not wake.is_set():
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await wake.wait()
    wake.clear()


async def commit(fut: Future[T], wait_s: float) -> T:
    """Wait up to ``wait_s`` for a command the Raft thread completes. Not
    ``asyncio.wait_for``: in 3.11 it returns the result of a future that completes as the
    waiter is cancelled, swallowing the cancel; the shield keeps a cancel from cancelling the
    committer's future."""
    async with asyncio.timeout(wait_s):
        return await asyncio.shield(asyncio.wrap_future(fut))


class LeaderRuntime:
    """One node's leader-only loops on one ``leader-work`` thread with one asyncio loop.

    It is the only :class:`~chronomq.raftlog.leadership.Work` registered with the node's
    :class:`~chronomq.raftlog.leadership.Leadership`. ``start(token)`` creates one task per
    :class:`LoopSpec` (each inside ``token.loop(work, name)``); once every task of the term is
    done, a done callback (not a ``finally``: a task cancelled before its first step never
    enters its body) tells the owner the term's work exited. ``wake()`` sets every loop's wake
    event and cancels the stale term's tasks; cancelling only cuts waits short, the token is
    what stops a loop.
    """

    name: Final = WORK

    def __init__(self, leadership: Leadership) -> None:
        self.leadership = leadership
        self._specs: list[LoopSpec] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._registered = False
        self.closing = False
        """Set by :meth:`close`: the loops leave, whatever their token says."""
        self._token: TermToken | None = None
        self._tasks: dict[asyncio.Task[None], asyncio.Event] = {}

    # ------------------------------------------------------------------ life cycle

    def add(self, spec: LoopSpec) -> None:
        """Run ``spec`` for every term from the next one on (or this one, if it runs)."""
        self._specs.append(spec)
        token = self._token
        if token is not None:
            self.call_soon(self._spawn_late, spec, token)

    def start(self) -> None:
        """Start the ``leader-work`` thread and register with the leadership owner."""
        self._thread = threading.Thread(target=self._main, name=WORK, daemon=True)
        self._thread.start()
        self._ready.wait(5)
        self.attach()

    def attach(self) -> None:
        """Register with the leadership owner (once)."""
        if not self._registered:
            self._registered = True
            self.leadership.register(Piece(WORK, self.start_term, self.wake))

    def close(self) -> None:
        """Stop every loop and the thread."""
        self.closing = True
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(stop.set)
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _main(self) -> None:
        asyncio.run(self.serve())

    async def serve(self) -> None:
        """The runtime's loop: runs until :meth:`close` (the thread of :meth:`start` runs it;
        tests run it on their own loop and call :meth:`attach`)."""
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self._ready.set()
        try:
            await self._stop.wait()
        finally:
            self.closing = True
            self._end_term()
            tasks = list(self._tasks)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for spec in self._specs:
                if spec.on_close is not None:
                    try:
                        spec.on_close()
                    except Exception:
                        log.exception("closing leader-only loop %s failed", spec.work)

    def stats(self) -> dict[str, Any]:
        """The running leader-only loops (:meth:`Leadership.stats`)."""
        return self.leadership.stats().as_dict()

    def call_soon(self, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn(*args)`` on the runtime's loop (any thread); nothing if it does not run."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        with contextlib.suppress(RuntimeError):  # closed meanwhile
            loop.call_soon_threadsafe(fn, *args)

    # ------------------------------------------------------------------ the owner's calls

    def start_term(self, token: TermToken) -> None:
        loop = self._loop
        if loop is None or loop.is_closed() or self.closing:
            token.exited(WORK)
            return
        try:
            loop.call_soon_threadsafe(self._spawn, token)
        except RuntimeError:  # closed meanwhile
            token.exited(WORK)

    def wake(self) -> None:
        """The term ended (any thread): every loop looks at its token now."""
        self.call_soon(self._end_term)

    # ------------------------------------------------------------------ on the loop

    def _spawn(self, token: TermToken) -> None:
        if self.closing or not token.is_current() or self._token is not None:
            # The owner starts a term only once the last one exited, so a term still here is
            # a bug: refuse rather than run two sets of loops.
            if self._token is not None:
                log.error(
                    "leader-only loops of term %d not started: term %d still runs",
                    token.term,
                    self._token.term,
                )
            token.exited(WORK)
            return
        self._token = token
        for spec in self._specs:
            self._spawn_one(spec, token)
        if not self._tasks:
            self._token = None
            token.exited(WORK)

    def _spawn_late(self, spec: LoopSpec, token: TermToken) -> None:
        """A loop added while ``token``'s term runs joins it (if its other loops still run)."""
        if self._token is token and self._tasks and token.is_current() and not self.closing:
            self._spawn_one(spec, token)

    def _spawn_one(self, spec: LoopSpec, token: TermToken) -> None:
        wake = asyncio.Event()
        loop = asyncio.get_running_loop()
        task = loop.create_task(self._run(spec, token, wake), name=spec.name or spec.work)
        self._tasks[task] = wake
        task.add_done_callback(lambda t: self._done(t, spec, token))

    @staticmethod
    async def _run(spec: LoopSpec, token: TermToken, wake: asyncio.Event) -> None:
        if spec.name is None:
            await spec.run(token, wake)
            return
        with token.loop(spec.work, spec.name):
            await spec.run(token, wake)

    def _done(self, task: asyncio.Task[None], spec: LoopSpec, token: TermToken) -> None:
        self._tasks.pop(task, None)
        if not task.cancelled() and task.exception() is not None:
            log.error(
                "leader-only loop %s ended in term %d: %r",
                spec.name or spec.work,
                token.term,
                task.exception(),
            )
        if not self._tasks and self._token is token:
            self._token = None
            token.exited(WORK)

    def _end_term(self) -> None:
        for wake in self._tasks.values():
            wake.set()
        for spec in self._specs:
            if spec.on_wake is not None:
                spec.on_wake()
        token = self._token
        if token is not None and (self.closing or not token.is_current()):
            for task in self._tasks:
                task.cancel()


class SteppedLoop:
    """A :class:`Stepped` driver as a loop of the :class:`LeaderRuntime`: ``begin(token)``,
    then ``step()`` while the token is current, sleeping as long as each step allows (its
    :class:`Wake` cuts the sleep short), then ``end()``. A step that raises is logged, the
    driver's ``failed()`` resets what it had in flight, and it steps again after
    :data:`RETRY_S`. Every call runs on a thread of the driver's own, one at a time, in order:
    planning reads files and must not stall the other loops, and the next term's ``begin``
    never overtakes the last term's ``end``."""

    def __init__(self, work: str, name: str, driver: Stepped, wake: Wake, what: str) -> None:
        self.work = work
        self.name = name
        self.driver = driver
        self.wake_up = wake
        self.what = what
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"{WORK}-{work}")
        self.running = False
        """True while a term's loop runs."""

    def spec(self) -> LoopSpec:
        return LoopSpec(self.work, self.name, self.run, on_close=self.close)

    def close(self) -> None:
        self._executor.shutdown(wait=False)

    async def run(self, token: TermToken, wake: asyncio.Event) -> None:
        loop = asyncio.get_running_loop()
        self.wake_up.bind(loop, wake)
        self.running = True
        try:
            timeout = await self._call(loop, functools.partial(self.driver.begin, token))
            while token.is_current():
                await sleep(wake, timeout)
                if not token.is_current():
                    break
                timeout = await self._call(loop, self.driver.step)
        finally:
            self.running = False
            self.wake_up.unbind()
            # Shielded: the driver leaves its term even if this loop is cancelled again.
            await asyncio.shield(loop.run_in_executor(self._executor, self.driver.end))

    async def _call(self, loop: asyncio.AbstractEventLoop, fn: Callable[[], float | None]) -> float:
        try:
            timeout = await loop.run_in_executor(self._executor, fn)
        except Exception:
            log.exception("%s step failed; retrying", self.what)
            await loop.run_in_executor(self._executor, self.driver.failed)
            return RETRY_S
        return 0.0 if timeout is None else timeout
