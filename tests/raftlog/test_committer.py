"""Group commit against a store applied in-process (no Raft)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from pysyncobj import FAIL_REASON

from chronomq.raftlog import command as cmdcodec
from chronomq.raftlog.committer import GroupCommitter, PendingBatch, split_batch
from chronomq.raftlog.errors import (
    CommitOutcomeUnknown,
    CommitTimeout,
    ConditionFailed,
    NotLeader,
    Overloaded,
    UnknownQueue,
)
from chronomq.raftlog.store import OK, Store

from ._util import STORE_MS, rec, wait_until

pytestmark = pytest.mark.timeout(30)
WAIT_S = 10


def batch(key: str, bodies: list[bytes], queue_id: int = 0, **kw: Any) -> PendingBatch:
    recs = [rec("t", queue_id, body, i) for i, body in enumerate(bodies)]
    return PendingBatch(
        key=key,
        topics=["t"],
        messages=[(0, queue_id, len(r)) for r in recs],
        blob=b"".join(recs),
        **kw,
    )


class InProcessRaft:
    """Proposals applied to a store on their own thread; the first can be held back."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.commands: list[cmdcodec.Command] = []
        self.hold_first = threading.Event()
        self.hold_first.set()
        self.fail_with: int | None = None
        self.swallow = False
        self._lock = threading.Lock()

    def propose(self, data: bytes, callback: Callable[[Any, int], None]) -> None:
        with self._lock:
            self.commands.append(cmdcodec.decode(data))
            index = len(self.commands)

        def run() -> None:
            if index == 1:
                self.hold_first.wait(WAIT_S)
            if self.swallow:
                return
            if self.fail_with is not None:
                callback(None, self.fail_with)
                return
            with self._lock:
                result = self.store.apply(data, index)
            callback(result, FAIL_REASON.SUCCESS)

        threading.Thread(target=run, daemon=True).start()


@pytest.fixture
def raft(tmp_path: Path) -> Iterator[InProcessRaft]:
    store = Store(tmp_path, segment_bytes=64 * 1024)
    Store.apply(store, cmdcodec.encode(_create_topic()), 0)
    yield InProcessRaft(store)
    store.close()


def _create_topic() -> cmdcodec.Command:
    return cmdcodec.Command(
        cmdcodec.Kind.APPEND, STORE_MS, batches=(cmdcodec.Batch("create", 0, creates={"t": 2}),)
    )


def committer(raft: InProcessRaft, **over: Any) -> GroupCommitter:
    kw: dict[str, Any] = {
        "max_messages": 100,
        "max_bytes": 1 << 20,
        "max_inflight": 1,
        "max_pending_messages": 1000,
        "commit_timeout_ms": 10_000,
        "now_ms": lambda: STORE_MS,
    }
    kw.update(over)
    return GroupCommitter(raft.propose, **kw)


def test_batches_waiting_together_share_one_command(raft: InProcessRaft) -> None:
    raft.hold_first.clear()
    gc = committer(raft)
    try:
        first = gc.submit(batch("first", [b"0"]))
        wait_until(lambda: len(raft.commands) == 1, WAIT_S, "the first command")
        rest = [gc.submit(batch(f"k{i}", [b"a", b"b"])) for i in range(5)]
        raft.hold_first.set()
        assert first.result(WAIT_S).status == OK
        outcomes = [f.result(WAIT_S) for f in rest]
        assert len(raft.commands) == 2
        assert [b.key for b in raft.commands[1].batches] == [f"k{i}" for i in range(5)]
        offsets = [p.queue_offset for o in outcomes for p in o.placed]
        assert offsets == list(range(1, 11))
    finally:
        gc.close()


def test_a_key_twice_in_one_command_answers_both_with_the_placement(raft: InProcessRaft) -> None:
    raft.hold_first.clear()
    gc = committer(raft)
    try:
        gc.submit(batch("first", [b"0"]))
        wait_until(lambda: len(raft.commands) == 1, WAIT_S, "the first command")
        original = gc.submit(batch("same", [b"a", b"b"]))
        retry = gc.submit(batch("same", [b"a", b"b"]))
        raft.hold_first.set()
        o1, o2 = original.result(WAIT_S), retry.result(WAIT_S)
        assert len(raft.commands) == 2
        assert len(o1.placed) == 2
        assert not o1.duplicate
        assert o2.duplicate
        assert o2.placed == o1.placed
    finally:
        gc.close()


