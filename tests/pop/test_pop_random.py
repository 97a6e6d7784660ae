"""Randomized pop/ack/change/revive runs of the pop core with a fake clock and a modelled timer.

Checks, for every seed: no message is held by two consumers at once, no message is acked twice,
an unacked message comes back (or goes to the DLQ) after its invisible time and never before,
and once everything falls due nothing stays in flight. A failure names its seed.
"""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass

from chronomq.pop import core
from chronomq.pop.core import AckStatus, ReviveAction
from chronomq.pop.state import QueueState
from chronomq.raftlog.clock import FakeClock

T0 = 1_700_000_000_000
MRT = 3


@dataclass(frozen=True)
class Held:
    consumer: int
    pop_id: int
    until_ms: int


def run(seed: int, steps: int = 3000) -> None:
    rng = random.Random(seed)
    clock = FakeClock(T0)
    st = QueueState()
    max_offset = 0
    cks: list[tuple[int, int, int, int]] = []  # (due_ms, seq, offset, pop_id)
    held: dict[int, Held] = {}  # offset -> who holds it now (model)
    handles: list[tuple[int, int, int]] = []  # (consumer, offset, pop_id) ever handed out
    acked: set[int] = set()
    dlq: set[int] = set()
    seq = 0

    def ck(due: int, offset: int, pop_id: int) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(cks, (due, seq, offset, pop_id))

    def fire(now: int) -> None:
        while cks and cks[0][0] <= now:
            _, _, offset, pop_id = heapq.heappop(cks)
            # The revive command's time: usually the timer's, sometimes a new leader behind.
            cmd_ms = now - (rng.randrange(50) if rng.random() < 0.1 else 0)
            action, entry = core.revive(st, offset, pop_id, now_ms=cmd_ms, max_reconsume_times=MRT)
            if action is ReviveAction.STALE:
                continue
            assert entry is not None
            if action is ReviveAction.REARM:
                assert entry.until_ms > cmd_ms, f"seed {seed}"
                ck(entry.until_ms, offset, pop_id)
                continue
            assert cmd_ms >= entry.until_ms, f"seed {seed}: revived before its invisible time"
            assert held.pop(offset).pop_id == pop_id, f"seed {seed}"
            if action is ReviveAction.DLQ:
                assert entry.attempt == MRT + 1, f"seed {seed}"
                dlq.add(offset)

    for index in range(1, steps + 1):
        clock.advance(rng.choice((0, 1, 5, 50, 400, 2000)))
        now = clock.now_ms()
        fire(now)
        roll = rng.random()
        if roll < 0.15:
            max_offset += rng.randrange(1, 6)
        elif roll < 0.45:
            consumer = rng.randrange(4)
            until = now + rng.choice((1_000, 3_000, 10_000))
            picked, _ = core.pick(
                st, n=rng.randrange(1, 8), pop_id=index, until_ms=until, min_offset=0,
                max_offset=max_offset,
            )  # fmt: skip
            for p in picked:
                assert p.offset not in held, f"seed {seed}: offset {p.offset} held twice"
                assert p.offset not in acked and p.offset not in dlq, f"seed {seed}"
                held[p.offset] = Held(consumer, index, until)
                handles.append((consumer, p.offset, index))
                ck(until, p.offset, index)
        elif roll < 0.8 and handles:
            consumer, offset, pop_id = rng.choice(handles)
            status = core.ack(st, offset, pop_id)
            current = held.get(offset)
            if current is not None and current.pop_id == pop_id:
                assert status is AckStatus.ACKED, f"seed {seed}"
                assert offset not in acked, f"seed {seed}: acked twice"
                acked.add(offset)
                del held[offset]
            else:
                assert status is not AckStatus.ACKED, f"seed {seed}: a stale handle acked"
        elif roll < 0.9 and handles:
            consumer, offset, pop_id = rng.choice(handles)
            until = now + rng.choice((500, 5_000))
            changed = core.change(st, offset, pop_id, new_pop_id=index, until_ms=until)
            current = held.get(offset)
            if current is not None and current.pop_id == pop_id:
                assert changed is not None, f"seed {seed}"
                held[offset] = Held(current.consumer, index, until)
                handles.append((current.consumer, offset, index))
                ck(until, offset, index)
            else:
                assert changed is None, f"seed {seed}"
        elif handles:
            consumer, offset, pop_id = rng.choice(handles)
            taken = core.take(st, offset, pop_id)
            current = held.get(offset)
            assert (taken is not None) == (current is not None and current.pop_id == pop_id)
            if taken is not None:
                dlq.add(offset)
                del held[offset]
        # The model and the state agree on what is in flight.
        assert {o: e.pop_id for o, e in st.inflight.items()} == {
            o: h.pop_id for o, h in held.items()
        }, f"seed {seed}"

    # Let every invisible time pass with no more pops: nothing stays in flight.
    clock.advance(24 * 3_600_000)
    fire(clock.now_ms())
    assert not st.inflight and not held, f"seed {seed}: stuck in flight"
    handed = {o for _, o, _ in handles}
    assert handed == acked | dlq | set(st.revived), f"seed {seed}: a message was lost"
    assert not acked & dlq, f"seed {seed}"


def test_random_pop_ack_change_revive_runs_keep_the_invariants() -> None:
    base = random.SystemRandom().randrange(1 << 30)
    for k in range(12):
        seed = base + k
        print(f"seed {seed}")
        run(seed)


def test_a_known_seed() -> None:
    run(20261125)
