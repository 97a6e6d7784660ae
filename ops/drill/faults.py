"""Faults a drill injects. Each is bounded in time and healed before the next begins.

=================  =========================================================================
name               what happens
=================  =========================================================================
kill-leader        SIGKILL the leader; restart it on the same data after ``hold_s``
kill-follower      SIGKILL a random follower; restart it after ``hold_s``
kill-random        SIGKILL any node; restart it after ``hold_s``
stop-leader        SIGTERM the leader (a graceful stop: it hands the leadership over first);
                   restart it after ``hold_s``
pause-leader       SIGSTOP the leader for 0.25 s (under the election timeout) or 3 s (over it),
                   alternating; then SIGCONT: it wakes up as a stale leader
partition-leader   cut the leader from every other node (root, network namespaces)
isolate-follower   cut a random follower from every other node (root)
partition-halves   cut the nodes into two halves (root)
clock-skew         move one node's wall clock by 2-5 s either way, then back (the broker's
                   clock reads a skew file; Raft's monotonic timers are left alone)
kill-at-due        produce a burst of delayed messages, and SIGKILL the leader as they fall due
transfer-leader    3-5 leadership transfers in a row (to a random follower, or to none: the
                   most caught-up), each asked of a random node; records every answer
membership         remove a random follower while it runs, check it is dropped and answers 410,
                   add it back after ``hold_s`` and wait until it has caught up
power-cut          SIGKILL the leader, then a minority, then every node at once (in turn), drop
                   what their disks had not synced, restart them after ``hold_s`` (root:
                   every data directory on its own power-cut mount, :mod:`chronomq.ops.drill.powercut`)
=================  =========================================================================

The churn faults (``transfer-leader``, ``membership``) live in :mod:`chronomq.ops.drill.churn`.
``power-cut`` is not part of ``all``: with ``flush = async`` losing what the last flush
interval held is the documented outcome, so it is asked for by name.

A fault that cannot run here (no root for partitions) is skipped with a message, once.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from chronomq.ops.drill import churn, netns
from chronomq.ops.drill.context import (
    DEFAULT_HOLD_S,
    FaultContext,
    blocking,
    wait_converged,
    wait_leader,
)
from chronomq.ops.drill.powercut import mount as powercut

__all__ = [
    "ALL_FAULTS",
    "CHURN",
    "KNOWN_FAULTS",
    "POWER",
    "DEFAULT_HOLD_S",
    "PARTITIONS",
    "FaultContext",
    "inject",
    "skew_env",
    "unavailable_reason",
    "wait_converged",
    "wait_leader",
]

PARTITIONS = ("partition-leader", "isolate-follower", "partition-halves")
CHURN = ("transfer-leader", "membership")
ALL_FAULTS = (
    "kill-leader",
    "kill-follower",
    "kill-random",
    "stop-leader",
    "pause-leader",
    *PARTITIONS,
    "clock-skew",
    "kill-at-due",
    *CHURN,
)
POWER = ("power-cut",)
KNOWN_FAULTS = (*ALL_FAULTS, *POWER)
POWER_SCOPES = ("leader", "minority", "all")


def skew_env(node_dir: Path) -> dict[str, str]:
    """Environment that lets the drill move a node's wall clock through a file (ms offset)."""
    stamp = node_dir / "clock-skew"
    node_dir.mkdir(parents=True, exist_ok=True)
    stamp.write_text("0\n")
    return {"CHRONOMQ_CLOCK_SKEW_FILE": str(stamp)}


def unavailable_reason(
    name: str,
    network: netns.Network | None,
    skew: bool,
    disks: dict[int, powercut.PowerCutMount] | None = None,
) -> str | None:
    if name in POWER and not disks:
        _, why = powercut.available()
        return why or "power-cut needs every data directory on a power-cut mount"
    if name in PARTITIONS and network is None:
        _, why = netns.available()
        return why or "partition faults need the nodes in network namespaces"
    if name == "clock-skew" and not skew:
        return "clock-skew needs the nodes started with a skew file"
    return None


async def inject(name: str, ctx: FaultContext) -> dict[str, Any]:
    """Inject fault ``name``, hold it, heal it; the detail recorded with it."""
    handler = _FAULTS[name]
    return await handler(ctx)


async def _kill(
    ctx: FaultContext, name: str, node: int, sig: int = signal.SIGKILL
) -> dict[str, Any]:
    c = ctx.cluster
    ctx.record("start", fault=name, node=node)
    await blocking(c.kill, node, sig)
    await ctx.enter(f"{name} held")
    await asyncio.sleep(ctx.hold_s)
    await ctx.enter("healing")
    await blocking(c.start, node)
    ctx.record("end", fault=name, node=node)
    return {"node": node}


async def kill_leader(ctx: FaultContext) -> dict[str, Any]:
    return await _kill(ctx, "kill-leader", await ctx.leader())


async def stop_leader(ctx: FaultContext) -> dict[str, Any]:
    return await _kill(ctx, "stop-leader", await ctx.leader(), signal.SIGTERM)


async def kill_follower(ctx: FaultContext) -> dict[str, Any]:
    leader = await ctx.leader()
    return await _kill(ctx, "kill-follower", ctx.rng.choice(ctx.others(leader)))


async def kill_random(ctx: FaultContext) -> dict[str, Any]:
    return await _kill(ctx, "kill-random", ctx.rng.randrange(ctx.cluster.n))