def test_failed_conditions_and_bad_queues_become_errors(raft: InProcessRaft) -> None:
    gc = committer(raft)
    try:
        cond = gc.submit(batch("c", [b"x"], expect={"v": 1}))
        with pytest.raises(ConditionFailed):
            cond.result(WAIT_S)
        bad = gc.submit(batch("q", [b"x"], queue_id=5))
        with pytest.raises(UnknownQueue) as err:
            bad.result(WAIT_S)
        assert err.value.field == "queue"
    finally:
        gc.close()


def test_raft_failure_fails_the_batches(raft: InProcessRaft) -> None:
    raft.fail_with = FAIL_REASON.NOT_LEADER
    gc = committer(raft)
    try:
        with pytest.raises(NotLeader):
            gc.submit(batch("a", [b"x"])).result(WAIT_S)
    finally:
        gc.close()


def test_a_command_with_no_callback_times_out(raft: InProcessRaft) -> None:
    raft.swallow = True
    gc = committer(raft, commit_timeout_ms=50)
    try:
        with pytest.raises(CommitTimeout):
            gc.submit(batch("a", [b"x"])).result(WAIT_S)
    finally:
        gc.close()


def test_pending_messages_are_bounded(raft: InProcessRaft) -> None:
    raft.hold_first.clear()
    gc = committer(raft, max_pending_messages=3)
    try:
        gc.submit(batch("first", [b"0"]))
        wait_until(lambda: len(raft.commands) == 1, WAIT_S, "the first command")
        gc.submit(batch("a", [b"1", b"2"]))
        with pytest.raises(Overloaded):
            gc.submit(batch("b", [b"3", b"4"]))
        raft.hold_first.set()
    finally:
        gc.close()


def test_close_fails_what_is_waiting(raft: InProcessRaft) -> None:
    raft.hold_first.clear()
    gc = committer(raft)
    gc.submit(batch("first", [b"0"]))
    wait_until(lambda: len(raft.commands) == 1, WAIT_S, "the first command")
    waiting = gc.submit(batch("a", [b"1"]))
    gc.close()
    with pytest.raises(NotLeader):
        waiting.result(WAIT_S)
    with pytest.raises(NotLeader):
        gc.submit(batch("b", [b"x"]))
    raft.hold_first.set()


def test_close_answers_outcome_unknown_for_what_was_proposed(raft: InProcessRaft) -> None:
    raft.hold_first.clear()
    gc = committer(raft)
    proposed = gc.submit(batch("first", [b"0"]))
    wait_until(lambda: len(raft.commands) == 1, WAIT_S, "the first command")
    queued = gc.submit(batch("a", [b"1"]))
    gc.close()
    with pytest.raises(CommitOutcomeUnknown):  # it may still commit: retry with the key
        proposed.result(WAIT_S)
    with pytest.raises(NotLeader):  # never proposed
        queued.result(WAIT_S)
    raft.hold_first.set()


@pytest.mark.parametrize(
    ("reason", "error"),
    [
        (FAIL_REASON.NOT_LEADER, NotLeader),
        (FAIL_REASON.MISSING_LEADER, NotLeader),
        (FAIL_REASON.DISCARDED, NotLeader),  # another entry took its index: not committed
        (FAIL_REASON.LEADER_CHANGED, CommitOutcomeUnknown),  # may still commit
        (FAIL_REASON.UNKNOWN_OUTCOME, CommitTimeout),
    ],
)
def test_raft_failures_say_whether_the_outcome_is_known(
    raft: InProcessRaft, reason: int, error: type[Exception]
) -> None:
    raft.fail_with = reason
    gc = committer(raft)
    try:
        with pytest.raises(error) as got:
            gc.submit(batch("a", [b"x"])).result(WAIT_S)
        if error is NotLeader:
            assert not isinstance(got.value, CommitTimeout)
    finally:
        gc.close()


def test_pending_bytes_are_bounded_and_released(raft: InProcessRaft) -> None:
    raft.hold_first.clear()
    gc = committer(raft, max_pending_bytes=1000, max_inflight=4)
    try:
        first = gc.submit(batch("first", [b"x" * 600]))  # alone: always taken
        wait_until(lambda: len(raft.commands) == 1, WAIT_S, "the first command")
        assert gc.pending_bytes > 600
        assert gc.would_overload(600)
        with pytest.raises(Overloaded):
            gc.submit(batch("b", [b"y" * 600]))
        raft.hold_first.set()
        first.result(WAIT_S)
        wait_until(lambda: gc.pending_bytes == 0, WAIT_S, "the bytes released")
        assert gc.submit(batch("c", [b"z" * 600])).result(WAIT_S).status == OK
    finally:
        gc.close()


