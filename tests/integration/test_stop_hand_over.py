"""A leader stopped gracefully (SIGTERM) hands its leadership over first, on real nodes.

* 3 nodes, producers sending all the time through :class:`chronomq.aio.Client` given every
  node's URL, SIGTERM to the leader: no producer sees an error, the stopping node says to
  which node it handed the leadership, that node leads the rest, it exits 0, and every
  acknowledged message is stored exactly once. How long after the SIGTERM the next produce
  was acknowledged is printed and named in every assertion (a figure, not a limit: limits
  belong in the drills and benchmarks).
* 1 node: nothing to hand over; SIGTERM stops it with status 0 as before.

Every wait is a condition with a deadline.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import pytest

from chronomq.aio import Client
from chronomq.cluster.process.launcher import LocalCluster
from chronomq.cluster.process.stopping import STOP_DEADLINE_S
from tests.integration.conftest import dump_logs, wait_for

pytestmark = pytest.mark.integration

TOPIC = "handover"
QUEUES = 4
PRODUCERS = 4
BATCH = 5
PRODUCE_FOR_S = 120.0  # the producers stop by then whatever happens


def node_log(cluster: LocalCluster, i: int) -> str:
    path = cluster.node_dir(i) / "node.log"
    return path.read_text(errors="replace") if path.exists() else ""


@dataclass
class Traffic:
    """What the producers sent and were told: (sent, acknowledged) monotonic times of each
    acknowledged batch, its bodies, and every error."""

    acked: list[tuple[float, float]] = field(default_factory=list)
    bodies: list[str] = field(default_factory=list)
    errors: list[BaseException] = field(default_factory=list)

    def next_ack_after(self, t0: float) -> float | None:
        """Seconds from ``t0`` to the acknowledgement of the first batch sent after it."""
        after = [acked for sent, acked in self.acked if sent >= t0]
        return min(after) - t0 if after else None

    def longest_gap_around(self, t0: float) -> float:
        """The longest time without an acknowledgement, among those from just before ``t0``."""
        times = sorted(acked for _, acked in self.acked)
        start = max((t for t in times if t < t0), default=t0)
        after = [start, *(t for t in times if t >= t0)]
        return max((b - a for a, b in zip(after, after[1:], strict=False)), default=0.0)


async def produce(client: Client, traffic: Traffic, n: int, stop: asyncio.Event) -> None:
    deadline = time.monotonic() + PRODUCE_FOR_S
    k = 0
    while not stop.is_set() and time.monotonic() < deadline:
        bodies = [f"p{n}-{k}-{j}" for j in range(BATCH)]
        sent = time.monotonic()
        try:
            await client.produce(TOPIC, [{"body": b} for b in bodies])
        except Exception as exc:  # every error is a finding: keep it, and go on
            traffic.errors.append(exc)
        else:
            traffic.acked.append((sent, time.monotonic()))
            traffic.bodies.extend(bodies)
        k += 1


async def stored_bodies(client: Client, url: str) -> Counter[str]:
    """Every body in the topic's queues, counted, as the node at ``url`` has them."""
    found: Counter[str] = Counter()
    for queue in range(QUEUES):
        offset = 0
        deadline = time.monotonic() + 60
        while True:
            assert time.monotonic() < deadline, f"reading queue {queue} did not end within 60 s"
            page = await client.pull(TOPIC, queue, offset, 500, url=url)
            found.update(m["body"] for m in page["messages"])
            if not page["messages"] or page["next_offset"] == offset:
                break
            offset = page["next_offset"]
    return found


def test_sigterm_on_the_leader_hands_over_and_producers_see_no_error(make_cluster: Any) -> None:
    cluster: LocalCluster = make_cluster(3)
    old = cluster.wait_leader(60)
    others = [i for i in range(3) if i != old]

    async def go() -> None:
        async with Client(cluster.urls, deadline_s=30) as client:
            await client.create_topic(TOPIC, QUEUES)
            traffic = Traffic()
            stop = asyncio.Event()
            tasks = [
                asyncio.create_task(produce(client, traffic, n, stop)) for n in range(PRODUCERS)
            ]
            try:
                await wait_for(
                    lambda: asyncio.sleep(0, len(traffic.acked) > 50),
                    30,
                    "the producers to get going",
                    cluster,
                )
                t0 = time.monotonic()
                await asyncio.to_thread(cluster.kill, old, signal.SIGTERM, STOP_DEADLINE_S + 5)
                exited_s = time.monotonic() - t0
                before = len(traffic.acked)
                await wait_for(
                    lambda: asyncio.sleep(0, len(traffic.acked) > before + 50 or traffic.errors),
                    30,
                    "produces acknowledged after the old leader exited",
                    cluster,
                )
            finally:
                stop.set()
                await asyncio.gather(*tasks)
            next_s = traffic.next_ack_after(t0)
            figure = (
                f"next produce acknowledged {next_s * 1000:.0f} ms after the SIGTERM"
                if next_s is not None
                else "no produce sent after the SIGTERM was acknowledged"
            ) + (
                f"; longest time without an acknowledgement "
                f"{traffic.longest_gap_around(t0) * 1000:.0f} ms; the old leader exited "
                f"{exited_s * 1000:.0f} ms after the signal"
            )
            print(figure)
            assert not traffic.errors, f"producer errors ({figure}): {traffic.errors[:5]}"
            rc = cluster.procs[old].returncode
            assert rc == 0, f"the old leader exited with {rc} ({figure})"

            said = node_log(cluster, old)
            handed = [ln for ln in said.splitlines() if "stopping: leadership handed to" in ln]
            assert handed, f"the old leader handed nothing over ({figure})"
            new = await asyncio.to_thread(cluster.wait_leader, 30, among=others)
            assert f"leadership handed to node {new} " in handed[0], (handed, new, figure)
            # It was elected at the old leader's word (TimeoutNow), not after a timeout.
            assert "TimeoutNow from the leader" in node_log(cluster, new), figure

            found = await stored_bodies(client, cluster.http_url(new))
            missing = [b for b in traffic.bodies if found[b] == 0]
            twice = [b for b, n in found.items() if n > 1]
            assert not missing, f"{len(missing)} acknowledged messages lost ({figure})"
            assert not twice, f"{len(twice)} messages stored twice ({figure}): {twice[:5]}"

    try:
        asyncio.run(go())
    except Exception:
        print(dump_logs(cluster))
        raise


def test_sigterm_on_a_single_node_stops_it_with_nothing_to_hand_over(make_cluster: Any) -> None:
    cluster: LocalCluster = make_cluster(1)
    cluster.wait_leader(60)
    t0 = time.monotonic()
    cluster.kill(0, signal.SIGTERM, STOP_DEADLINE_S + 5)
    took_s = time.monotonic() - t0
    rc = cluster.procs[0].returncode
    assert rc == 0, f"exited with {rc} {took_s:.1f} s after SIGTERM\n{dump_logs(cluster)}"
    assert "the only member; no leadership to hand over" in node_log(cluster, 0), dump_logs(cluster)
