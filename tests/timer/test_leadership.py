"""The timer driver as leader-only work: it runs for the term the owner hands it, leaves an
ended term (dropping what it had in flight) before the next one starts, and never proposes
for a term that is over."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from chronomq.timer.driver import DRIVER_LOOP
from tests.conftest import random_seed
from tests.timer.fakes import Group
from tests.timer.test_service import check_delivered, check_replicas_equal, config


@pytest.fixture
def group(tmp_path: Path) -> Iterator[Group]:
    g = Group(tmp_path, config(), max_inflight=4)
    g.elect(0)
    g.step_leader()
    g.commit()
    yield g
    g.close()


def test_a_lost_term_stops_the_driver_before_the_next_term_starts(group: Group) -> None:
    g = group
    s0 = g.services[0]
    term = g.term
    assert s0.leadership.loops() == {DRIVER_LOOP: term}
    assert s0.stats()["active"] is False  # no driver thread in this harness
    for i in range(6):
        g.produce("t", g.clock.now_ms() + 50 * i)
    g.commit()
    g.clock.advance(400)
    g.step_leader()
    assert s0.driver.inflight, "commands in flight when the leadership goes"
    g.elect(1)  # node 0 loses; its token is stale at once
    before = len(g.pending)
    s0.step()
    assert len(g.pending) == before, "no proposal after the term ended"
    assert not s0.driver.inflight and s0.driver.leader_since_ms is None
    assert s0.leadership.loops() == {}
    view = s0.leadership.stats()
    assert (view.running, view.started_total, view.stopped_total) == (0, 1, 1)
    # Node 1 leads; node 0 regains a later term without having stepped in between.
    g.step_leader()
    g.commit()
    g.elect(0)
    assert s0.leadership.loops() == {}, "the new term starts only when the driver looks"
    g.step_leader()
    assert s0.leadership.loops() == {DRIVER_LOOP: g.term}
    assert s0.driver.leader_since_ms is not None


def test_a_regained_term_after_a_step_left_unstepped_does_not_stall(group: Group) -> None:
    g = group
    s0 = g.services[0]
    # Lose and regain twice without a step: the owner waits for the driver each time.
    g.elect(1)
    g.elect(0)
    g.elect(2)
    g.elect(0)
    g.step_leader()
    assert s0.leadership.loops() == {DRIVER_LOOP: g.term}
    assert s0.leadership.stats().terms_started_total == 2


@pytest.mark.parametrize("seed", [21, 22, random_seed("timer_leadership")])
def test_churn_delivers_every_message_once(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    g = Group(tmp_path, config(), max_inflight=4)
    try:
        g.elect(0)
        due: dict[str, int] = {}
        end = g.clock.now_ms() + 6_000
        while g.clock.now_ms() < end:
            for _ in range(rng.choice([0, 2, 5])):
                t = g.clock.now_ms() + rng.randint(0, 2_000)
                due[g.produce("t", t)] = t
            g.clock.advance(rng.randint(1, 40))
            # Every replica steps, so a former leader's driver would show if it proposed.
            for s in g.services:
                s.step()
            running = [s.leadership.loops() for s in g.services]
            assert all(len(r) <= 1 for r in running)
            live = [r for r in running if r and list(r.values()) == [g.term]]
            assert len(live) <= 1, running
            old = [i for i, r in enumerate(running) if r and list(r.values()) != [g.term]]
            assert not old, f"seed={seed}: a driver of an ended term still runs: {running}"
            if rng.random() < 0.6:
                g.commit(rng.randint(0, len(g.pending)))
            if rng.random() < 0.05:
                g.commit(rng.randint(0, len(g.pending)))
                g.elect(rng.randrange(3))
        g.run(end + 4_000)
        assert {m.msg_id_hex for m in g.delivered("t")} <= set(due)
        committed = _committed(g)
        check_delivered(g, {k: v for k, v in due.items() if k in committed})
        check_replicas_equal(g)
    finally:
        g.close()


def _committed(g: Group) -> set[str]:
    from chronomq.timer import message as tm

    store = g.logs[0].store
    return {m.msg_id_hex for m in store.read_messages(tm.TIMER_TOPIC, tm.TIMER_QUEUE, 0, 10**6)}
