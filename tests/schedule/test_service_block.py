"""A level that blocks says so once, and once more when it is free again (async mode)."""

from __future__ import annotations

import asyncio
import logging
import random

import pytest

from chronomq.raftlog.errors import ReplicationError
from chronomq.raftlog.leaderloop import LeaderRuntime
from chronomq.raftlog.leadership import Leadership
from chronomq.schedule.levels import DelayLevelTable
from chronomq.schedule.pending import PendingConfig
from chronomq.schedule.service import ScheduleService
from chronomq.schedule.settings import ScheduleSettings
from chronomq.schedule.state import ASYNC, MODE_KEY, offset_key
from tests.schedule.fakes import FakeRaftLog, FakeStore, VirtualClock, VirtualLoop, run_virtual


async def _run(caplog: pytest.LogCaptureFixture) -> None:
    loop = asyncio.get_running_loop()
    assert isinstance(loop, VirtualLoop)
    levels = DelayLevelTable.parse("1s")
    clock = VirtualClock(loop)
    store = FakeStore(levels)
    raft = FakeRaftLog(clock, store)
    owner = Leadership(now_ms=clock.monotonic_ms, call_later=lambda _d, _f: None)
    raft.add_leader_listener(owner.on_leader)
    settings = ScheduleSettings(
        levels=levels,
        pending=PendingConfig(max_resend_num_to_blocked=3, resend_backoff_step_ms=100),
        batch_max_messages=1,
    )
    runtime = LeaderRuntime(owner)
    service = ScheduleService(raft, settings, runtime=runtime)  # type: ignore[arg-type]
    service.attach()
    serving = loop.create_task(runtime.serve())
    await asyncio.sleep(0)
    runtime.attach()
    store.kv[MODE_KEY] = ASYNC
    for i in range(3):
        store.store_delayed(i.to_bytes(16, "big"), 1, 0, clock.now_ms())
    raft.gain(random.Random(1))
    failing = True

    async def raft_ticks() -> None:
        while True:
            await asyncio.sleep(0.005)
            while raft.pending:
                p = raft.pending[0]
                if failing and p.expect.get(offset_key(1)) == 1:
                    raft.pending.pop(0)
                    p.future.set_exception(ReplicationError("the disk is on fire"))
                else:
                    raft.commit(1)

    ticking = loop.create_task(raft_ticks())
    with caplog.at_level(logging.INFO, logger="chronomq.schedule.service"):
        await asyncio.sleep(3.0)
        view = service.stats()["levels"][0]
        assert view["blocked"] and view["blocked_by"]["queue_offset"] == 1
        assert view["blocked_by"]["last_error"] == "the disk is on fire"
        assert view["offset"] == 1
        await asyncio.sleep(3.0)  # still blocked, resending: no more lines
        failing = False
        await asyncio.sleep(1.0)
    view = service.stats()["levels"][0]
    assert not view["blocked"] and view["offset"] == 3
    lines = [r for r in caplog.records if r.name == "chronomq.schedule.service"]
    blocked = [r for r in lines if " blocked at queue offset" in r.getMessage()]
    blocked = [r for r in blocked if "no longer" not in r.getMessage()]
    assert len(blocked) == 1 and blocked[0].levelno == logging.ERROR
    text = blocked[0].getMessage()
    assert "level 1" in text and "offset 1" in text and "3 failures" in text
    assert "the disk is on fire" in text
    freed = [r for r in lines if "no longer blocked" in r.getMessage()]
    assert len(freed) == 1 and freed[0].levelno == logging.WARNING
    assert len({d.msg_id for d in store.delivered}) == len(store.delivered) == 3
    ticking.cancel()
    service.close()
    runtime.close()
    await serving


def test_a_blocked_level_logs_once_and_its_unblock_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    run_virtual(_run(caplog))
