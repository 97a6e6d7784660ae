"""The owner of leader-only work (:mod:`chronomq.raftlog.leadership`): one term's work at a time."""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest

from chronomq.raftlog.leadership import Leadership, LeadershipError, Piece, TermToken


class FakeWork:
    """Records what the owner asks; exits only when the test says so (or at once)."""

    def __init__(self, name: str, log: list[str], *, exit_on_wake: bool = False) -> None:
        self.name = name
        self.log = log
        self.exit_on_wake = exit_on_wake
        self.tokens: list[TermToken] = []
        self.fail_start = False

    def start(self, token: TermToken) -> None:
        self.log.append(f"start {self.name} {token.term}")
        if self.fail_start:
            raise RuntimeError("cannot start")
        self.tokens.append(token)

    def wake(self) -> None:
        self.log.append(f"wake {self.name}")
        if self.exit_on_wake:
            self.exit()

    def exit(self) -> None:
        token = self.tokens[-1]
        self.log.append(f"exit {self.name} {token.term}")
        token.exited(self.name)

    @property
    def token(self) -> TermToken:
        return self.tokens[-1]


class Timers:
    """A fake ``call_later``: the test fires the pending callbacks."""

    def __init__(self) -> None:
        self.pending: list[tuple[float, Callable[[], None]]] = []

    def __call__(self, delay_s: float, fn: Callable[[], None]) -> None:
        self.pending.append((delay_s, fn))

    def fire(self) -> None:
        pending, self.pending = self.pending, []
        for _delay, fn in pending:
            fn()


class Clock:
    def __init__(self) -> None:
        self.ms = 0.0

    def __call__(self) -> float:
        return self.ms


def owner_with(
    *names: str, stop_bound_ms: int = 1000
) -> tuple[Leadership, list[FakeWork], list[str], Timers, Clock]:
    log: list[str] = []
    clock = Clock()
    timers = Timers()
    owner = Leadership(now_ms=clock, stop_bound_ms=stop_bound_ms, call_later=timers)
    works = [FakeWork(n, log) for n in names]
    for w in works:
        owner.register(w)
    return owner, works, log, timers, clock


def test_a_confirmed_term_starts_every_piece_with_its_token() -> None:
    owner, (a, b), log, _, _ = owner_with("a", "b")
    assert log == []
    owner.on_leader(True, 3)
    assert log == ["start a 3", "start b 3"]
    assert a.token.term == 3 and a.token.is_current() and a.token is b.token
    assert owner.term == 3
    owner.on_leader(True, 3)  # the same confirmation again changes nothing
    assert log == ["start a 3", "start b 3"]


def test_the_next_term_starts_only_after_every_piece_of_the_last_exited() -> None:
    owner, (a, b), log, _, _ = owner_with("a", "b")
    owner.on_leader(True, 3)
    log.clear()
    owner.on_leader(False, 3)
    assert not a.token.is_current()
    assert log == ["wake a", "wake b"]
    owner.on_leader(True, 5)  # a later term, while term 3's work still runs
    assert log == ["wake a", "wake b"]
    assert owner.stats().stopping
    a.exit()
    assert "start a 5" not in log
    b.exit()
    assert log[-2:] == ["start a 5", "start b 5"]
    assert a.token.term == 5 and a.token.is_current()
    assert owner.stats().terms_started_total == 2


def test_a_different_term_without_a_loss_stops_the_old_work_first() -> None:
    owner, (a,), log, _, _ = owner_with("a")
    owner.on_leader(True, 3)
    old = a.token
    owner.on_leader(True, 4)
    assert not old.is_current()
    assert log == ["start a 3", "wake a"]
    a.exit()
    assert log[-1] == "start a 4"


def test_a_late_loss_of_an_older_term_is_ignored() -> None:
    owner, (a,), log, _, _ = owner_with("a")
    owner.on_leader(True, 3)
    owner.on_leader(True, 4)
    a.exit()
    assert a.token.term == 4
    owner.on_leader(False, 3)
    assert a.token.is_current()


def test_the_same_term_confirmed_again_after_a_lapsed_lease_gets_a_new_token() -> None:
    owner, (a,), log, _, _ = owner_with("a")
    owner.on_leader(True, 3)
    first = a.token
    owner.on_leader(False, 3)
    owner.on_leader(True, 3)
    assert log == ["start a 3", "wake a"]
    a.exit()
    assert log[-1] == "start a 3"
    assert a.token is not first and a.token.is_current() and not first.is_current()


