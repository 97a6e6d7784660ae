"""The schedule's leader-only loop: for the term it runs in, check the level offsets, then run
one delivery loop per level until the term is over.

It is one :class:`~chronomq.raftlog.leaderloop.LoopSpec` of the node's
:class:`~chronomq.raftlog.leaderloop.LeaderRuntime` (``run(token, wake)``); each level's loop
is counted by the leadership owner as ``schedule level N``. A loop checks its token after every
await (a commit, a sleep) and before every proposal, and leaves as soon as the term is over,
whatever the await answered; the runtime's cancel at the end of a term only cuts waits short.
Mode switches and pauses happen inside each level's loop and never start another. The delivery
itself is :mod:`chronomq.schedule.sync_delivery` and :mod:`chronomq.schedule.async_delivery`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Final

from chronomq.raftlog.leaderloop import LoopSpec
from chronomq.raftlog.leadership import TermToken
from chronomq.raftlog.store import OK
from chronomq.schedule.async_delivery import AsyncDelivery
from chronomq.schedule.delivery import LevelContext, LevelState, TermOver
from chronomq.schedule.levels import SCHEDULE_TOPIC
from chronomq.schedule.planner import correct_offset
from chronomq.schedule.state import ASYNC, offset_key
from chronomq.schedule.sync_delivery import SyncDelivery

# The schedule service's lines, as before its parts had modules of their own.
log = logging.getLogger("chronomq.schedule.service")

#: The schedule's name as leader-only work.
WORK: Final = "schedule"

OnEvent = Callable[..., None]
"""``on_event(type, **detail)`` for service start and stop."""


class LevelLoops:
    """The schedule's loops for one term at a time, and whether they run."""

    def __init__(
        self,
        ctx: LevelContext,
        states: dict[int, LevelState],
        *,
        on_event: OnEvent | None = None,
        closing: Callable[[], bool] = lambda: False,
    ) -> None:
        self.ctx = ctx
        self.settings = ctx.settings
        self.levels = ctx.levels
        self.states = states
        self.on_event = on_event
        self._closing = closing
        self._sync = SyncDelivery(ctx)
        self._async = AsyncDelivery(ctx)
        self.running = False
        """True while the delivery loops run (this node leads)."""
        self.token: TermToken | None = None
        """The term the loops run for (None while they do not run)."""

    def spec(self) -> LoopSpec:
        """The loops as one loop of the leader runtime (they count their levels themselves)."""
        return LoopSpec(WORK, None, self.lead, on_wake=self.wake_all)

    def wake_all(self) -> None:
        """Every level looks at its token and the controls now (the runtime's loop)."""
        for st in self.states.values():
            st.wake.set()

    def _live(self, token: TermToken) -> bool:
        return self.ctx.live(token)

    # ------------------------------------------------------------------ one term

    async def lead(self, token: TermToken, _wake: asyncio.Event) -> None:
        """Run the level loops for ``token.term``; returns once every one of them has."""
        self.token = token
        try:
            await self._lead(token)
        finally:
            was_running = self.running
            self.token = None
            if was_running:
                self._stopped(
                    "service closed" if self._closing() else f"leadership lost in term {token.term}"
                )

    async def _lead(self, token: TermToken) -> None:
        term = token.term
        while self._live(token):
            try:
                await self._prepare_offsets(token)
                break
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if not self._live(token):
                    return
                log.warning(
                    "schedule service could not check its offsets in term %d: %s; retrying in 1 s",
                    term,
                    exc,
                )
                await asyncio.sleep(1.0)
        if not self._live(token):
            return
        self.running = True
        log.info(
            "schedule service running in term %d: %d levels, mode %s",
            term,
            self.levels.max_level,
            self.ctx.mode,
        )
        if self.on_event is not None:
            self.on_event("service_start", service="schedule", term=term, mode=self.ctx.mode)
        # return_exceptions: the term's work has exited only once every level loop has.
        results = await asyncio.gather(
            *(self._run_level(st, token) for st in self.states.values()), return_exceptions=True
        )
        for st, result in zip(self.states.values(), results, strict=True):
            if isinstance(result, BaseException) and not isinstance(result, asyncio.CancelledError):
                log.error("schedule level %d loop ended in term %d: %r", st.level, term, result)

    def _stopped(self, why: str) -> None:
        self.running = False
        for st in self.states.values():
            st.pending = None
            st.inflight_batches = 0
            st.advance_inflight = False
            st.blocked_at = None
        log.info("schedule service stopped: %s", why)
        if self.on_event is not None:
            self.on_event("service_stop", service="schedule", reason=why)

    async def _prepare_offsets(self, token: TermToken) -> None:
        """Create missing level offsets; move any outside its queue's range back inside it.

        There is no retention yet, so a queue's minimum is 0; the maximum is the queue's length.
        """
        raftlog = self.ctx.raftlog
        kv = raftlog.store.kv
        expect: dict[str, int | str | None] = {}
        updates: dict[str, int | str | None] = {}
        for lv in self.levels.levels():
            key = offset_key(lv)
            have = kv.get(key)
            high = raftlog.store.max_offset(SCHEDULE_TOPIC, self.levels.queue_id(lv))
            if not isinstance(have, int):
                expect[key], updates[key] = have, 0
                continue
            fix = correct_offset(lv, have, 0, high)
            if fix.corrected:
                log.warning("%s", fix.describe())
                expect[key], updates[key] = have, fix.offset
        if updates and self._live(token):
            outcome = await self.ctx.commit(raftlog.update(updates, expect=expect))
            if outcome.status != OK:
                raise RuntimeError(f"offset update refused: {outcome.detail}")

    # ------------------------------------------------------------------ one level

    async def _run_level(self, st: LevelState, token: TermToken) -> None:
        with token.loop(WORK, f"schedule level {st.level}"):
            st.token = token
            try:
                await self._level_loop(st, token)
            finally:
                st.token = None

    async def _level_loop(self, st: LevelState, token: TermToken) -> None:
        while self._live(token):
            if self.ctx.paused:
                await self.ctx.sleep(st, self.settings.poll_ms / 1000)
                continue
            try:
                if self.ctx.mode == ASYNC:
                    await self._async.session(st, token)
                else:
                    wait_s = await self._sync.run_pass(st, token)
                    await self.ctx.sleep(st, wait_s)
            except asyncio.CancelledError:
                raise
            except TermOver:
                return
            except Exception as exc:  # never let one level's bug stop the others
                if not self._live(token):
                    return
                st.last_error = str(exc)
                log.exception("schedule level %d failed; retrying in 1 s", st.level)
                await self.ctx.sleep(st, 1.0)
