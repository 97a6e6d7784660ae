"""What every fault receives (:class:`FaultContext`), and the cluster waits they share.

Both :mod:`chronomq.ops.drill.faults` and :mod:`chronomq.ops.drill.churn` import from here; nothing here imports
them.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

from chronomq.cluster.process.launcher import LocalCluster
from chronomq.ops.drill import netns
from chronomq.ops.drill.powercut.mount import PowerCutMount

DEFAULT_HOLD_S = 3.0

T = TypeVar("T")


async def blocking(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` on a daemon thread of its own, awaited: what ``asyncio.to_thread`` does,
    except that nothing waits for the thread once the caller is cancelled. A drill stopped by
    Ctrl-C in the middle of a fault (a node starting, a link being cut) leaves its event loop
    at once; the loop's executor, and the interpreter at exit, would wait for every thread it
    started. What such a thread still does is undone by the drill's clean-up (the cluster
    refuses to start a node once it is stopping; the namespaces go whole)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if future.done():
            return
        if ok:
            future.set_result(value)
        else:
            future.set_exception(value)

    def work() -> None:
        try:
            result: Any = fn(*args)
            ok = True
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting task
            result, ok = exc, False
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
            loop.call_soon_threadsafe(settle, ok, result)

    name = f"drill-{getattr(fn, '__name__', 'call')}"
    threading.Thread(target=work, name=name, daemon=True).start()
    return await future


async def _no_phase(phase: str) -> None:
    return None


@dataclass
class FaultContext:
    cluster: LocalCluster
    rng: random.Random
    network: netns.Network | None
    record: Callable[..., None]
    """``record(type, fault=..., **detail)``: history and event log."""
    burst: Callable[[int], Coroutine[Any, Any, int]] | None = None
    """Produce a burst of delayed messages; returns when they fall due (ms)."""
    hold_s: float = DEFAULT_HOLD_S
    pauses: int = 0
    skew_ms: int = 0
    """Largest clock skew injected so far (the checker allows for it)."""
    transfers: int = 0
    """Leadership transfers asked so far (the target alternates: a follower, then none)."""
    healers: list[Callable[[], None]] = field(default_factory=list)
    disks: dict[int, PowerCutMount] | None = None
    """Each node's power-cut mount (its data directory), when the drill made them."""
    power_cuts: int = 0
    """Power cuts so far (the scope cycles: the leader, a minority, every node)."""
    enter: Callable[[str], Coroutine[Any, Any, None]] = field(default=_no_phase)
    """``await enter(phase)``: the drill's progress within a fault (``healing``)."""

    async def leader(self) -> int:
        return await wait_leader(self.cluster, 30)

    def others(self, i: int) -> list[int]:
        return [j for j in range(self.cluster.n) if j != i]


# The cluster's waits block; run them on threads in slices of a second or two, so that the
# waits themselves end soon after the drill stops waiting for them.
_SLICE_S = 2.0


async def wait_leader(cluster: LocalCluster, timeout_s: float) -> int:
    """:meth:`LocalCluster.wait_leader` (the leader, once every node knows it or the time is
    up), waiting on threads at most :data:`_SLICE_S` at a time."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"no leader within {timeout_s} s")
        with contextlib.suppress(TimeoutError):
            leader = await blocking(cluster.wait_leader, min(left, _SLICE_S))
            break
    while time.monotonic() < deadline:
        try:
            await blocking(cluster.wait_all_know_leader, min(deadline - time.monotonic(), _SLICE_S))
            break
        except TimeoutError:
            continue
    return leader


async def wait_converged(cluster: LocalCluster, timeout_s: float) -> None:
    """:meth:`LocalCluster.wait_converged`, on threads at most :data:`_SLICE_S` at a time."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        try:
            await blocking(cluster.wait_converged, max(0.1, min(left, _SLICE_S)))
            return
        except TimeoutError:
            if time.monotonic() >= deadline:
                raise
