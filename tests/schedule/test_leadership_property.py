"""Randomized leadership churn against the schedule service, in virtual time.

Each run drives one node through random gains and losses of the leadership (lose and regain a
later term, completions that race the loss, outcomes left unknown and committed later), random
switches between sync and async delivery and pauses, while delay-level messages arrive. It
checks, at every step:

- at most one set of level loops runs (never two loops for one level, all of one term, none
  left on a follower), and every running loop task is one the owner counts;
- no loop proposes while the node follows or after its term has ended;

and at the end, once the node has led long enough: every message was delivered exactly once,
never before its due time. A failing run names its seed in the test id; rerun it with
``SEEDS = [seed]``.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import random
from collections import Counter

import pytest

from chronomq.raftlog.leaderloop import LeaderRuntime
from chronomq.raftlog.leadership import Leadership
from chronomq.schedule.levels import DelayLevelTable
from chronomq.schedule.pending import PendingConfig
from chronomq.schedule.service import ScheduleService
from chronomq.schedule.settings import ScheduleSettings
from chronomq.schedule.state import ASYNC, MODE_KEY, PAUSED_KEY, SYNC
from tests.conftest import random_seed
from tests.schedule.fakes import (
    REAL_QUEUES,
    FakeRaftLog,
    FakeStore,
    VirtualClock,
    VirtualLoop,
    run_virtual,
)

FIXED_SEEDS = [1, 2, 3, 4, 5, 6, 7, 8]
SEEDS = [*FIXED_SEEDS, random_seed("leadership_property")]
STEPS = 400
LEVELS = "1s 2s 3s"


def _level_tasks() -> list[asyncio.Task[object]]:
    """Level loop tasks that have started (a suspended ``LevelLoops._run_level`` is inside its
    ``token.loop`` block); one created and not yet stepped has done nothing."""
    return [
        t
        for t in asyncio.all_tasks()
        if getattr(t.get_coro(), "__qualname__", "") == "LevelLoops._run_level"
        and inspect.getcoroutinestate(t.get_coro()) == inspect.CORO_SUSPENDED  # type: ignore[arg-type]
    ]


async def _run(seed: int) -> None:
    rng = random.Random(seed)
    loop = asyncio.get_running_loop()
    assert isinstance(loop, VirtualLoop)
    levels = DelayLevelTable.parse(LEVELS)
    clock = VirtualClock(loop)
    store = FakeStore(levels)
    raft = FakeRaftLog(clock, store)
    owner = Leadership(
        now_ms=clock.monotonic_ms, stop_bound_ms=5_000, call_later=lambda _d, _f: None
    )
    raft.add_leader_listener(owner.on_leader)
    settings = ScheduleSettings(
        levels=levels,
        async_deliver=rng.random() < 0.5,
        pending=PendingConfig(
            max_pending_limit=rng.choice([4, 64]),
            max_resend_num_to_blocked=rng.choice([1, 3]),
        ),
        batch_max_messages=rng.choice([1, 4, 16]),
        scan_max=rng.choice([8, 64]),
        commit_wait_s=2.0,
    )
    runtime = LeaderRuntime(owner)
    service = ScheduleService(raft, settings, runtime=runtime)  # type: ignore[arg-type]

    def check_proposal() -> str | None:
        token = owner._active
        if token is None or not token.is_current() or token.term != raft.term:
            return f"proposed in term {raft.term} while the owner's term is {token!r}"
        return None

    raft.check_proposal = check_proposal
    service.attach()
    serving = loop.create_task(runtime.serve())
    await asyncio.sleep(0)
    runtime.attach()

    ids = itertools.count(1)
    due: dict[str, int] = {}
    following_since: float | None = loop.time()
    terms_led: set[int] = set()
    changed_at = [loop.time()]

    def check_loops() -> None:
        tasks = _level_tasks()
        running = owner.loops()
        assert len(tasks) <= levels.max_level, f"{len(tasks)} level loops running"
        assert len(tasks) == len(running), f"tasks {len(tasks)} vs counted loops {running}"
        assert len(set(running.values())) <= 1, f"loops of several terms: {running}"
        assert owner.violations == 0
        if following_since is not None and loop.time() - following_since > 0.5:
            assert not tasks, "a follower still runs level loops"
            assert service.stats()["loops"]["running"] == 0
        if raft.leading and running and set(running.values()) != {raft.term}:
            # The last term's loops may take a moment to see their token; never long.
            assert owner.stats().stopping, f"loops of {running} run unowned in {raft.term}"
            assert loop.time() - changed_at[0] < 0.5, f"term {running} loops outlive it"
        assert not raft.violations, raft.violations

    async def raft_ticks() -> None:
        # Commits arrive a few ms apart, in batches of random size.
        while True:
            await asyncio.sleep(rng.choice([0.001, 0.004, 0.01, 0.03]))
            if raft.leading and raft.pending:
                raft.commit(rng.randint(1, 4), rng)

    ticking = loop.create_task(raft_ticks())
    last_term = raft.term
    for _ in range(STEPS):
        roll = rng.random()
        if roll < 0.35:
            for _ in range(rng.randint(1, 6)):
                msg_id = next(ids).to_bytes(16, "big")
                level = rng.randint(1, levels.max_level)
                due_ms = store.store_delayed(
                    msg_id, level, rng.randrange(REAL_QUEUES), clock.now_ms()
                )
                due[msg_id.hex().upper()] = due_ms
        elif roll < 0.5:
            if raft.leading:
                raft.lose(rng)
                following_since = loop.time()
            else:
                raft.gain(rng)
                terms_led.add(raft.term)
                following_since = None
        elif roll < 0.55 and raft.leading:
            # A loss and, at once, a later term (the old term's loops may still be stopping).
            raft.lose(rng)
            raft.gain(rng)
            terms_led.add(raft.term)
        elif roll < 0.65:
            store.kv[MODE_KEY] = rng.choice([SYNC, ASYNC])
        elif roll < 0.7:
            store.kv[PAUSED_KEY] = 1 if rng.random() < 0.5 else 0
        if raft.term != last_term:
            last_term, changed_at[0] = raft.term, loop.time()
        await asyncio.sleep(rng.choice([0.0, 0.002, 0.02, 0.1, 0.4]))
        check_loops()

    # Lead for good, unpaused, until everything is due and delivered. The last hand-over
    # leaves commands behind that commit during the final term, among its own.
    if raft.leading:
        raft.lose(rng)
        await asyncio.sleep(rng.choice([0.0, 0.05]))
    raft.gain(rng)
    terms_led.add(raft.term)
    following_since = None
    store.kv[PAUSED_KEY] = 0
    deadline = loop.time() + 60
    while loop.time() < deadline:
        await asyncio.sleep(0.1)
        check_loops()
        if len({d.msg_id for d in store.delivered}) == len(due) and not raft.pending:
            break
    raft.lose(rng)
    following_since = loop.time()
    await asyncio.sleep(1.0)
    check_loops()
    ticking.cancel()
    service.close()
    runtime.close()
    await serving

    counts = Counter(d.msg_id for d in store.delivered)
    assert set(counts) == set(due), f"lost: {sorted(set(due) - set(counts))[:5]}"
    twice = [m for m, n in counts.items() if n > 1]
    assert not twice, f"delivered more than once: {twice[:5]}"
    early = [
        d for d in store.delivered if d.store_ms < due[d.msg_id] or d.applied_ms < due[d.msg_id]
    ]
    assert not early, f"delivered early: {early[:3]}"
    view = owner.stats()
    assert view.running == 0 and view.started_total == view.stopped_total
    # A term superseded before the last one's loops exited is never started.
    assert view.terms_started_total <= len(terms_led)
    assert len(terms_led) >= 10, "too little churn to mean much"
    # A term may end before its loops got going: then they never start.
    assert view.started_total <= levels.max_level * view.terms_started_total


@pytest.mark.parametrize("seed", SEEDS)
def test_leadership_churn_keeps_one_set_of_loops_and_delivers_once(seed: int) -> None:
    run_virtual(_run(seed))  # about 50 s of virtual time