def test_an_exit_of_a_stale_token_does_not_count_for_the_active_one() -> None:
    owner, (a, b), log, _, _ = owner_with("a", "b")
    owner.on_leader(True, 3)
    stale = a.token
    owner.on_leader(False, 3)
    a.exit()
    b.exit()
    owner.on_leader(True, 4)
    stale.exited("a")  # a duplicate report from the old term
    owner.on_leader(False, 4)
    b.exit()
    owner.on_leader(True, 5)
    assert log[-1] != "start a 5", "term 5 must wait for a's exit from term 4"
    a.exit()
    assert log[-2:] == ["start a 5", "start b 5"]


def test_a_piece_that_does_not_stop_within_the_bound_is_reported(
    caplog: pytest.LogCaptureFixture,
) -> None:
    owner, (a, b), log, timers, clock = owner_with("a", "b", stop_bound_ms=1000)
    owner.on_leader(True, 3)
    with a.token.loop("a", "a loop"):
        owner.on_leader(False, 3)
        b.exit()
        owner.on_leader(True, 4)
        assert [d for d, _ in timers.pending] == [1.0]
        clock.ms = 500
        timers.fire()  # fired early (a timer may): not reported yet
        assert owner.stats().stuck == ()
        clock.ms = 1000
        with caplog.at_level(logging.ERROR, logger="chronomq.raftlog.leadership"):
            owner.check_stuck()
            owner.check_stuck()  # reported once
        errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert len(errors) == 1
        assert "term 3" in errors[0] and "a still running" in errors[0] and "a loop" in errors[0]
        view = owner.stats()
        assert view.stuck == ("a",) and view.stopping and view.running == 1
        assert "start a 4" not in log, "never two sets of work: term 4 waits"
    a.exit()
    assert log[-2:] == ["start a 4", "start b 4"]
    assert owner.stats().stuck == ()


def test_loops_are_counted_and_a_second_loop_of_one_name_is_refused() -> None:
    owner, (a, b), _, _, _ = owner_with("a", "b")
    owner.on_leader(True, 7)
    token = a.token
    view = owner.stats()
    assert (view.running, view.term, view.started_total, view.stopped_total) == (0, 7, 0, 0)
    with token.loop("a", "a level 1"), token.loop("a", "a level 2"):
        token.enter_loop("b", "b driver")
        view = owner.stats()
        assert view.running == 3 and view.by_work == {"a": 2, "b": 1} and view.term == 7
        with pytest.raises(LeadershipError, match="already runs"), token.loop("a", "a level 1"):
            pass
        assert owner.violations == 1
        token.exit_loop("b driver")
    view = owner.stats()
    assert (view.running, view.started_total, view.stopped_total) == (0, 3, 3)
    # A loop of the old term still running refuses the same loop in the next term.
    with token.loop("a", "a level 1"):
        owner.on_leader(True, 8)
        a.exit()
        b.exit()
        with pytest.raises(LeadershipError), a.token.loop("a", "a level 1"):
            pass
    assert owner.stats().as_dict()["running"] == 0


def test_a_piece_registered_while_a_term_runs_starts_at_once() -> None:
    owner, (a,), log, _, _ = owner_with("a")
    owner.on_leader(True, 2)
    late = FakeWork("late", log)
    owner.register(late)
    assert log[-1] == "start late 2" and late.token is a.token
    with pytest.raises(LeadershipError, match="twice"):
        owner.register(FakeWork("late", log))


def test_a_piece_whose_start_fails_counts_as_exited(caplog: pytest.LogCaptureFixture) -> None:
    owner, (a, b), log, _, _ = owner_with("a", "b")
    a.fail_start = True
    with caplog.at_level(logging.ERROR, logger="chronomq.raftlog.leadership"):
        owner.on_leader(True, 2)
    assert "starting leader-only work a for term 2 failed" in caplog.text
    owner.on_leader(False, 2)
    b.exit()
    a.fail_start = False
    owner.on_leader(True, 3)
    assert log[-2:] == ["start a 3", "start b 3"]


def test_a_piece_exiting_from_inside_wake_lets_the_next_term_start() -> None:
    log: list[str] = []
    owner = Leadership(now_ms=lambda: 0.0, call_later=lambda _d, _f: None)
    seen: list[TermToken] = []
    owner.register(Piece("p", seen.append, lambda: seen[-1].exited("p")))
    owner.on_leader(True, 1)
    owner.on_leader(True, 2)
    assert [t.term for t in seen] == [1, 2]
    assert not seen[0].is_current() and seen[1].is_current()
    assert log == []
