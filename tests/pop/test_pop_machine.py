"""Pop consumption on an in-process Raft group (real Stores, the real timer, a fake clock;
:mod:`tests.timer.fakes`): hand-out, ack, revive through the timer's wheel, DLQ, a failover
with old handles, a replayed log, and replicas that stay identical."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

import pytest

from chronomq.pop.core import AckStatus
from chronomq.pop.handle import InvalidHandle
from chronomq.pop.machine import NAME
from chronomq.pop.service import ChangeStatus, ForwardStatus, PopError, Popped, PopService
from chronomq.pop.state import REVIVE_TOPIC
from chronomq.raftlog.node import NewMessage
from chronomq.raftlog.store import Store
from chronomq.schedule.retry import dlq_topic
from tests.timer.fakes import Group
from tests.timer.test_service import config

T = TypeVar("T")
SECRET = b"pop test cluster secret"
INV = 5_000
TICK = 50


class PopGroup:
    """A timer :class:`Group` with a :class:`PopService` on every replica."""

    def __init__(self, root: Path, *, mrt: int = 16) -> None:
        self.g = Group(root, config())
        self.pops = [
            PopService(log, SECRET, max_reconsume_times=mrt)  # type: ignore[arg-type]
            for log in self.g.logs
        ]
        for p in self.pops:
            p.register()
        self.g.elect(0)
        self.settle()

    @property
    def pop(self) -> PopService:
        assert self.g.leader is not None
        return self.pops[self.g.leader]

    def settle(self) -> None:
        """Step the leader's drivers and commit until nothing more is proposed."""
        for _ in range(50):
            self.g.step_leader()
            if self.g.leader is not None:
                self.pop.step()
            if not self.g.commit():
                return
        raise AssertionError("did not settle")

    def run(self, until_ms: int) -> None:
        while self.g.clock.now_ms() < until_ms:
            self.g.clock.set(min(until_ms, self.g.clock.now_ms() + TICK))
            self.settle()

    def done(self, fut: Future[T]) -> T:
        self.g.commit()
        assert fut.done()
        return fut.result()

    def produce(self, topic: str, n: int, queues: int = 2) -> None:
        log = self.g.logs[self.g.leader or 0]
        creates = {topic: queues} if log.store.queue_count(topic) is None else {}
        msgs = [NewMessage(topic, f"m{i}".encode(), queue_id=i % queues) for i in range(n)]
        log.append(msgs, creates)
        self.g.commit()

    def receive(self, n: int, inv: int = INV, group: str = "g1") -> list[Popped]:
        return self.done(self.pop.receive(group, "orders", n, inv))

    def check_replicas(self) -> None:
        digests = {str(log.store.digest()) for log in self.g.logs}
        assert len(digests) == 1, digests
        assert len({p.machine.digest() for p in self.pops}) == 1

    def close(self) -> None:
        self.g.close()


@pytest.fixture
def make(tmp_path: Path) -> Iterator[Any]:
    made: list[PopGroup] = []

    def factory(**kw: Any) -> PopGroup:
        pg = PopGroup(tmp_path / f"p{len(made)}", **kw)
        made.append(pg)
        return pg

    yield factory
    for pg in made:
        pg.close()


def bodies(popped: list[Popped]) -> list[bytes]:
    return sorted(p.message.body for p in popped)


