"""Apply is total: whatever command is committed, two replicas reach the same state without
raising, and nothing is written outside their data directories.

Two :class:`chronomq.raftlog.store.Store` instances, each with the timer's apply extension and the
cluster's record rules (what a node runs), are fed the same commands: commands built from
random produce requests through the broker's parse path (the edge), random and mutated valid
``APPEND`` encodings aimed at the system topics, random bytes, and random timer commands. After
every command both must agree on the CommitLog digest, ConsumeQueue files and kv, and no file
may appear outside their data directories. Hypothesis prints the failing example and seed.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chronomq.cluster.config.nodeconfig import load
from chronomq.cluster.node import reserved
from chronomq.cluster.node.broker import Broker
from chronomq.cluster.node.errors import ApiError
from chronomq.raftlog import command as cmdcodec
from chronomq.raftlog import record
from chronomq.raftlog.errors import InvalidInput
from chronomq.raftlog.node import RaftLog
from chronomq.raftlog.store import OK, REJECTED, REJECTED_COUNT_KEY, Store
from chronomq.schedule import properties as sp
from chronomq.schedule.errors import CallerError
from chronomq.schedule.levels import SCHEDULE_TOPIC
from chronomq.timer import message as tm
from chronomq.timer.config import timer_config_from
from chronomq.timer.errors import TimerCallerError
from chronomq.timer.machine import TimerMachine

T0 = 1_800_000_000_000
SEG = 64 * 1024
OUTSIDE = "/tmp/chronomq-apply-total-outside"


class FixedClock:
    def __init__(self, now_ms: int) -> None:
        self.now = now_ms

    def now_ms(self) -> int:
        return self.now

    def monotonic_ms(self) -> float:
        return float(self.now)


def timer_config() -> Any:
    return timer_config_from(
        {
            "timer_precision_ms": 100,
            "timer_roll_window_slots": 600,
            "timer_max_delay_s": 86_400,
            "timer_congest_num_each_slot": 10**9,
            "timer_stop_enqueue": False,
            "timer_stop_dequeue": False,
        }
    )


class Replicas:
    """Two stores as two nodes would run them; ``apply`` feeds both the same command."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.stores: list[Store] = []
        self.index = 0
        for name in ("a", "b"):
            s = Store(root / name, segment_bytes=SEG)
            s.expected_extensions = frozenset(reserved.APPLY_EXTENSIONS)
            s.record_rules.update(reserved.apply_rules())
            s.extension_wait_s = 0.0
            s.register_extension(TimerMachine(root / name / "timer", timer_config()))
            self.stores.append(s)

    def apply(self, data: bytes) -> list[Any]:
        self.index += 1
        return [s.apply(data, self.index) for s in self.stores]

    def check_equal(self) -> None:
        a, b = self.stores
        assert a.digest() == b.digest()
        assert a.kv == b.kv
        assert a.topics == b.topics
        assert a.cqs.queues() == b.cqs.queues()
        for (topic, qid), n in a.cqs.queues().items():
            assert [u for u in a.cqs.read(topic, qid, 0, n)] == b.cqs.read(topic, qid, 0, n)
        assert not Path(OUTSIDE).exists()
        assert sorted(p.name for p in self.root.iterdir()) == ["a", "b"]

    def close(self) -> None:
        for s in self.stores:
            s.close()


@pytest.fixture
def replicas(tmp_path: Path) -> Iterator[Replicas]:
    r = Replicas(tmp_path)
    yield r
    r.close()


def append_command(
    messages: list[tuple[str, int, bytes]],
    *,
    key: str = "k",
    creates: dict[str, int] | None = None,
    propose_ms: int = T0,
) -> bytes:
    """An APPEND command of one batch; ``messages`` are (topic, queue, record bytes)."""
    topics: list[str] = []
    metas = []
    for topic, qid, data in messages:
        if topic not in topics:
            topics.append(topic)
        metas.append((topics.index(topic), qid, len(data)))
    return cmdcodec.encode(
        cmdcodec.Command(
            cmdcodec.Kind.APPEND,
            propose_ms,
            (cmdcodec.Batch(key, len(messages), None, None, creates),),
            tuple(topics),
            tuple(metas),
            b"".join(m[2] for m in messages),
        )
    )


def timer_record(props: dict[str, str], n: int = 1, deliver_ms: int = T0) -> bytes:
    return bytes(
        record.encode(
            topic=tm.TIMER_TOPIC,
            queue_id=0,
            msg_id=n.to_bytes(16, "big"),
            body=b"x",
            properties=props,
            store_ms=T0,
            born_ms=T0,
            tags_code=deliver_ms,
        )
    )


