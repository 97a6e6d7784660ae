"""The leader runtime (:mod:`chronomq.raftlog.leaderloop`): one term's loops at a time, a
stepped driver begun and ended once per term, on its own thread, in order."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

from chronomq.raftlog.leaderloop import LeaderRuntime, LoopSpec, SteppedLoop, Wake
from chronomq.raftlog.leadership import Leadership, TermToken


class Driver:
    """Records its calls and the threads they ran on; its first step raises once."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.threads: set[str] = set()
        self.raise_once = True

    def _saw(self, call: str) -> None:
        self.calls.append(call)
        self.threads.add(threading.current_thread().name)

    def begin(self, token: TermToken) -> None:
        self._saw(f"begin {token.term}")

    def step(self) -> float:
        if self.raise_once:
            self.raise_once = False
            raise RuntimeError("a step that fails")
        self._saw("step")
        return 10.0  # only a wake-up or the end of the term cuts this short

    def failed(self) -> None:
        self._saw("failed")

    def end(self) -> None:
        self._saw("end")


async def until(cond: Callable[[], bool], timeout_s: float = 5.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not cond():
            await asyncio.sleep(0.005)


async def test_a_stepped_driver_runs_once_per_term_and_the_next_term_waits_for_its_end() -> None:
    owner = Leadership(now_ms=lambda: 0.0, call_later=lambda _d, _f: None)
    runtime = LeaderRuntime(owner)
    driver, wake = Driver(), Wake()
    stepped = SteppedLoop("timer", "timer driver", driver, wake, "test driver")
    runtime.add(stepped.spec())
    serving = asyncio.get_running_loop().create_task(runtime.serve())
    await asyncio.sleep(0)
    runtime.attach()

    owner.on_leader(True, 3)
    await until(lambda: driver.calls.count("step") == 1)
    assert driver.calls == ["begin 3", "failed", "step"]
    assert owner.loops() == {"timer driver": 3} and stepped.running
    wake.set()  # any thread may cut the sleep short
    await until(lambda: driver.calls.count("step") == 2)

    owner.on_leader(True, 5)  # a later term: the driver of term 3 ends before term 5 begins
    await until(lambda: "begin 5" in driver.calls)
    assert driver.calls[driver.calls.index("begin 5") - 1] == "end"
    assert owner.loops() == {"timer driver": 5}
    owner.on_leader(False, 5)
    await until(lambda: owner.loops() == {} and owner.stats().term is None)
    assert driver.calls[-1] == "end"
    view = owner.stats()
    assert (view.started_total, view.stopped_total, view.terms_started_total) == (2, 2, 2)
    assert driver.threads == {"leader-work-timer_0"}

    runtime.close()
    await serving


async def test_a_task_cancelled_before_its_first_step_still_lets_the_next_term_start() -> None:
    owner = Leadership(now_ms=lambda: 0.0, call_later=lambda _d, _f: None)
    runtime = LeaderRuntime(owner)
    entered: list[int] = []

    async def run(token: TermToken, wake: asyncio.Event) -> None:
        entered.append(token.term)
        while token.is_current():
            await wake.wait()
            wake.clear()

    runtime.add(LoopSpec("schedule", "schedule level 1", run))
    serving = asyncio.get_running_loop().create_task(runtime.serve())
    await asyncio.sleep(0)
    runtime.attach()
    owner.on_leader(True, 1)
    await asyncio.sleep(0)  # the term's task is created, and has not taken a step
    owner.on_leader(False, 1)
    runtime._end_term()  # what the wake-up does, before the task's first step
    owner.on_leader(True, 2)
    await until(lambda: owner.loops() == {"schedule level 1": 2})
    assert entered == [2], "the task of term 1 never entered its body"
    runtime.close()
    await serving
    assert owner.loops() == {}