def test_receive_ack_and_revive_through_the_timer(make: Any) -> None:
    pg = make()
    pg.produce("orders", 4)
    got = pg.receive(3)
    assert len(got) == 3 and all(p.delivery_attempt == 1 for p in got)
    assert len({(p.queue, p.offset) for p in got}) == 3
    rest = pg.receive(8)
    assert len(rest) == 1  # the other three are invisible
    assert pg.receive(8) == []
    acks = pg.done(pg.pop.ack([got[0].receipt_handle, got[0].receipt_handle]))
    assert [a.status for a in acks] == [AckStatus.ACKED, AckStatus.ALREADY_ACKED]
    acks = pg.done(pg.pop.ack([rest[0].receipt_handle]))
    assert acks[0].status is AckStatus.ACKED
    t0 = pg.g.clock.now_ms()
    # Never before the invisible time...
    pg.run(got[1].invisible_until_ms - 1)
    assert pg.receive(8) == []
    # ...and back once it passed, through a CK the timer delivered to the revive topic.
    pg.run(got[1].invisible_until_ms + 400)
    assert pg.g.logs[0].store.max_offset(REVIVE_TOPIC, 0) >= 1
    again = pg.receive(8)
    assert bodies(again) == bodies(got[1:])
    assert all(p.delivery_attempt == 2 for p in again)
    assert pg.g.clock.now_ms() - t0 >= INV
    # The handles from before the revive are stale; the new ones ack.
    old = pg.done(pg.pop.ack([got[1].receipt_handle]))
    assert old[0].status is AckStatus.EXPIRED
    new = pg.done(pg.pop.ack([p.receipt_handle for p in again]))
    assert {a.status for a in new} == {AckStatus.ACKED}
    # Acked messages never come back.
    pg.run(pg.g.clock.now_ms() + 3 * INV)
    assert pg.receive(8) == []
    pg.check_replicas()


def test_change_invisible_and_forward_to_dlq(make: Any) -> None:
    pg = make()
    pg.produce("orders", 2)
    a, b = pg.receive(2)
    changed = pg.done(pg.pop.change_invisible(a.receipt_handle, 3 * INV))
    assert changed.status is ChangeStatus.CHANGED and changed.receipt_handle is not None
    assert pg.done(pg.pop.change_invisible(a.receipt_handle, INV)).status is ChangeStatus.EXPIRED
    fwd = pg.done(pg.pop.forward_to_dlq(b.receipt_handle))
    assert fwd.status is ForwardStatus.FORWARDED
    assert pg.done(pg.pop.forward_to_dlq(b.receipt_handle)).status is ForwardStatus.EXPIRED
    dlq = pg.g.delivered(dlq_topic("g1"))
    assert [m.body for m in dlq] == [b.message.body] and dlq[0].msg_id == b.message.msg_id
    # The first CK falls due and finds a changed hand-out: still invisible.
    pg.run(a.invisible_until_ms + 1000)
    assert pg.receive(2) == []
    pg.run(a.invisible_until_ms + 2 * INV + 1000)
    (back,) = pg.receive(2)
    assert back.offset == a.offset and back.delivery_attempt == 2
    pg.check_replicas()


def test_renewals_change_many_hand_outs_in_one_command(make: Any) -> None:
    """What a node's auto-renewer proposes: every handle given more time in one ``chg``,
    each answered for itself; the newest handle acks, the first one no longer does."""
    pg = make()
    pg.produce("orders", 3)
    a, b, c = pg.receive(3)
    assert pg.done(pg.pop.ack([c.receipt_handle]))[0].status is AckStatus.ACKED
    renewed = pg.done(
        pg.pop.change_invisible_many([a.receipt_handle, b.receipt_handle, c.receipt_handle], INV)
    )
    assert [r.status for r in renewed] == [
        ChangeStatus.CHANGED,
        ChangeStatus.CHANGED,
        ChangeStatus.EXPIRED,  # acked already: the hand-out is over
    ]
    new_a, new_b = renewed[0].receipt_handle, renewed[1].receipt_handle
    assert new_a is not None and new_b is not None and new_a != a.receipt_handle
    # One command: both got its Raft index as their new pop id.
    assert pg.pop.decode(new_a).pop_id == pg.pop.decode(new_b).pop_id
    assert renewed[0].invisible_until_ms is not None
    assert renewed[0].invisible_until_ms >= a.invisible_until_ms
    assert pg.done(pg.pop.ack([a.receipt_handle]))[0].status is AckStatus.EXPIRED
    assert pg.done(pg.pop.ack([new_a]))[0].status is AckStatus.ACKED
    with pytest.raises(PopError):
        pg.pop.change_invisible_many([], INV)
    pg.check_replicas()


