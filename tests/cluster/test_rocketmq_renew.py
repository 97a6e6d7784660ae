"""Renewal of auto_renew receives: the registry's decisions with a fake clock (no I/O), and the
driver against a fake leader (asyncio only, no sockets)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from rocketmq.grpc_protocol import service_pb2 as spb

from chronomq.cluster.config import keys as configkeys
from chronomq.cluster.config import nodeconfig as config
from chronomq.cluster.rocketmq import consume
from chronomq.cluster.rocketmq.autorenew import (
    BATCH,
    AutoRenewer,
    RenewAnswer,
    RenewStatus,
    sweep_period_s,
)
from chronomq.cluster.rocketmq.metrics import GrpcMetrics
from chronomq.cluster.rocketmq.renew import (
    CLIENT_EXPIRED_MS,
    RenewRegistry,
    StopReason,
    TokenBucket,
    Tracked,
)
from chronomq.cluster.rocketmq.rpc import client_id_of
from chronomq.pop import state

INV = 3_000  # the invisible time of each hand-out and renewal
T0 = 1_790_000_000_000


class Clock:
    """Milliseconds that only go forward."""

    def __init__(self, ms: int = T0) -> None:
        self.ms = ms

    def __call__(self) -> int:
        return self.ms

    def advance(self, ms: int) -> int:
        assert ms >= 0, "the clock does not go back"
        self.ms += ms
        return self.ms


def registry(**kw: int) -> RenewRegistry:
    args = {"invisible_ms": INV, "max_renew_ms": 60_000, "max_tracked": 100} | kw
    return RenewRegistry(**args)


def track(reg: RenewRegistry, handle: str, now: int, client: str = "c1", **kw: Any) -> list[Any]:
    return reg.track(
        handle,
        group=kw.get("group", "g"),
        topic=kw.get("topic", "t"),
        client_id=client,
        invisible_until_ms=kw.get("until", now + INV),
        now_ms=now,
    )


# ---------------------------------------------------------------------- the registry


def test_a_hand_out_is_due_when_less_than_a_third_of_its_time_is_left() -> None:
    reg = registry()
    track(reg, "h1", T0)
    assert reg.ahead_ms == 1_000
    assert reg.sweep(T0).due == ()
    assert reg.sweep(T0 + 1_999).due == ()  # 1,001 ms left
    (entry,) = reg.sweep(T0 + 2_000).due
    assert (entry.original, entry.current, entry.invisible_until_ms) == ("h1", "h1", T0 + INV)


def test_due_ones_come_most_urgent_first_and_past_their_time_too() -> None:
    reg = registry()
    track(reg, "late", T0, until=T0 + 100)
    track(reg, "soon", T0, until=T0 + 900)
    track(reg, "gone-by", T0, until=T0 - 50)  # the rate held it back: still renewed
    track(reg, "later", T0, until=T0 + 5_000)
    assert [e.original for e in reg.sweep(T0).due] == ["gone-by", "late", "soon"]


def test_a_renewal_keeps_the_first_handle_and_maps_it_to_the_newest() -> None:
    reg = registry()
    track(reg, "h1", T0)
    now = T0 + 2_500
    assert [e.original for e in reg.begin_renew(["h1"])] == ["h1"]
    assert reg.sweep(now).due == ()  # in flight: not due twice
    assert reg.renewed("h1", "h1-r1", now + INV)
    assert reg.sweep(now).due == ()  # 3 s left again
    entry = reg.get("h1")
    assert entry is not None and (entry.current, entry.renewals) == ("h1-r1", 1)
    now += 2_000
    reg.begin_renew(["h1"])
    assert reg.renewed("h1", "h1-r2", now + INV)
    # The client acks with the handle it received: the ack acts on the newest.
    assert reg.hold("h1", now) == "h1-r2"
    assert reg.sweep(now + 10_000).due == ()  # held: not renewed while the ack runs
    assert reg.release("h1", finished=True) is not None
    assert "h1" not in reg and len(reg) == 0 and reg.clients() == 0
    # An untracked handle is acted on as given.
    assert reg.hold("other", now) == "other"
    assert reg.release("other", finished=True) is None


def test_a_failed_client_call_lets_renewals_go_on() -> None:
    reg = registry()
    track(reg, "h1", T0)
    assert reg.hold("h1", T0) == "h1"
    assert reg.release("h1", finished=False) is None
    assert [e.original for e in reg.sweep(T0 + 2_000).due] == ["h1"]


def test_a_renewal_in_flight_must_end_before_a_client_call_acts() -> None:
    reg = registry()
    track(reg, "h1", T0)
    reg.begin_renew(["h1"])
    assert reg.renewing("h1")
    with pytest.raises(ValueError):
        reg.hold("h1", T0)
    reg.failed("h1")  # outcome unknown: try again when next due
    assert not reg.renewing("h1")
    assert reg.hold("h1", T0) == "h1"
    assert reg.begin_renew(["h1"]) == []  # held: a client call is acting on it


def test_a_refused_renewal_stops_tracking() -> None:
    reg = registry()
    track(reg, "h1", T0)
    reg.begin_renew(["h1"])
    assert reg.refused("h1") is not None
    assert "h1" not in reg and reg.refused("h1") is None
    assert not reg.renewed("h1", "x", T0)  # a late answer finds nothing


def test_a_client_not_heard_from_is_gone() -> None:
    reg = registry(max_renew_ms=10 * CLIENT_EXPIRED_MS)
    track(reg, "a", T0, client="alive")
    track(reg, "s", T0, client="silent")
    now = T0
    while now < T0 + CLIENT_EXPIRED_MS + 5_000:  # each renewed as it falls due
        now += 1_000
        reg.saw_client("alive", now)  # heartbeats
        for e in reg.sweep(now).due:
            reg.begin_renew([e.original])
            reg.renewed(e.original, e.current, now + INV)
    assert "a" in reg and "s" not in reg
    assert reg.clients() == 1


def test_the_sweep_says_why_it_stopped() -> None:
    reg = registry(max_renew_ms=10 * CLIENT_EXPIRED_MS)
    later = T0 + CLIENT_EXPIRED_MS
    track(reg, "kept", T0, until=later + 60_000)
    track(reg, "quiet", T0, client="quiet", until=later + 60_000)
    reg.saw_client("c1", later - 1)
    found = reg.sweep(later)
    assert [(e.original, why) for e, why in found.stopped] == [("quiet", StopReason.CLIENT_GONE)]
    assert found.due == () and list(reg._entries) == ["kept"]

    reg = registry(max_renew_ms=10_000)
    track(reg, "old", T0, until=T0 + 11_000)
    reg.saw_client("c1", T0 + 10_000)
    assert reg.sweep(T0 + 9_999).stopped == ()  # not due: nothing to decide yet
    found = reg.sweep(T0 + 10_000)  # due, and renewed for 10 s already: no more
    assert [(e.original, why) for e, why in found.stopped] == [("old", StopReason.MAX_TIME)]
    assert found.due == () and len(reg) == 0


def test_a_client_that_terminates_stops_its_renewals_only() -> None:
    reg = registry()
    for i in range(3):
        track(reg, f"a{i}", T0, client="a")
    track(reg, "b0", T0, client="b")
    assert {e.original for e in reg.client_gone("a")} == {"a0", "a1", "a2"}
    assert reg.client_gone("a") == [] and reg.client_gone("nobody") == []
    assert list(reg._entries) == ["b0"]


def test_the_registry_is_bounded_and_drops_the_oldest() -> None:
    reg = registry(max_tracked=3)
    for i in range(3):
        assert track(reg, f"h{i}", T0 + i) == []
    dropped = track(reg, "h3", T0 + 3)
    assert [e.original for e in dropped] == ["h0"]
    assert list(reg._entries) == ["h1", "h2", "h3"] and len(reg) == 3
    assert track(reg, "h3", T0 + 4) == []  # a repeat is not tracked twice
    # Clients are remembered only while they hold something: made-up ids add nothing.
    for i in range(1000):
        reg.saw_client(f"spray-{i}", T0)
    assert reg.clients() == 1


def test_arguments_are_checked() -> None:
    with pytest.raises(ValueError):
        registry(max_tracked=0)
    with pytest.raises(ValueError):
        TokenBucket(0, T0)


def test_the_token_bucket_bounds_the_rate() -> None:
    bucket = TokenBucket(100, T0)
    assert bucket.take(500, T0) == 100  # a second's worth at once
    assert bucket.take(10, T0) == 0
    assert bucket.take(10, T0 + 50) == 5
    assert bucket.take(10, T0 + 40) == 0  # a clock going back adds nothing
    assert bucket.take(1000, T0 + 60_050) == 100  # never more than the burst
    assert TokenBucket(1, T0, burst=0.1).take(5, T0) == 1


# ---------------------------------------------------------------------- the driver


class FakeLeader:
    """Answers renewals like the leader's ``chg``: a new handle per change, expired for the
    handles named in ``over``; ``gate`` holds answers back until set."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.calls: list[list[str]] = []
        self.over: set[str] = set()
        self.fail = False
        self.gate: asyncio.Event | None = None

    async def __call__(self, entries: Sequence[Tracked], invisible_ms: int) -> list[RenewAnswer]:
        self.calls.append([e.current for e in entries])
        if self.gate is not None:
            await self.gate.wait()
        if self.fail:
            raise ConnectionError("the leader did not answer")
        out = []
        for e in entries:
            if e.original in self.over:
                out.append(RenewAnswer(RenewStatus.EXPIRED))
            else:
                new = f"{e.original}-r{e.renewals + 1}"
                out.append(RenewAnswer(RenewStatus.CHANGED, new, self.clock() + invisible_ms))
        return out


