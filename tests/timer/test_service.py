"""The timer driver and apply extension together, on an in-process Raft group with a fake clock
(:mod:`tests.timer.fakes`): never early, exactly once, on every replica alike, across
pipelined commands, failovers, rolls, cancels and switches. A failing randomized test prints
its seed."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from collections.abc import Awaitable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from chronomq.raftlog import record
from chronomq.raftlog.errors import InvalidInput, UnknownQueue
from chronomq.timer import message as tm
from chronomq.timer.config import TimerConfig, timer_config_from
from chronomq.timer.errors import DelayTooLong, InvalidDeliverTime, SlotCongested
from chronomq.timer.timerlog import read_records
from tests.conftest import random_seed
from tests.timer.fakes import T0, Group

T = TypeVar("T")

PRECISION = 100


def config(**overrides: Any) -> TimerConfig:
    values: dict[str, Any] = {
        "timer_precision_ms": PRECISION,
        "timer_roll_window_slots": 72_000,
        "timer_max_delay_s": 365 * 86_400,
        "timer_congest_num_each_slot": 10**9,
        "timer_stop_enqueue": False,
        "timer_stop_dequeue": False,
    }
    values.update(overrides)
    return timer_config_from(values)


@pytest.fixture
def make_group(tmp_path: Path) -> Iterator[Any]:
    groups: list[Group] = []

    def make(cfg: TimerConfig | None = None, **kw: Any) -> Group:
        g = Group(tmp_path / f"g{len(groups)}", cfg or config(), **kw)
        groups.append(g)
        g.elect(0)
        g.step_leader()
        g.commit()
        return g

    yield make
    for g in groups:
        g.close()


def check_delivered(g: Group, due: dict[str, int], topic: str = "t", replica: int = 0) -> list[int]:
    """Every produced message delivered once, never early; returns the lateness of each."""
    delivered = g.delivered(topic, replica)
    counts = Counter(m.msg_id_hex for m in delivered)
    assert not [k for k, n in counts.items() if n > 1], "duplicates"
    assert set(counts) == set(due), f"lost {len(set(due) - set(counts))}"
    lateness = [m.store_ms - due[m.msg_id_hex] for m in delivered]
    assert min(lateness) >= 0, "early"
    return lateness


def check_replicas_equal(g: Group) -> None:
    digests = [log.store.digest() for log in g.logs]
    assert all(d == digests[0] for d in digests), digests
    states = [s.machine.committed() for s in g.services]
    assert all(st.cursor == states[0].cursor for st in states)
    assert all(st.log_end == states[0].log_end for st in states)
    logs = []
    for s in g.services:
        files = s.machine.files
        data, _ = read_records(
            files.log.directory, files.log.segment_bytes, 0, files.log.end_pos, 10**7
        )
        logs.append(data)
    assert all(x == logs[0] for x in logs)
    first = g.services[0].machine.files
    slots = {rec.slot_ms for _, rec in first.log.scan(first.log.start_pos)}
    for service in g.services[1:]:
        wheel = service.machine.files.wheel
        assert [wheel.get(ms) for ms in sorted(slots)] == [
            first.wheel.get(ms) for ms in sorted(slots)
        ]


# ---------------------------------------------------------------------- delivery


def test_messages_arrive_once_never_early_and_replicas_agree(make_group: Any) -> None:
    g = make_group()
    rng = random.Random(7)
    due: dict[str, int] = {}
    end = T0 + 6_000
    while g.clock.now_ms() < end:
        for _ in range(rng.choice([0, 1, 5])):
            t = g.clock.now_ms() + rng.choice([-300, 0, 50, 400, 2_000, 4_000]) + rng.randint(0, 99)
            msg_id = g.produce("t", t)
            due[msg_id] = max(t, g.clock.now_ms())
        g.clock.advance(rng.randint(1, 30))
        g.step_leader()
        g.commit()
    g.run(end + 5_000)
    lateness = check_delivered(g, due)
    # A slot is due at its last millisecond; the fake clock ticks by at most 30 ms here.
    assert max(lateness) <= PRECISION + 30
    check_replicas_equal(g)
    st = g.service.machine.committed()
    assert st.backlog_total == 0
    assert st.counters["delivered"] == len(due)


@pytest.mark.parametrize("seed", [11, 12, 13, random_seed("timer_service")])
def test_failovers_with_commands_in_flight_neither_lose_nor_repeat(
    make_group: Any, seed: int
) -> None:
    rng = random.Random(seed)
    g = make_group(max_inflight=4)
    due: dict[str, int] = {}
    end = g.clock.now_ms() + 8_000
    failovers = 0
    while g.clock.now_ms() < end:
        for _ in range(rng.choice([0, 2, 6])):
            t = g.clock.now_ms() + rng.randint(-200, 3_000)
            due[g.produce("t", t)] = max(t, g.clock.now_ms())
        g.clock.advance(rng.randint(1, 40))
        g.step_leader()
        if rng.random() < 0.6:
            g.commit(rng.randint(0, len(g.pending)))
        if rng.random() < 0.03:
            failovers += 1
            # Some of the old leader's proposals reach the log, the rest are lost.
            g.commit(rng.randint(0, len(g.pending)))
            if rng.random() < 0.5:
                g.drop_pending()
            assert g.leader is not None
            g.elect(rng.choice([i for i in range(3) if i != g.leader]))
    g.run(end + 5_000)
    stored = stored_ids(g)
    assert stored <= set(due)
    stale = sum(s.machine.committed().counters.get("stale_spans", 0) for s in g.services)
    try:
        check_delivered(g, {k: v for k, v in due.items() if k in stored})
        check_replicas_equal(g)
    except AssertionError as exc:
        raise AssertionError(f"seed={seed} failovers={failovers}: {exc}") from None
    if seed in (11, 12, 13):  # known to exercise failovers and stale commands
        assert failovers and stale


def stored_ids(g: Group) -> set[str]:
    """Ids of the timer messages whose produce committed (dropped proposals never did)."""
    store = g.logs[0].store
    return {
        m.msg_id_hex
        for m in store.read_messages(tm.TIMER_TOPIC, 0, 0, 10**6)
        if tm.REAL_TOPIC in m.properties
    }


def test_pipelined_batches_drain_a_full_slot_in_order(make_group: Any) -> None:
    g = make_group(config(), max_inflight=4)
    due: dict[str, int] = {}
    t = g.clock.now_ms() + 500
    for _ in range(3_000):
        due[g.produce("t", t)] = t
    g.commit()
    g.run(t + 2_000, tick_ms=5, commit_every=3)
    check_delivered(g, due)
    check_replicas_equal(g)
    assert g.service.driver.commands >= 3_000 // 512


def test_the_observer_hears_deliveries_on_the_leader(make_group: Any) -> None:
    heard: list[tuple[list[tuple[str, str, int, int]], int]] = []
    g = make_group(on_delivered=lambda items, ms: heard.append((items, ms)))
    t = g.clock.now_ms() + 300
    ids = {g.produce("t", t) for _ in range(5)}
    g.run(t + 500)
    items = [i for batch, _ in heard for i in batch]
    assert {i[0] for i in items} == ids
    assert all(i[1] == "t" and i[3] == t for i in items)
    assert all(ms >= t for _, ms in heard)


# ---------------------------------------------------------------------- cancel


def committing(g: Group, call: Awaitable[T]) -> T:
    """Run a service call that waits for its command, committing while it waits."""

    async def go() -> T:
        task = asyncio.ensure_future(call)
        for _ in range(100):
            await asyncio.sleep(0)
            g.commit()
            if task.done():
                break
        return await task

    return asyncio.run(go())


def cancel(g: Group, msg_id: str) -> dict[str, Any]:
    return committing(g, g.service.cancel(msg_id))


def test_cancel_before_delivery_wins_and_after_says_delivered(make_group: Any) -> None:
    g = make_group()
    t = g.clock.now_ms() + 1_000
    keep = g.produce("t", t)
    gone = g.produce("t", t)
    later = g.produce("t", t + 5_000)
    g.commit()
    assert cancel(g, gone)["status"] == "cancelled"
    assert cancel(g, gone)["status"] == "cancelled"  # again: still cancelled, one tombstone
    g.run(t + 500)
    delivered = {m.msg_id_hex for m in g.delivered("t")}
    assert keep in delivered and gone not in delivered and later not in delivered
    assert cancel(g, keep)["status"] == "delivered"
    assert cancel(g, later)["status"] == "cancelled"
    g.run(t + 6_000)
    assert {m.msg_id_hex for m in g.delivered("t")} == {keep}
    counters = g.service.machine.committed().counters
    assert counters["tombstones"] == 2 and counters["cancelled"] == 2
    check_replicas_equal(g)


def test_a_cancel_committed_between_planning_and_delivery_still_wins(make_group: Any) -> None:
    g = make_group()
    t = g.clock.now_ms() + 200
    target = g.produce("t", t)
    g.run(t - 50)
    g.clock.set(t + PRECISION)
    g.step_leader()  # the delivery command is proposed, not committed
    assert g.pending
    answer = cancel(g, target)  # commits the delivery command first, then the cancel
    assert answer["status"] == "delivered"
    target2 = g.produce("t", t + 1_000)
    g.run(t + 900)
    g.clock.set(t + 1_000 + PRECISION)
    g.step_leader()
    planned = list(g.pending)
    assert planned, "the delivery of target2 should be planned and in flight"
    g.pending.clear()
    # The cancel reaches the log before the already planned delivery command.
    task_result: dict[str, Any] = {}

    async def go() -> None:
        task = asyncio.ensure_future(g.service.cancel(target2))
        await asyncio.sleep(0)
        g.commit()
        g.pending.extend(planned)
        g.commit()
        for _ in range(10):
            await asyncio.sleep(0)
        task_result.update(await task)

    asyncio.run(go())
    g.run(t + 3_000)
    assert task_result["status"] == "cancelled"
    assert target2 not in {m.msg_id_hex for m in g.delivered("t")}


def test_cancel_of_ids_that_are_not_timer_ids(make_group: Any) -> None:
    g = make_group()
    assert cancel(g, "00" * 16)["status"] == "unknown"
    with pytest.raises(InvalidInput) as err:
        cancel(g, "xyz")
    assert err.value.field == "msg_id"


# ---------------------------------------------------------------------- rolls


def test_delays_beyond_the_wheel_window_roll_and_arrive_on_time(make_group: Any) -> None:
    g = make_group(config(timer_roll_window_slots=10))  # a one-second window
    rng = random.Random(3)
    due: dict[str, int] = {}
    now = g.clock.now_ms()
    for _ in range(200):
        t = now + rng.randint(1_500, 12_000)
        due[g.produce("t", t)] = t
    rolled_cancel = g.produce("t", now + 9_000)
    g.commit()
    assert cancel(g, rolled_cancel)["status"] == "cancelled"
    g.run(now + 13_000, tick_ms=9)
    lateness = check_delivered(g, due)
    assert max(lateness) <= PRECISION + 9
    counters = g.service.machine.committed().counters
    assert counters["rolled"] >= 200
    check_replicas_equal(g)


# ---------------------------------------------------------------------- produce checks


def test_produce_checks_name_the_field(make_group: Any) -> None:
    g = make_group()
    svc, now = g.service, g.clock.now_ms()

    def hook(value: Any, field: str = "deliver_at_ms", topic: str = "t", queue: Any = None) -> Any:
        return svc.produce_hook(topic, b"x", queue, {}, field, value, now, "messages[3]", {})

    year = 365 * 86_400_000
    extra: dict[str, Any] = {}
    msg = svc.produce_hook("t", b"x", None, {"k": "v"}, "delay_ms", year, now, "m", extra)
    assert msg.topic == tm.TIMER_TOPIC and extra["deliver_ms"] == now + year
    assert msg.msg_id is not None and tm.timer_id_deliver_ms(msg.msg_id) == now + year
    assert msg.properties["REAL_TOPIC"] == "t" and msg.properties["k"] == "v"
    with pytest.raises(DelayTooLong) as too_long:
        hook(year + 1, "delay_ms")
    assert too_long.value.field == "messages[3].delay_ms"
    for bad in (-1, 1.5, True, "10"):
        with pytest.raises(InvalidDeliverTime) as err:
            hook(bad)
        assert err.value.field == "messages[3].deliver_at_ms"
    past = hook(now - 10_000)
    assert past.properties[tm.TIMER_OUT_MS] == str(now)  # a time in the past means now
    with pytest.raises(InvalidInput) as internal:
        hook(now, topic=tm.TIMER_TOPIC)
    assert internal.value.field == "topic"
    with pytest.raises(UnknownQueue) as queue:
        hook(now, queue=99)
    assert queue.value.field == "messages[3].queue"


def test_a_full_slot_refuses_more_and_refuses_more_often_as_it_fills(make_group: Any) -> None:
    g = make_group(config(timer_congest_num_each_slot=20))
    t = g.clock.now_ms() + 10_000
    for _ in range(20):
        g.produce("t", t)
    g.run(g.clock.now_ms() + 50)
    assert g.service.machine.files.wheel.get(t).count == 20
    with pytest.raises(SlotCongested) as err:
        for _ in range(200):
            g.produce("t", t)
    assert err.value.http_status == 429 and err.value.field == "messages[0].deliver_at_ms"
    assert g.service.rejected >= 1
    # Another slot is not affected.
    g.produce("t", t + 5 * PRECISION)


# ---------------------------------------------------------------------- switches


def switches(g: Group, **changes: bool) -> dict[str, bool]:
    return committing(g, g.service.set_switches(**changes))


def test_stop_and_start_dequeue_and_enqueue(make_group: Any) -> None:
    g = make_group()
    t = g.clock.now_ms() + 200
    due = {g.produce("t", t): t}
    assert switches(g, stop_dequeue=True) == {"stop_enqueue": False, "stop_dequeue": True}
    g.run(t + 1_000)
    assert not g.delivered("t")
    assert all(s.switches()["stop_dequeue"] for s in g.services)  # replicated
    switches(g, stop_dequeue=False, stop_enqueue=True)
    t2 = g.clock.now_ms() + 200
    due[g.produce("t", t2)] = t2
    g.run(t2 + 1_000)
    stats = g.service.stats()
    assert stats["offset_behind"] == 1 and len(g.delivered("t")) == 1
    switches(g, stop_enqueue=False)
    g.run(g.clock.now_ms() + 500)
    check_delivered(g, due)
    check_replicas_equal(g)


# ---------------------------------------------------------------------- restarts


def restart(g: Group, i: int, snapshot: bytes, after_index: int, fetch_from: int | None) -> None:
    """Replace replica ``i`` by a fresh process's view: reopen its files, restore
    ``snapshot``, register the timer (which realigns its files), replay the log after it."""
    from chronomq.raftlog.snapshot import FetchTarget
    from chronomq.raftlog.store import Store
    from tests.timer.fakes import FakeRaftLog

    g.logs[i].store.close()
    log = FakeRaftLog(g, i, g.root / f"r{i}")
    snap = Store.parse_snapshot(snapshot)
    source = g.logs[fetch_from if fetch_from is not None else (i + 1) % len(g.logs)].store

    def fetch(into: FetchTarget) -> None:
        into.write(source.commitlog.read_range(into.start, into.end))

    log.store.restore(snap, fetch)
    g.logs[i] = log
    service = g._service(i)
    if fetch_from is not None:
        service.machine.fetch = g.fetcher(fetch_from)
    g.services[i] = service
    service.register()
    for index, data in enumerate(g.applied[after_index:], start=after_index + 1):
        log.store.apply(data, index)


def traffic(g: Group, rng: random.Random, due: dict[str, int], ms: int) -> None:
    end = g.clock.now_ms() + ms
    while g.clock.now_ms() < end:
        for _ in range(rng.choice([0, 3])):
            t = g.clock.now_ms() + rng.randint(0, 2_000)
            due[g.produce("t", t)] = t
        g.clock.advance(rng.randint(5, 25))
        g.step_leader()
        g.commit()


def test_a_restart_from_the_snapshot_trusts_the_wheel_and_replays_the_rest(
    make_group: Any,
) -> None:
    g = make_group()
    rng = random.Random(5)
    due: dict[str, int] = {}
    traffic(g, rng, due, 2_000)
    snapshot = g.logs[1].store.snapshot({"s": None})
    snap_index = g.index
    traffic(g, rng, due, 2_000)
    restart(g, 1, snapshot, snap_index, fetch_from=None)
    align = g.services[1].machine.files.last_align
    assert align is not None and align.truncated_bytes > 0 and not align.rebuilt
    assert align.linked == 0  # the wheel file was exactly the snapshot's
    check_replicas_equal(g)
    g.run(g.clock.now_ms() + 3_000)
    check_delivered(g, due, replica=1)
    check_replicas_equal(g)


def test_a_crash_while_writing_the_wheel_rebuilds_it(make_group: Any) -> None:
    from chronomq.timer.files import DIRTY_MARKER

    g = make_group()
    rng = random.Random(6)
    due: dict[str, int] = {}
    traffic(g, rng, due, 2_000)
    snapshot = g.logs[2].store.snapshot({"s": None})
    snap_index = g.index
    (g.root / "r2" / "timer" / DIRTY_MARKER).touch()
    traffic(g, rng, due, 1_000)
    restart(g, 2, snapshot, snap_index, fetch_from=None)
    align = g.services[2].machine.files.last_align
    assert align is not None and align.linked > 0 and align.linked_from == 0
    check_replicas_equal(g)


def test_a_replica_that_installs_a_snapshot_rebuilds_the_timerlog_from_its_commitlog(
    make_group: Any,
) -> None:
    g = make_group()
    rng = random.Random(8)
    due: dict[str, int] = {}
    traffic(g, rng, due, 500)
    # Replica 2 loses its timer files (a wiped disk), then installs the leader's snapshot.
    snapshot = g.logs[0].store.snapshot({"s": None})
    snap_index = g.index
    traffic(g, rng, due, 1_000)
    import shutil

    g.logs[2].store.close()
    shutil.rmtree(g.root / "r2" / "timer")
    restart(g, 2, snapshot, snap_index, fetch_from=0)
    align = g.services[2].machine.files.last_align
    # A peer could serve it, but the node's own CommitLog holds a copy of every record.
    assert align is not None and align.local_records > 0 and align.fetched_records == 0
    check_replicas_equal(g)
    g.run(g.clock.now_ms() + 3_000)
    check_delivered(g, due, replica=2)


# ---------------------------------------------------------------------- odd commands


def test_malformed_commands_change_nothing_on_any_replica(make_group: Any) -> None:
    g = make_group()
    before = [log.store.digest() for log in g.logs]
    for payload in ([1, 2], {"span": [1, 2, 3]}, {"span": "x"}, {"cancel": [["a", 1], 5]}):
        g.logs[0].propose_extension("timer", payload)
    g.commit()
    after = [log.store.digest() for log in g.logs]
    assert [d["length"] for d in after] == [d["length"] for d in before]
    check_replicas_equal(g)


def test_timer_ids_carry_the_deliver_time_and_reject_others() -> None:
    rng = random.Random(1)
    ids = {tm.new_timer_id(T0, rng) for _ in range(1000)}
    assert len(ids) == 1000
    assert all(tm.timer_id_deliver_ms(i) == T0 for i in ids)
    plain = record.MessageIdSource(seed=2)
    assert sum(tm.timer_id_deliver_ms(plain.next_id(T0)) is not None for _ in range(1000)) <= 1


def test_a_node_with_other_wheel_settings_refuses_to_apply(make_group: Any) -> None:
    from chronomq.timer.errors import InvalidTimerConfig
    from chronomq.timer.machine import TimerMachine

    g = make_group()
    g.produce("t", g.clock.now_ms() + 100)
    g.run(g.clock.now_ms() + 300)
    odd = TimerMachine(g.root / "odd", config(timer_precision_ms=10))
    try:
        with pytest.raises(InvalidTimerConfig) as err:
            odd.attach(g.logs[0].store)
        assert err.value.field == "timer_precision_ms"
    finally:
        odd.close()


def test_an_idle_leader_proposes_a_command_only_every_idle_advance(make_group: Any) -> None:
    g = make_group()
    before = g.service.driver.commands
    g.run(g.clock.now_ms() + 60_000, tick_ms=7, commit_every=5)
    idle = g.service.driver.commands - before
    assert (
        60_000 // g.service.driver.idle_advance_ms - 2
        <= idle
        <= 60_000 // g.service.driver.idle_advance_ms + 2
    )
    stats = g.service.stats()
    assert stats["read_behind_ms"] < 2 * PRECISION  # the leader's reading is current


def test_a_backlog_larger_than_one_command_is_enqueued_while_delivery_is_stopped(
    make_group: Any,
) -> None:
    from chronomq.timer.machine import MAX_ENQUEUE_PER_COMMAND

    g = make_group()
    switches(g, stop_dequeue=True)
    t = g.clock.now_ms() + 1_000
    due = {g.produce("t", t): t for _ in range(2 * MAX_ENQUEUE_PER_COMMAND + 100)}
    g.commit()
    g.run(g.clock.now_ms() + 300)
    stats = g.service.stats()
    assert stats["offset_behind"] == 0 and stats["backlog"]["total"] == len(due)
    assert not g.delivered("t")
    switches(g, stop_dequeue=False)
    g.run(t + 1_000)
    check_delivered(g, due)


def test_a_checkpoint_newer_than_the_snapshot_restarted_from_is_not_trusted(
    make_group: Any,
) -> None:
    g = make_group()
    rng = random.Random(9)
    due: dict[str, int] = {}
    traffic(g, rng, due, 1_500)
    snapshot = g.logs[1].store.snapshot({"s": None})
    snap_index = g.index
    traffic(g, rng, due, 1_500)
    # The next snapshot's checkpoint is written, then the node dies before the snapshot is.
    g.services[1].machine.before_snapshot(g.index)
    traffic(g, rng, due, 500)
    restart(g, 1, snapshot, snap_index, fetch_from=None)
    align = g.services[1].machine.files.last_align
    assert align is not None and align.rebuilt and align.linked_from == 0
    check_replicas_equal(g)
    g.run(g.clock.now_ms() + 3_000)
    check_delivered(g, due, replica=1)