def test_after_max_reconsume_times_the_message_goes_to_the_dlq(make: Any) -> None:
    pg = make(mrt=2)
    pg.produce("orders", 1, queues=1)
    attempts = []
    for _ in range(5):
        got = pg.receive(1)
        if not got:
            break
        attempts.append(got[0].delivery_attempt)
        pg.run(got[0].invisible_until_ms + 500)
    assert attempts == [1, 2, 3]
    (dead,) = pg.g.delivered(dlq_topic("g1"))
    assert dead.body == b"m0" and dead.reconsume_times == 3
    assert dead.properties["RETRY_TOPIC"] == "orders"
    pg.check_replicas()


def test_a_new_leader_keeps_invisible_messages_and_takes_old_handles(make: Any) -> None:
    pg = make()
    pg.produce("orders", 3)
    got = pg.receive(3)
    pg.g.elect(1)
    pg.settle()
    # Nothing is visible on the new leader either; an old handle acks there.
    assert pg.receive(3) == []
    assert pg.done(pg.pop.ack([got[0].receipt_handle]))[0].status is AckStatus.ACKED
    pg.g.elect(2)
    pg.settle()
    pg.run(got[0].invisible_until_ms + 500)
    again = pg.receive(3)
    assert bodies(again) == bodies(got[1:]) and {p.delivery_attempt for p in again} == {2}
    pg.check_replicas()


def test_a_replayed_log_rebuilds_the_same_pop_state(make: Any, tmp_path: Path) -> None:
    pg = make()
    pg.produce("orders", 4)
    got = pg.receive(4)
    pg.done(pg.pop.ack([got[0].receipt_handle]))
    pg.run(got[1].invisible_until_ms + 500)
    pg.receive(1)
    fresh = Store(tmp_path / "replay", segment_bytes=pg.g.segment_bytes)
    try:
        from chronomq.timer.machine import TimerMachine

        fresh.register_extension(TimerMachine(tmp_path / "replay-timer", pg.g.config))
        machine = PopService(pg.g.logs[0], SECRET).machine  # type: ignore[arg-type]
        fresh.register_extension(machine)
        for i, data in enumerate(pg.g.applied, start=1):
            fresh.apply(data, i)
        assert fresh.digest() == pg.g.logs[0].store.digest()
        assert machine.digest() == pg.pops[0].machine.digest()
    finally:
        fresh.close()


def test_bad_requests_and_handles_are_refused_before_proposing(make: Any) -> None:
    pg = make()
    pg.produce("orders", 1)
    pending = len(pg.g.pending)
    for kwargs in (
        {"group": "", "topic": "orders", "max_messages": 1, "invisible_ms": INV},
        {"group": "g/1", "topic": "orders", "max_messages": 1, "invisible_ms": INV},
        {"group": "g1", "topic": "nope", "max_messages": 1, "invisible_ms": INV},
        {"group": "g1", "topic": "orders", "max_messages": 0, "invisible_ms": INV},
        {"group": "g1", "topic": "orders", "max_messages": 33, "invisible_ms": INV},
        {"group": "g1", "topic": "orders", "max_messages": 1, "invisible_ms": 10},
    ):
        with pytest.raises(PopError) as info:
            pg.pop.receive(**kwargs)
        assert info.value.field in ("group", "topic", "max_message_num", "invisible_duration")
    with pytest.raises(InvalidHandle):
        pg.pop.ack(["v1.garbage"])
    other = PopService(pg.g.logs[0], b"another secret")  # type: ignore[arg-type]
    (p,) = pg.receive(1)
    with pytest.raises(InvalidHandle):
        other.decode(p.receipt_handle + "x")
    assert len(pg.g.pending) == pending
    # Garbage that reaches apply anyway is answered, the same on every replica.
    for payload in ({"op": "x"}, {"op": "pop"}, {"op": "ack", "items": [[1, 2]]}, [], None):
        pg.g.logs[0].propose_extension(NAME, payload)
    pg.g.commit()
    pg.check_replicas()


