"""The read index of follower reads (cluster/node/readfence.py), with a leader that answers
when the test says so."""

from __future__ import annotations

import asyncio

import pytest

from chronomq.cluster.node.errors import ApiError
from chronomq.cluster.node.readfence import ReadFence


class Leader:
    def __init__(self) -> None:
        self.asked = 0
        self.commit_index = 10
        self.gate: asyncio.Event | None = None

    async def ask(self) -> int:
        self.asked += 1
        index = self.commit_index  # read when the question arrives
        if self.gate is not None:
            await self.gate.wait()
        return index


async def test_a_read_waits_until_this_node_applied_the_leaders_commit_index() -> None:
    leader = Leader()
    applied = [5]
    fence = ReadFence(leader.ask, lambda: applied[0], timeout_s=5)
    task = asyncio.create_task(fence.wait())
    for _ in range(100):
        await asyncio.sleep(0.001)
    assert not task.done()
    applied[0] = 10
    await asyncio.wait_for(task, 5)
    assert fence.waited == 1


async def test_reads_share_a_question_asked_after_they_began_never_one_before() -> None:
    leader = Leader()
    leader.gate = asyncio.Event()
    fence = ReadFence(leader.ask, lambda: 100, timeout_s=5)
    first = asyncio.create_task(fence.wait())
    await asyncio.sleep(0.01)  # the first question is in flight, asked before the next reads
    late = [asyncio.create_task(fence.wait()) for _ in range(5)]
    await asyncio.sleep(0)
    assert leader.asked == 1  # the late reads wait for it to end: it began before them
    leader.gate.set()
    await asyncio.wait_for(asyncio.gather(first, *late), 5)
    assert leader.asked == 2  # one more question for all five


async def test_a_node_that_does_not_catch_up_answers_replica_behind() -> None:
    leader = Leader()
    fence = ReadFence(leader.ask, lambda: 3, timeout_s=0.05)
    with pytest.raises(ApiError) as err:
        await fence.wait()
    assert err.value.status == 503 and err.value.code == "replica_behind"


async def test_a_leader_that_cannot_be_asked_answers_read_index_unavailable() -> None:
    async def broken() -> int:
        raise OSError("connection refused")

    fence = ReadFence(broken, lambda: 3, timeout_s=1)
    with pytest.raises(ApiError) as err:
        await fence.wait()
    assert err.value.status == 503 and err.value.code == "read_index_unavailable"
    assert "connection refused" in err.value.message
