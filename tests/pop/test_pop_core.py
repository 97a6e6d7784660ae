"""The pop core with a fake clock: hand-out, ack, change, revive, DLQ, and the state codec."""

from __future__ import annotations

import pytest

from chronomq.pop import core, state
from chronomq.pop.core import AckStatus, ReviveAction
from chronomq.pop.handle import Handle, HandleCodec, InvalidHandle
from chronomq.pop.state import MAX_ACKED_MEMORY, MAX_HELD, QueueState
from chronomq.raftlog.clock import FakeClock

T0 = 1_700_000_000_000
INV = 30_000


def pop(st: QueueState, clock: FakeClock, n: int, pop_id: int, max_offset: int = 100):
    picked, _ = core.pick(
        st, n=n, pop_id=pop_id, until_ms=clock.now_ms() + INV, min_offset=0, max_offset=max_offset
    )
    return picked


def test_a_pop_hands_out_from_the_cursor_and_never_the_same_message_twice() -> None:
    clock, st = FakeClock(T0), QueueState()
    first = pop(st, clock, 3, pop_id=7)
    assert [(p.offset, p.attempt, p.pop_id) for p in first] == [(0, 1, 7), (1, 1, 7), (2, 1, 7)]
    assert first[0].until_ms == T0 + INV
    second = pop(st, clock, 5, pop_id=8, max_offset=5)
    assert [p.offset for p in second] == [3, 4]
    assert pop(st, clock, 5, pop_id=9, max_offset=5) == []
    assert st.cursor == 5 and len(st.inflight) == 5


def test_ack_is_idempotent_and_a_revived_handle_is_expired() -> None:
    clock, st = FakeClock(T0), QueueState()
    a, b = pop(st, clock, 2, pop_id=1)
    assert core.ack(st, a.offset, a.pop_id) is AckStatus.ACKED
    assert core.ack(st, a.offset, a.pop_id) is AckStatus.ALREADY_ACKED
    clock.advance(INV)
    action, _ = core.revive(st, b.offset, b.pop_id, now_ms=clock.now_ms(), max_reconsume_times=16)
    assert action is ReviveAction.REVIVED
    assert core.ack(st, b.offset, b.pop_id) is AckStatus.EXPIRED
    # A CK of the acked hand-out finds nothing.
    action, _ = core.revive(st, a.offset, a.pop_id, now_ms=clock.now_ms(), max_reconsume_times=16)
    assert action is ReviveAction.STALE


def test_a_revived_message_comes_back_first_with_the_next_attempt() -> None:
    clock, st = FakeClock(T0), QueueState()
    pop(st, clock, 2, pop_id=1)
    clock.advance(INV)
    assert core.revive(st, 1, 1, now_ms=clock.now_ms(), max_reconsume_times=16)[0] is (
        ReviveAction.REVIVED
    )
    again = pop(st, clock, 2, pop_id=2)
    assert [(p.offset, p.attempt) for p in again] == [(1, 2), (2, 1)]
    # The new hand-out's handle acks; the old one is stale.
    assert core.ack(st, 1, 1) is AckStatus.EXPIRED
    assert core.ack(st, 1, 2) is AckStatus.ACKED


def test_a_ck_not_due_by_this_commands_clock_is_rearmed() -> None:
    clock, st = FakeClock(T0), QueueState()
    (p,) = pop(st, clock, 1, pop_id=1)
    action, entry = core.revive(st, 0, 1, now_ms=p.until_ms - 1, max_reconsume_times=16)
    assert action is ReviveAction.REARM and entry is not None and entry.until_ms == p.until_ms
    assert 0 in st.inflight and not st.revived


def test_change_invisible_gives_a_new_pop_id_and_stales_the_old_handle_and_ck() -> None:
    clock, st = FakeClock(T0), QueueState()
    (p,) = pop(st, clock, 1, pop_id=1)
    changed = core.change(st, 0, 1, new_pop_id=5, until_ms=T0 + 90_000)
    assert changed is not None and changed.pop_id == 5 and changed.attempt == 1
    assert core.change(st, 0, 1, new_pop_id=6, until_ms=T0) is None
    clock.advance(INV)
    # The first CK falls due: stale. The new one is not due yet.
    assert core.revive(st, 0, 1, now_ms=clock.now_ms(), max_reconsume_times=16)[0] is (
        ReviveAction.STALE
    )
    assert core.revive(st, 0, 5, now_ms=clock.now_ms(), max_reconsume_times=16)[0] is (
        ReviveAction.REARM
    )
    assert core.ack(st, 0, 1) is AckStatus.EXPIRED
    assert core.ack(st, 0, 5) is AckStatus.ACKED


def test_after_max_reconsume_times_redeliveries_the_message_goes_to_the_dlq() -> None:
    clock, st = FakeClock(T0), QueueState()
    attempts = []
    for pop_id in range(1, 10):
        picked = pop(st, clock, 1, pop_id=pop_id, max_offset=1)
        if not picked:
            break
        attempts.append(picked[0].attempt)
        clock.advance(INV)
        action, entry = core.revive(st, 0, pop_id, now_ms=clock.now_ms(), max_reconsume_times=2)
    assert attempts == [1, 2, 3]  # the original and 2 re-deliveries
    assert action is ReviveAction.DLQ and entry is not None and entry.attempt == 3
    assert not st.inflight and not st.revived


