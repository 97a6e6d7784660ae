"""Group commit against a store applied in-process (no Raft)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from pysyncobj import FAIL_REASON

from raftlog import command as cmdcodec
from raftlog.committer import GroupCommitter, PendingBatch
from raftlog.errors import CommitTimeout, ConditionFailed, NotLeader, Overloaded, UnknownQueue
from raftlog.store import OK, Store

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