def test_new_batches_are_refused_while_commits_are_behind(raft: InProcessRaft) -> None:
    """Whatever the bytes held, a batch is refused (429, nothing stored) once the oldest one
    not yet answered has waited a quarter of the commit timeout: admitted, it would wait past
    the timeout on a node that commits that slowly, and be answered "outcome unknown"."""
    raft.hold_first.clear()
    gc = committer(raft, max_inflight=4)
    assert gc.max_behind_s == 2.5  # a quarter of commit_timeout_ms
    gc.max_behind_s = 0.05
    try:
        first = gc.submit(batch("first", [b"x"]))
        wait_until(lambda: len(raft.commands) == 1, WAIT_S, "the first command")
        wait_until(lambda: gc.behind() is not None, WAIT_S, "commits to fall behind")
        with pytest.raises(Overloaded, match="behind"):
            gc.submit(batch("b", [b"y"]))
        raft.hold_first.set()
        assert first.result(WAIT_S).status == OK
        wait_until(lambda: gc.behind() is None, WAIT_S, "commits to catch up")
        assert gc.submit(batch("c", [b"z"])).result(WAIT_S).status == OK
    finally:
        gc.close()


def test_split_batch_keeps_whole_messages_and_derives_keys() -> None:
    b = batch("k", [b"a" * 300, b"b" * 300, b"c" * 900, b"d" * 10], fingerprint="f" * 32)
    b.creates = {"t": 2}
    sizes = [n for _t, _q, n in b.messages]
    parts = split_batch(b, sizes[0] + sizes[1])
    assert [p.key for p in parts] == ["k#0", "k#1", "k#2"]
    assert [p.fingerprint for p in parts] == [f"{'f' * 32}#{i}" for i in range(3)]
    assert [[n for _t, _q, n in p.messages] for p in parts] == [sizes[:2], sizes[2:3], sizes[3:]]
    assert b"".join(p.blob for p in parts) == b.blob
    assert parts[0].creates == {"t": 2} and parts[1].creates is None
    assert split_batch(b, sum(sizes)) == [b]
    conditional = batch("c", [b"a" * 300, b"b" * 300], expect={"v": 0})
    assert split_batch(conditional, 100) == [conditional]


def test_a_large_batch_commits_as_several_commands_one_at_a_time(raft: InProcessRaft) -> None:
    gc = committer(raft, max_inflight=8, max_command_bytes=1500)
    inflight_peak = [0]
    propose = raft.propose

    def watching(data: bytes, cb: Callable[[Any, int], None]) -> None:
        inflight_peak[0] = max(inflight_peak[0], gc.inflight_commands)
        propose(data, cb)

    gc._propose = watching
    try:
        bodies = [bytes([65 + i]) * 1000 for i in range(4)]
        outcome = gc.submit(batch("big", bodies, fingerprint="e" * 32)).result(WAIT_S)
        assert [p.queue_offset for p in outcome.placed] == [0, 1, 2, 3]
        assert not outcome.duplicate
        assert len(raft.commands) == 4
        assert inflight_peak[0] == 1  # never two large commands on the wire at once
        again = gc.submit(batch("big", bodies, fingerprint="e" * 32)).result(WAIT_S)
        assert again.duplicate and again.placed == outcome.placed
    finally:
        gc.close()


def test_a_part_failing_after_another_committed_is_outcome_unknown(raft: InProcessRaft) -> None:
    gc = committer(raft, max_inflight=8, max_command_bytes=1500)
    propose = raft.propose

    def second_fails(data: bytes, cb: Callable[[Any, int], None]) -> None:
        if len(raft.commands) == 1:
            raft.fail_with = FAIL_REASON.NOT_LEADER
        propose(data, cb)

    gc._propose = second_fails
    try:
        bodies = [b"a" * 1000, b"b" * 1000]
        with pytest.raises(CommitOutcomeUnknown):
            gc.submit(batch("big", bodies, fingerprint="e" * 32)).result(WAIT_S)
    finally:
        gc.close()