def renewer(clock: Clock, leader: FakeLeader, **kw: int) -> tuple[AutoRenewer, CollectorRegistry]:
    metrics_registry = CollectorRegistry()
    args = {"max_renew_ms": 3_600_000, "max_tracked": 10_000, "max_per_second": 1_000} | kw
    r = AutoRenewer(leader, GrpcMetrics(metrics_registry), invisible_ms=INV, now_ms=clock, **args)
    return r, metrics_registry


def sample(metrics: CollectorRegistry, name: str, **labels: str) -> float:
    return metrics.get_sample_value(name, labels) or 0.0


def current(r: AutoRenewer, handle: str) -> str | None:
    entry = r.registry.get(handle)
    return None if entry is None else entry.current


async def test_due_hand_outs_are_renewed_in_batches_within_the_rate() -> None:
    clock = Clock()
    leader = FakeLeader(clock)
    r, metrics = renewer(clock, leader, max_per_second=100)
    handed = [(f"h{i}", T0 + INV) for i in range(150)]
    assert r.track("g", "t", "client-1", handed) == 150
    assert sample(metrics, "chronomq_grpc_auto_renew_tracked") == 150
    assert await r.sweep() == r.period_s and leader.calls == []  # not due yet
    clock.advance(2_100)
    assert await r.sweep() < r.period_s  # a backlog: look again soon
    assert [len(c) for c in leader.calls] == [BATCH, 100 - BATCH]
    assert sample(metrics, "chronomq_grpc_auto_renew_renewals_total") == 100
    assert sample(metrics, "chronomq_grpc_auto_renew_deferred_total") == 50
    clock.advance(500)  # 50 more tokens: the rest, which are the most urgent now
    await r.sweep()
    assert sample(metrics, "chronomq_grpc_auto_renew_renewals_total") == 150
    assert {current(r, h) for h, _ in handed} == {f"h{i}-r1" for i in range(150)}