def schedule_record(props: dict[str, str], tags_code: int, n: int = 1) -> bytes:
    return bytes(
        record.encode(
            topic=SCHEDULE_TOPIC,
            queue_id=0,
            msg_id=n.to_bytes(16, "big"),
            body=b"x",
            properties=props,
            store_ms=T0,
            born_ms=T0,
            tags_code=tags_code,
        )
    )


CREATES = {tm.TIMER_TOPIC: 1, SCHEDULE_TOPIC: 18, "real": 4}


# ---------------------------------------------------------------------- the probes


@pytest.mark.parametrize(
    ("props", "field"),
    [
        ({"REAL_TOPIC": "nosuch", "REAL_QID": "5000"}, "REAL_QID"),
        ({"REAL_TOPIC": "real", "REAL_QID": "4"}, "REAL_QID"),
        ({"REAL_TOPIC": "real", "REAL_QID": "\u00b2"}, "REAL_QID"),
        ({"REAL_TOPIC": "re\x00al", "REAL_QID": "0"}, "REAL_TOPIC"),
        ({"REAL_TOPIC": OUTSIDE, "REAL_QID": "0"}, "REAL_TOPIC"),
        ({"REAL_TOPIC": "../../x", "REAL_QID": "0"}, "REAL_TOPIC"),
        ({"REAL_TOPIC": SCHEDULE_TOPIC, "REAL_QID": "0"}, "REAL_TOPIC"),
        ({"REAL_TOPIC": tm.TIMER_TOPIC, "REAL_QID": "0"}, "REAL_TOPIC"),
        (
            {"REAL_TOPIC": "real", "REAL_QID": "0", "TIMER_DEL_UNIQKEY": "A" * 32},
            "TIMER_DEL_UNIQKEY",
        ),
    ],
)
def test_a_timer_record_with_a_bad_destination_is_rejected_naming_the_property(
    replicas: Replicas, props: dict[str, str], field: str
) -> None:
    full = {"TIMER_OUT_MS": "1", **props}
    results = replicas.apply(
        append_command([(tm.TIMER_TOPIC, 0, timer_record(full))], creates=CREATES)
    )
    for res in results:
        (out,) = res.outcomes
        assert out.status == REJECTED
        assert out.field == f"messages[0].properties.{field}"
    replicas.check_equal()
    assert replicas.stores[0].kv[REJECTED_COUNT_KEY] == 1
    assert replicas.stores[0].max_offset(tm.TIMER_TOPIC, 0) == 0
    # The node goes on: the timer's next command and a good produce apply.
    replicas.apply(
        cmdcodec.encode(
            cmdcodec.Command(cmdcodec.Kind.EXTENSION, T0, extra={"e": "timer", "p": {"enq": 10}})
        )
    )
    good = timer_record({"TIMER_OUT_MS": "1", "REAL_TOPIC": "real", "REAL_QID": "1"}, n=2)
    (res, _) = replicas.apply(
        append_command([(tm.TIMER_TOPIC, 0, good)], key="k2", creates=CREATES)
    )
    assert res.outcomes[0].status == OK
    replicas.apply(
        cmdcodec.encode(
            cmdcodec.Command(
                cmdcodec.Kind.EXTENSION, T0 + 10, extra={"e": "timer", "p": {"enq": 10}}
            )
        )
    )
    replicas.check_equal()
    assert replicas.stores[0].max_offset("real", 1) == 1  # due at 1: delivered at once


def test_a_schedule_record_due_in_2_to_the_62_is_rejected(replicas: Replicas) -> None:
    props = {sp.REAL_TOPIC: "real", sp.REAL_QID: "0", sp.DELAY: "1"}
    (res, _) = replicas.apply(
        append_command([(SCHEDULE_TOPIC, 0, schedule_record(props, 1 << 62))], creates=CREATES)
    )
    assert res.outcomes[0].status == REJECTED
    assert res.outcomes[0].field == "messages[0].delay_level"
    (res, _) = replicas.apply(
        append_command(
            [(SCHEDULE_TOPIC, 0, schedule_record(props, T0 + 1000))], key="k2", creates=CREATES
        )
    )
    assert res.outcomes[0].status == OK
    replicas.check_equal()