async def pause_leader(ctx: FaultContext) -> dict[str, Any]:
    leader = await ctx.leader()
    hold = 0.25 if ctx.pauses % 2 else 3.0
    ctx.pauses += 1
    ctx.record("start", fault="pause-leader", node=leader, hold_s=hold)

    def resume() -> None:
        ctx.cluster.kill(leader, signal.SIGCONT)

    ctx.healers.append(resume)
    await blocking(ctx.cluster.kill, leader, signal.SIGSTOP)
    await ctx.enter("pause-leader held")
    await asyncio.sleep(hold)
    await ctx.enter("healing")
    resume()
    ctx.healers.remove(resume)
    ctx.record("end", fault="pause-leader", node=leader)
    return {"node": leader, "hold_s": hold}


async def _partition(ctx: FaultContext, name: str, groups: list[list[int]]) -> dict[str, Any]:
    network = ctx.network
    assert network is not None
    ctx.record("start", fault=name, groups=groups)
    ctx.healers.append(network.heal_all)
    for side in groups:
        others = [j for j in range(ctx.cluster.n) if j not in side]
        for i in side:
            await blocking(network.cut, i, others)
    await ctx.enter(f"{name} held")
    await asyncio.sleep(ctx.hold_s)
    await ctx.enter("healing")
    await blocking(network.heal_all)
    ctx.healers.remove(network.heal_all)
    ctx.record("end", fault=name)
    return {"groups": groups}


async def partition_leader(ctx: FaultContext) -> dict[str, Any]:
    leader = await ctx.leader()
    return await _partition(ctx, "partition-leader", [[leader]])


async def isolate_follower(ctx: FaultContext) -> dict[str, Any]:
    leader = await ctx.leader()
    return await _partition(ctx, "isolate-follower", [[ctx.rng.choice(ctx.others(leader))]])


async def partition_halves(ctx: FaultContext) -> dict[str, Any]:
    nodes = list(range(ctx.cluster.n))
    ctx.rng.shuffle(nodes)
    half = len(nodes) // 2
    return await _partition(ctx, "partition-halves", [sorted(nodes[:half])])


async def clock_skew(ctx: FaultContext) -> dict[str, Any]:
    node = ctx.rng.randrange(ctx.cluster.n)
    skew_ms = ctx.rng.choice((-1, 1)) * ctx.rng.randint(2000, 5000)
    stamp = ctx.cluster.node_dir(node) / "clock-skew"
    ctx.skew_ms = max(ctx.skew_ms, abs(skew_ms))
    ctx.record("start", fault="clock-skew", node=node, skew_ms=skew_ms)

    def reset() -> None:
        stamp.write_text("0\n")

    ctx.healers.append(reset)
    stamp.write_text(f"{skew_ms}\n")
    await ctx.enter("clock-skew held")
    await asyncio.sleep(ctx.hold_s)
    await ctx.enter("healing")
    reset()
    await asyncio.sleep(0.5)  # the node re-reads the file every 200 ms
    ctx.healers.remove(reset)
    ctx.record("end", fault="clock-skew", node=node)
    return {"node": node, "skew_ms": skew_ms}


async def kill_at_due(ctx: FaultContext) -> dict[str, Any]:
    if ctx.burst is None:
        raise RuntimeError("kill-at-due needs the workload's burst")
    due_ms = await ctx.burst(2000)
    await asyncio.sleep(max(0.0, due_ms / 1000 - time.time()))
    leader = await ctx.leader()
    return await _kill(ctx, "kill-at-due", leader) | {"due_ms": due_ms}


def _cut_summary(report: dict[str, Any]) -> dict[str, Any]:
    keep = ("files_reverted", "bytes_reverted", "entries_lost", "entries_back")
    return {k: report[k] for k in keep} | {"lost_paths": report["lost"][:5]}


async def power_cut(ctx: FaultContext) -> dict[str, Any]:
    """SIGKILL the nodes of this cut's scope at once, drop what their disks had not synced,
    and restart them on what is left."""
    disks = ctx.disks
    if not disks:
        raise RuntimeError("power-cut needs the nodes' data directories on power-cut mounts")
    c = ctx.cluster
    scope = POWER_SCOPES[ctx.power_cuts % len(POWER_SCOPES)]
    ctx.power_cuts += 1
    if scope == "leader":
        nodes = [await ctx.leader()]
    elif scope == "minority":
        nodes = sorted(ctx.rng.sample(range(c.n), (c.n - 1) // 2))
    else:
        nodes = list(range(c.n))
    ctx.record("start", fault="power-cut", scope=scope, nodes=nodes)
    await asyncio.gather(*(blocking(c.kill, i, signal.SIGKILL) for i in nodes))
    # Every process of those nodes is gone (and has written its dirty pages back), so what
    # the disks hold now is what the page cache held: the cut drops what was not synced.
    cuts: dict[str, dict[str, Any]] = {}
    for i in nodes:
        cuts[str(i)] = _cut_summary(await blocking(disks[i].cut))
    await ctx.enter("power-cut held")
    await asyncio.sleep(ctx.hold_s)
    await ctx.enter("healing")
    for i in nodes:
        await blocking(c.start, i)
    ctx.record("end", fault="power-cut", scope=scope, nodes=nodes, cut=cuts)
    return {"scope": scope, "nodes": nodes, "cut": cuts}


_FAULTS: dict[str, Callable[[FaultContext], Coroutine[Any, Any, dict[str, Any]]]] = {
    "kill-leader": kill_leader,
    "kill-follower": kill_follower,
    "kill-random": kill_random,
    "stop-leader": stop_leader,
    "pause-leader": pause_leader,
    "partition-leader": partition_leader,
    "isolate-follower": isolate_follower,
    "partition-halves": partition_halves,
    "clock-skew": clock_skew,
    "kill-at-due": kill_at_due,
    "transfer-leader": churn.transfer_leader,
    "membership": churn.membership,
    "power-cut": power_cut,
}