async def test_an_ack_during_a_renewal_waits_and_acts_on_the_newest_handle() -> None:
    clock = Clock()
    leader = FakeLeader(clock)
    r, metrics = renewer(clock, leader)
    r.track("g", "t", "client-1", [("h1", T0 + INV)])
    clock.advance(2_500)
    leader.gate = asyncio.Event()
    sweeping = asyncio.create_task(r.sweep())
    while not leader.calls:
        await asyncio.sleep(0)
    acking = asyncio.create_task(r.hold(["h1"], 5.0))
    await asyncio.sleep(0)
    assert not acking.done()  # the renewal's outcome decides the handle
    leader.gate.set()
    assert await acking == ["h1-r1"]
    await sweeping
    r.release(["h1"], [StopReason.ACKED])
    assert len(r.registry) == 0
    assert sample(metrics, "chronomq_grpc_auto_renew_stopped_total", reason="acked") == 1
    assert sample(metrics, "chronomq_grpc_auto_renew_tracked") == 0


async def test_stale_and_failed_renewals() -> None:
    clock = Clock()
    leader = FakeLeader(clock)
    r, metrics = renewer(clock, leader)
    r.track("g", "t", "client-1", [("ok", T0 + INV), ("taken", T0 + INV)])
    leader.over = {"taken"}  # revived and handed to someone else meanwhile
    clock.advance(2_500)
    await r.sweep()
    assert "taken" not in r.registry and "ok" in r.registry
    assert sample(metrics, "chronomq_grpc_auto_renew_failures_total", reason="stale") == 1
    assert sample(metrics, "chronomq_grpc_auto_renew_stopped_total", reason="stale") == 1
    leader.fail = True
    clock.advance(2_500)
    await r.sweep()
    assert current(r, "ok") == "ok-r1" and not r.registry.renewing("ok")
    assert sample(metrics, "chronomq_grpc_auto_renew_failures_total", reason="error") == 1
    leader.fail = False
    await r.sweep()  # tried again
    assert current(r, "ok") == "ok-r2"