def test_a_stored_timer_message_with_a_bad_destination_is_dropped_when_enqueued(
    tmp_path: Path,
) -> None:
    """Records stored before the rules (no rules here) are dropped by the timer, counted, on
    every replica alike, and no ConsumeQueue appears outside the data directory."""
    r = Replicas(tmp_path)
    try:
        for s in r.stores:
            s.record_rules.clear()
        bad = [
            {"TIMER_OUT_MS": "1", "REAL_TOPIC": "nosuch", "REAL_QID": "5000"},
            {"TIMER_OUT_MS": "1", "REAL_TOPIC": "real", "REAL_QID": "\u00b2"},
            {"TIMER_OUT_MS": "1", "REAL_TOPIC": OUTSIDE, "REAL_QID": "0"},
            {"TIMER_OUT_MS": "1", "REAL_TOPIC": "a\x00b", "REAL_QID": "0"},
        ]
        for i, props in enumerate(bad):
            r.apply(
                append_command(
                    [(tm.TIMER_TOPIC, 0, timer_record(props, n=i + 1))],
                    key=f"k{i}",
                    creates=CREATES,
                )
            )
        (res, _) = r.apply(
            cmdcodec.encode(
                cmdcodec.Command(
                    cmdcodec.Kind.EXTENSION, T0, extra={"e": "timer", "p": {"enq": 99}}
                )
            )
        )
        assert res.ext.invalid is None
        r.check_equal()
        assert r.stores[0].kv.get("timer/n/skipped") == len(bad)
        assert set(r.stores[0].topics) == set(CREATES)
    finally:
        r.close()


def test_a_command_for_an_extension_the_cluster_does_not_run_is_rejected_at_once(
    replicas: Replicas,
) -> None:
    data = cmdcodec.encode(
        cmdcodec.Command(cmdcodec.Kind.EXTENSION, T0, extra={"e": "nosuch", "p": {}})
    )
    for res in replicas.apply(data):
        assert res.outcomes == ()
    assert replicas.stores[0].kv[REJECTED_COUNT_KEY] == 1
    replicas.check_equal()


# ---------------------------------------------------------------------- property-based

CHECKS = settings(
    max_examples=40,
    deadline=None,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

TOPICS = st.sampled_from(
    ["real", "t-1", tm.TIMER_TOPIC, SCHEDULE_TOPIC, "", "../x", OUTSIDE, "a\x00b", "%RETRY%g"]
)
VALUES = st.one_of(
    st.sampled_from(["0", "1", "3", "5000", "\u00b2", "-1", "", "1e3", " 1", str(1 << 62)]),
    st.text(max_size=8),
)
PROPS = st.dictionaries(
    st.sampled_from(
        [
            "TIMER_OUT_MS",
            "REAL_TOPIC",
            "REAL_QID",
            "DELAY",
            "TIMER_ROLL_TIMES",
            "TIMER_DEL_UNIQKEY",
            "TIMER_ENQUEUED",
            "KEYS",
            "TAGS",
            "x",
        ]
    ),  # fmt: skip
    st.one_of(VALUES, TOPICS),
    max_size=5,
)


@st.composite
def system_records(draw: Any) -> tuple[str, int, bytes]:
    """A valid record aimed at a system or user topic with random (often hostile) properties."""
    topic = draw(st.sampled_from(["real", tm.TIMER_TOPIC, SCHEDULE_TOPIC]))
    qid = draw(st.integers(0, 3))
    props = {k: v.replace("\x01", "").replace("\x02", "") for k, v in draw(PROPS).items()}
    tags = draw(st.sampled_from([0, T0, T0 + 500, 1 << 62, -1]))
    data = bytes(
        record.encode(
            topic=topic,
            queue_id=qid,
            msg_id=draw(st.binary(min_size=16, max_size=16)),
            body=draw(st.binary(max_size=16)),
            properties=props,
            store_ms=T0,
            born_ms=T0,
            tags_code=tags,
        )
    )
    return topic, qid, data


@st.composite
def mutated(draw: Any, data: bytes) -> bytes:
    out = bytearray(data)
    for _ in range(draw(st.integers(1, 4))):
        if not out:
            break
        at = draw(st.integers(0, len(out) - 1))
        how = draw(st.integers(0, 2))
        if how == 0:
            out[at] = draw(st.integers(0, 255))
        elif how == 1:
            del out[at : at + draw(st.integers(1, 8))]
        else:
            out[at:at] = draw(st.binary(min_size=1, max_size=8))
    return bytes(out)


@st.composite
def raw_commands(draw: Any) -> bytes:
    kind = draw(st.integers(0, 5))
    if kind == 0:
        return bytes(draw(st.binary(max_size=64)))
    if kind == 1:
        payload = draw(
            st.one_of(
                st.fixed_dictionaries({"enq": st.integers(-2, 50)}),
                st.fixed_dictionaries(
                    {
                        "cancel": st.lists(
                            st.tuples(st.text(max_size=33), st.integers(-1, 1 << 50)).map(list),
                            max_size=3,
                        )
                    }
                ),
                st.fixed_dictionaries({"span": st.lists(st.integers(-1, 1 << 45), max_size=10)}),
                st.just([1, 2]),
            )
        )
        name = draw(st.sampled_from(["timer", "timer", "nosuch", ""]))
        return cmdcodec.encode(
            cmdcodec.Command(
                cmdcodec.Kind.EXTENSION,
                T0 + draw(st.integers(0, 5000)),
                extra={"e": name, "p": payload},
            )
        )
    recs = draw(st.lists(system_records(), min_size=1, max_size=4))
    creates = draw(st.sampled_from([CREATES, {}, {"x/y": 2}, {"real": 5000}]))
    key = f"k{draw(st.integers(0, 1 << 30))}"
    data = append_command(
        recs, key=key, creates=creates, propose_ms=T0 + draw(st.integers(0, 5000))
    )
    if kind >= 4:
        return bytes(draw(mutated(data)))
    return data


@given(commands=st.lists(raw_commands(), min_size=1, max_size=12))
@CHECKS
def test_any_raw_command_applies_alike_on_two_replicas(
    tmp_path_factory: Any, commands: list[bytes]
) -> None:
    r = Replicas(tmp_path_factory.mktemp("raw"))
    try:
        r.apply(append_command([], key="init", creates=CREATES))
        for data in commands:
            r.apply(data)  # raises only for a fault of the node: none here
            r.check_equal()
    finally:
        r.close()


# ---------------------------------------------------------------------- through the edge


class _Ids:
    def __init__(self) -> None:
        self._n = itertools.count(1)

    def next_id(self, store_ms: int) -> bytes:
        return next(self._n).to_bytes(16, "big")


def _edge(store: Store) -> tuple[Broker, Any]:
    config = load(None, environ={}, overrides={"allow_insecure": True, "auto_create_topic": True})
    fake = SimpleNamespace(
        store=store,
        clock=FixedClock(T0),
        config=SimpleNamespace(max_message_bytes=config.max_message_bytes),
        auto_create_topics=True,
        _rr={},
        _ids=_Ids(),
        add_apply_listener=lambda _f: None,
    )
    broker = Broker(config, fake)  # type: ignore[arg-type]
    return broker, fake


def _edge_command(broker: Broker, fake: Any, topic: str, raw: Any, n: int) -> bytes | None:
    """What the leader would propose for one produce request, or None when the edge refuses."""
    try:
        messages, _extras, store_ms = broker.parse_messages(topic, raw)
        creates: dict[str, int] = {}
        if fake.store.queue_count(topic) is None:
            creates[topic] = 4
        if any(m.topic == SCHEDULE_TOPIC for m in messages):
            broker._create_schedule_topic(creates)
        topics, metas, blob, auto = RaftLog.prepare(fake, messages, store_ms, creates)
    except (ApiError, InvalidInput, CallerError, TimerCallerError):
        return None
    return cmdcodec.encode(
        cmdcodec.Command(
            cmdcodec.Kind.APPEND,
            store_ms,
            (cmdcodec.Batch(f"edge{n}", len(metas), None, None, {**auto, **creates} or None),),
            tuple(topics),
            tuple(metas),
            blob,
        )
    )


JSON_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-5, 5000), st.text(max_size=6))
MESSAGES = st.lists(
    st.tuples(
        st.booleans(),
        st.dictionaries(
            st.sampled_from(["body", "keys", "tags", "properties", "queue", "delay_level", "x"]),
            st.one_of(JSON_SCALARS, st.lists(JSON_SCALARS, max_size=2), PROPS),
            max_size=5,
        ),
    ).map(lambda bm: {"body": "b", **bm[1]} if bm[0] else bm[1]),
    max_size=3,
)


