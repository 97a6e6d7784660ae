"""TickWatch: which ticks count as slow, what their report says, and how often it comes."""

from __future__ import annotations

from chronomq.raftlog.ticks import TickWatch


class FakeClock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


def _tick(
    watch: TickWatch,
    clock: FakeClock,
    *,
    apply_s: float = 0.0,
    rest_s: float = 0.0,
    snapshot_s: float = 0.0,
    applied: int = 1,
) -> None:
    watch.begin()
    for _ in range(applied):
        watch.applied(apply_s / applied)
    watch.snapshotted(snapshot_s)
    clock.now += apply_s + snapshot_s + rest_s


def test_fast_ticks_are_counted_not_reported() -> None:
    clock = FakeClock()
    watch = TickWatch(150, clock=clock)
    for _ in range(3):
        _tick(watch, clock, apply_s=0.01)
        assert watch.end() is None
    assert (watch.ticks, watch.slow_ticks) == (3, 0)
    assert 9 < watch.max_ms < 11


def test_the_first_slow_tick_is_reported_with_its_cause() -> None:
    clock = FakeClock()
    watch = TickWatch(150, clock=clock)
    _tick(watch, clock, apply_s=0.4, applied=8, snapshot_s=0.1, rest_s=0.02)
    report = watch.end()
    assert report is not None
    assert report.slow == 1 and report.worst_applied == 8
    assert round(report.worst_ms) == 520
    assert round(report.worst_apply_ms) == 400 and round(report.worst_snapshot_ms) == 100
    text = report.describe(watch.slow_ms)
    assert "over 150 ms" in text and "applying 8 command(s) 400 ms" in text


def test_later_slow_ticks_are_summed_into_one_report_per_period() -> None:
    clock = FakeClock()
    watch = TickWatch(150, report_every_s=10, clock=clock)
    _tick(watch, clock, apply_s=0.2)
    assert watch.end() is not None
    for apply_s in (0.3, 0.9, 0.2):
        _tick(watch, clock, apply_s=apply_s)
        assert watch.end() is None  # within the period: held back
    clock.now += 10
    _tick(watch, clock, apply_s=0.01)
    report = watch.end()
    assert report is not None
    assert report.slow == 3 and round(report.worst_ms) == 900
    assert (watch.ticks, watch.slow_ticks) == (5, 4)
    assert round(watch.max_ms) == 900