def test_forward_to_dlq_on_demand_takes_only_the_current_hand_out() -> None:
    clock, st = FakeClock(T0), QueueState()
    pop(st, clock, 1, pop_id=1)
    assert core.take(st, 0, 2) is None
    taken = core.take(st, 0, 1)
    assert taken is not None and taken.attempt == 1
    assert core.take(st, 0, 1) is None
    assert core.ack(st, 0, 1) is AckStatus.EXPIRED


def test_held_messages_are_bounded_and_revived_ones_still_come_back() -> None:
    clock, st = FakeClock(T0), QueueState()
    got = 0
    for pop_id in range(1, 200):
        got += len(pop(st, clock, 32, pop_id=pop_id, max_offset=10_000))
    assert got == MAX_HELD and st.held == MAX_HELD
    assert core.visible(st, min_offset=0, max_offset=10_000) == 0
    clock.advance(INV)
    entry = st.inflight[5]
    core.revive(st, 5, entry.pop_id, now_ms=clock.now_ms(), max_reconsume_times=16)
    assert core.visible(st, min_offset=0, max_offset=10_000) == 1
    assert [p.offset for p in pop(st, clock, 32, pop_id=500, max_offset=10_000)] == [5]


def test_retention_moves_the_cursor_and_drops_deleted_revived_messages() -> None:
    clock, st = FakeClock(T0), QueueState()
    pop(st, clock, 2, pop_id=1)
    clock.advance(INV)
    core.revive(st, 0, 1, now_ms=clock.now_ms(), max_reconsume_times=16)
    picked, dropped = core.pick(st, n=2, pop_id=2, until_ms=0, min_offset=50, max_offset=100)
    assert dropped == 1 and [p.offset for p in picked] == [50, 51]


def test_ack_memory_is_bounded() -> None:
    clock, st = FakeClock(T0), QueueState()
    for pop_id in range(1, MAX_ACKED_MEMORY + 11):
        (p,) = pop(st, clock, 1, pop_id=pop_id, max_offset=10_000)
        assert core.ack(st, p.offset, p.pop_id) is AckStatus.ACKED
    assert len(st.acked) == MAX_ACKED_MEMORY
    assert core.ack(st, 0, 1) is AckStatus.EXPIRED  # forgotten
    assert core.ack(st, MAX_ACKED_MEMORY + 9, MAX_ACKED_MEMORY + 10) is AckStatus.ALREADY_ACKED


def test_state_round_trips_through_kv_and_garbage_decodes_to_a_reason() -> None:
    clock, st = FakeClock(T0), QueueState()
    pop(st, clock, 3, pop_id=4)
    core.ack(st, 0, 4)
    clock.advance(INV)
    core.revive(st, 1, 4, now_ms=clock.now_ms(), max_reconsume_times=16)
    text = state.encode(st)
    back, problem = state.decode(text)
    assert problem is None and back == st and state.encode(back) == text
    for bad in ("{", "[]", '{"c": -1}', '{"c": 0, "f": [[1, 2]]}', 7):
        empty, problem = state.decode(bad)
        assert problem is not None and empty.is_empty()
    assert state.parse_kv_key(state.kv_key("g-1", "%RETRY%x", 3)) == ("g-1", "%RETRY%x", 3)
    assert state.parse_kv_key("pop/revive") is None


def test_handles_round_trip_and_refuse_tampering_and_other_clusters() -> None:
    codec = HandleCodec(b"a cluster secret of some length")
    h = Handle("group-1", "orders", 3, 1 << 40, 123456, 2, T0 + INV)
    text = codec.encode(h)
    assert text.startswith("v1.") and codec.decode(text) == h
    with pytest.raises(InvalidHandle):
        HandleCodec(b"another cluster's secret").decode(text)
    raw = bytearray(text.encode())
    raw[10] = ord("A") if raw[10] != ord("A") else ord("B")
    for bad in (
        raw.decode(),
        text[:-4],
        "v1.!!!!",
        "v2." + text[3:],
        "",
        None,
        5,
        "v1." + "A" * 600,
    ):
        with pytest.raises(InvalidHandle):
            codec.decode(bad)


def test_a_filter_passes_over_other_tags_for_good_and_stops_where_it_has_not_looked() -> None:
    clock, st = FakeClock(T0), QueueState()
    verdicts = {0: False, 1: True, 2: False, 3: True, 4: False, 5: False, 6: True}
    picked, _ = core.pick(
        st, n=1, pop_id=1, until_ms=T0 + INV, min_offset=0, max_offset=10,
        accept=verdicts.get, max_skip=10,
    )  # fmt: skip
    assert [p.offset for p in picked] == [1] and st.cursor == 2
    picked, _ = core.pick(
        st, n=5, pop_id=2, until_ms=T0 + INV, min_offset=0, max_offset=10,
        accept=verdicts.get, max_skip=1,
    )  # fmt: skip
    assert [p.offset for p in picked] == [3] and st.cursor == 4  # skipped 2, stopped at 4
    picked, _ = core.pick(
        st, n=5, pop_id=3, until_ms=T0 + INV, min_offset=0, max_offset=10,
        accept=verdicts.get, max_skip=10,
    )  # fmt: skip
    assert [p.offset for p in picked] == [6] and st.cursor == 7  # 7 is unknown: stop
    assert clock.now_ms() == T0