@given(requests=st.lists(st.tuples(TOPICS, MESSAGES), min_size=1, max_size=8))
@settings(CHECKS, max_examples=25)
def test_what_the_edge_accepts_applies_alike_and_keeps_the_rules(
    tmp_path_factory: Any, requests: list[tuple[str, Any]]
) -> None:
    r = Replicas(tmp_path_factory.mktemp("edge"))
    try:
        broker, fake = _edge(r.stores[0])
        for n, (topic, raw) in enumerate(requests):
            data = _edge_command(broker, fake, topic, raw, n)
            if data is None:
                continue
            for res in r.apply(data):
                # The edge and apply agree: what the edge let through is stored.
                assert [o.status for o in res.outcomes] == [OK], res.outcomes
            r.check_equal()
    finally:
        r.close()


def test_the_edge_rejects_what_apply_would(replicas: Replicas) -> None:
    broker, fake = _edge(replicas.stores[0])
    assert _edge_command(broker, fake, tm.TIMER_TOPIC, [{"body": "x"}], 0) is None
    props = {"TIMER_OUT_MS": "1", "REAL_TOPIC": "nosuch", "REAL_QID": "5000"}
    assert _edge_command(broker, fake, "real", [{"body": "x", "properties": props}], 1) is None
    ok = _edge_command(broker, fake, "real", [{"body": "x", "delay_level": 2}], 2)
    assert ok is not None
    assert [o.status for o in replicas.apply(ok)[0].outcomes] == [OK]