def test_a_tag_filter_hands_out_only_matching_messages(make: Any) -> None:
    from chronomq.raftlog.consumequeue import tags_hash

    pg = make()
    log = pg.g.logs[0]
    msgs = [
        NewMessage("orders", f"m{i}".encode(), 0, {"TAGS": tag}, tags_code=tags_hash(tag))
        for i, tag in enumerate(["a", "b", "a", "c", "b"])
    ]
    log.append(msgs, {"orders": 1})
    pg.g.commit()
    got = pg.done(pg.pop.receive("g1", "orders", 8, INV, tags=["b", "c"]))
    assert [p.message.body for p in got] == [b"m1", b"m3", b"m4"]
    other = pg.done(pg.pop.receive("g2", "orders", 8, INV, tags=["a"]))
    assert [p.message.body for p in other] == [b"m0", b"m2"]
    with pytest.raises(PopError):
        pg.pop.receive("g1", "orders", 8, INV, tags=[])
    pg.check_replicas()


def test_retention_keeps_held_messages_and_unread_cks(make: Any) -> None:
    from chronomq.pop.hold import lowest_needed_offset

    pg = make()
    store = pg.g.logs[0].store
    assert lowest_needed_offset(store) is None
    pg.produce("orders", 3, queues=1)
    a, b, c = pg.receive(3)
    pg.done(pg.pop.ack([a.receipt_handle]))
    unit = store.read_units("orders", 0, b.offset, 1)[0]
    assert lowest_needed_offset(store) == unit.commitlog_offset
    pg.done(pg.pop.ack([b.receipt_handle, c.receipt_handle]))
    assert lowest_needed_offset(store) is None


def test_producers_may_not_write_to_the_revive_topic() -> None:
    from chronomq.cluster.node import reserved
    from chronomq.cluster.node.errors import ApiError

    with pytest.raises(ApiError) as info:
        reserved.check_user_topic(REVIVE_TOPIC)
    assert info.value.status == 400 and "pop checkpoints" in info.value.message


def test_a_receive_may_name_one_queue(make: Any) -> None:
    pg = make()
    pg.produce("orders", 4)  # two per queue
    got = pg.done(pg.pop.receive("g1", "orders", 8, INV, queue=1))
    assert {p.queue for p in got} == {1} and len(got) == 2
    assert len(pg.done(pg.pop.receive("g1", "orders", 8, INV, queue=-1))) == 2
    with pytest.raises(PopError) as info:
        pg.pop.receive("g1", "orders", 8, INV, queue=2)
    assert info.value.field == "queue"


def test_metrics_show_held_messages_and_what_apply_did(make: Any) -> None:
    from prometheus_client import CollectorRegistry

    from chronomq.pop.metrics import install_metrics

    pg = make()
    pg.produce("orders", 3)
    a, _b, _c = pg.receive(3)
    pg.done(pg.pop.ack([a.receipt_handle]))
    registry = CollectorRegistry()
    collectors: list[Any] = []
    install_metrics(registry, collectors, pg.pop)
    for collect in collectors:
        collect()
    value = registry.get_sample_value
    assert value("chronomq_pop_held_messages", {"state": "inflight"}) == 2
    assert value("chronomq_pop_held_messages", {"state": "revived"}) == 0
    assert value("chronomq_pop_applied_total", {"what": "popped"}) == 3
    assert value("chronomq_pop_applied_total", {"what": "ack"}) == 1
    assert value("chronomq_pop_revive_behind") == 0


def test_visible_says_whether_a_receive_could_hand_out_something(make: Any) -> None:
    pg = make()
    pg.produce("orders", 1, queues=1)
    assert pg.pop.visible("g1", "orders")
    (p,) = pg.receive(1)
    assert not pg.pop.visible("g1", "orders")
    pg.run(p.invisible_until_ms + 500)
    assert pg.pop.visible("g1", "orders")