async def test_no_client_id_no_tracking_and_a_terminating_client_ends_it() -> None:
    clock = Clock()
    r, metrics = renewer(clock, FakeLeader(clock), max_tracked=2)
    assert r.track("g", "t", None, [("h0", T0 + INV)]) == 0
    assert r.track("g", "t", "x" * 1000, [("h0", T0 + INV)]) == 0
    assert r.track("g", "t", "c", [("h1", T0 + INV), ("h2", T0 + INV), ("h3", T0 + INV)]) == 3
    assert sample(metrics, "chronomq_grpc_auto_renew_stopped_total", reason="dropped") == 1
    r.client_gone("c")
    assert len(r.registry) == 0
    assert sample(metrics, "chronomq_grpc_auto_renew_stopped_total", reason="client_gone") == 2


async def test_the_driver_starts_and_stops() -> None:
    clock = Clock()
    leader = FakeLeader(clock)
    r, _ = renewer(clock, leader)
    r.start()
    r.track("g", "t", "c", [("h1", T0 + 100)])  # due at once: wakes the task
    for _ in range(1000):
        if leader.calls:
            break
        await asyncio.sleep(0.001)
    assert leader.calls == [["h1"]]
    await r.stop()
    await r.stop()  # twice is fine


def test_sweep_period() -> None:
    assert sweep_period_s(60_000) == 5.0  # RocketMQ's proxy sweeps every 5 s
    assert sweep_period_s(3_000) == 0.5
    assert sweep_period_s(1) == 0.05


# ---------------------------------------------------------------------- the edges


def test_an_auto_renew_receive_takes_the_node_s_invisible_time() -> None:
    req = spb.ReceiveMessageRequest(auto_renew=True)
    req.group.name = "g"
    req.message_queue.topic.name = "orders"
    req.invisible_duration.seconds = 30
    renewed = consume.receive_args(req, 1, None, auto_renew_invisible_ms=2_000, server_renews=True)
    assert renewed.invisible_ms == 2_000  # whatever it names, as RocketMQ's proxy
    assert consume.receive_args(req, 1, None).invisible_ms == 30_000  # renewal off
    req.ClearField("invisible_duration")
    assert consume.receive_args(req, 1, None, auto_renew_invisible_ms=5_000).invisible_ms == 5_000


class Context:
    def __init__(self, metadata: Any) -> None:
        self.metadata = metadata

    def invocation_metadata(self) -> Any:
        if isinstance(self.metadata, Exception):
            raise self.metadata
        return self.metadata


def test_the_client_id_comes_from_the_call_s_metadata() -> None:
    md = (("x-mq-language", "PYTHON"), ("x-mq-client-id", "host@1@0@abc"))
    assert client_id_of(Context(md)) == "host@1@0@abc"
    assert client_id_of(Context((("x-mq-client-id", "x" * 300),))) is None
    assert client_id_of(Context(())) is None
    assert client_id_of(Context(None)) is None
    assert client_id_of(Context(RuntimeError("over"))) is None
    assert client_id_of(None) is None


def test_config_bounds_match_pop() -> None:
    key = configkeys.KEY_BY_NAME["default_invisible_time_ms"]
    assert (key.min, key.max) == (state.MIN_INVISIBLE_MS, state.MAX_INVISIBLE_MS)
    assert key.default == consume.AUTO_RENEW_INVISIBLE_MS
    with pytest.raises(config.ConfigError) as e:
        config.load(overrides={"default_invisible_time_ms": 500})
    assert e.value.key == "default_invisible_time_ms"
    with pytest.raises(config.ConfigError) as e:
        config.load(overrides={"renew_max_tracked": 0})
    assert e.value.key == "renew_max_tracked"
