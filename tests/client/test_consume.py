"""The consumer's no-I/O pieces after a rewind (every node lost power under ``flush = async``,
the log lost its newest entries and their offsets were written again): the per-queue cursor
that sends ``prev`` and finds where the log diverged, and the bookkeeping that follows it."""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest

from chronomq import _api
from chronomq._consume import (
    MAX_EMPTY_SEARCH_READS,
    SEARCH_WAIT_MS,
    ConsumerState,
    FetchStart,
    QueueCursor,
    Rewind,
)
from chronomq._model import MessageData
from chronomq.errors import RequestError, api_error

TOPIC = "orders"


def ids(tag: str, offsets: range) -> dict[int, str]:
    """msg_ids as a node writes them: 32 upper-case hex digits, one per offset."""
    return {o: f"{tag}{o:031X}" for o in offsets}


class FakeLog:
    """A queue as nodes answer pulls of it: ``msg_ids[offset]`` from ``min_offset`` on."""

    def __init__(self, msg_ids: dict[int, str], min_offset: int = 0) -> None:
        self.msg_ids = msg_ids
        self.min_offset = min_offset

    @property
    def max_offset(self) -> int:
        return max(self.msg_ids, default=-1) + 1

    def answer(self, req: _api.Req) -> dict[str, Any]:
        q = params(req)
        start = max(int(q["offset"]), self.min_offset)
        offsets = [o for o in range(start, start + int(q["max"])) if o in self.msg_ids]
        messages = [{"msg_id": self.msg_ids[o], "offset": o} for o in offsets]
        return {
            "messages": messages,
            "next_offset": offsets[-1] + 1 if offsets else start,
            "max_offset": self.max_offset,
        }

    def diverged(self) -> RequestError:
        error = api_error(
            409,
            {
                "error": "offset_diverged",
                "field": "prev",
                "message": "the log lost its newest entries",
                "max_offset": self.max_offset,
                "min_offset": self.min_offset,
            },
        )
        assert isinstance(error, RequestError)
        return error


def params(req: _api.Req) -> dict[str, str]:
    return {k: v[0] for k, v in parse_qs(urlsplit(req.target).query).items()}


def read(cursor: QueueCursor, log: FakeLog) -> list[str]:
    """One pull answered from ``log``: the msg_ids handed out."""
    got = cursor.answered(log.answer(cursor.request()))
    assert got.rewind is None
    return [str(m["msg_id"]) for m in got.messages]


def rewind(cursor: QueueCursor, log: FakeLog) -> tuple[Rewind | None, int]:
    """The 409 for the cursor's pull, then its search answered from ``log``: the rewind it
    ended with and how many reads it took."""
    got = cursor.refused(log.diverged())
    assert got is not None and not got.messages
    return (got.rewind, 0) if got.rewind is not None else searched(cursor, log)


def searched(cursor: QueueCursor, log: FakeLog) -> tuple[Rewind | None, int]:
    """The search a 409 started, answered from ``log`` (at most 100 reads)."""
    for reads in range(1, 101):
        req = cursor.request()
        if "prev" in params(req):
            return None, reads - 1  # searching no more: nothing differed
        got = cursor.answered(log.answer(req))
        assert not got.messages, "a search hands nothing out"
        if got.rewind is not None:
            return got.rewind, reads
    raise AssertionError("the search did not end")


# ---------------------------------------------------------------------- the pull request


def test_a_pull_carries_prev_only_when_given() -> None:
    plain = _api.pull("%RETRY%default", 0, 7, 32, 5000)
    assert (
        plain.target
        == "/v1/topics/%25RETRY%25default/queues/0/messages?offset=7&max=32&wait_ms=5000"
    )
    assert plain.wait_ms == 5000 and plain.method == "GET"
    with_prev = _api.pull("t", 1, 7, 32, 0, prev="AB" * 16)
    assert params(with_prev) == {"offset": "7", "max": "32", "wait_ms": "0", "prev": "AB" * 16}


def test_every_pull_after_the_first_message_sends_the_msg_id_read_at_offset_minus_1() -> None:
    log = FakeLog(ids("A", range(0, 10)))
    cursor = QueueCursor(FetchStart(TOPIC, 0, 3), max_messages=4, wait_ms=5000, remember=5)
    assert "prev" not in params(cursor.request())  # nothing read yet
    assert read(cursor, log) == [log.msg_ids[o] for o in range(3, 7)]
    assert params(cursor.request()) == {
        "offset": "7",
        "max": "4",
        "wait_ms": "5000",
        "prev": log.msg_ids[6],
    }
    read(cursor, log)
    read(cursor, log)
    assert cursor.offset == 10 and read(cursor, log) == []  # the end: the same prev again
    assert params(cursor.request())["prev"] == log.msg_ids[9]
    # The memory is bounded: the latest ``remember`` offsets.
    assert cursor.remembered() == {o: log.msg_ids[o] for o in range(5, 10)}


def test_after_a_retention_gap_prev_is_the_last_message_read() -> None:
    log = FakeLog(ids("A", range(20, 25)), min_offset=20)
    cursor = QueueCursor(FetchStart(TOPIC, 0, 2), max_messages=2, wait_ms=0)
    assert read(cursor, log) == [log.msg_ids[20], log.msg_ids[21]]
    assert params(cursor.request())["prev"] == log.msg_ids[21]


def test_other_errors_are_not_a_rewind() -> None:
    log = FakeLog(ids("A", range(0, 4)))
    cursor = QueueCursor(FetchStart(TOPIC, 0, 0), max_messages=32, wait_ms=0)
    assert cursor.refused(log.diverged()) is None  # no prev was sent: not about this pull
    read(cursor, log)
    bad = api_error(400, {"error": "bad_request", "field": "prev", "message": "x"})
    other = api_error(409, {"error": "conflict", "message": "x"})
    assert cursor.refused(bad) is None and cursor.refused(other) is None
    assert cursor.refused(log.diverged()) is not None


# ---------------------------------------------------------------------- finding the divergence


def test_reading_resumes_at_the_first_offset_whose_message_changed() -> None:
    before = FakeLog(ids("A", range(0, 10)))
    cursor = QueueCursor(FetchStart(TOPIC, 0, 0), max_messages=3, wait_ms=5000)
    while cursor.offset < 10:
        read(cursor, before)
    # 0..5 kept, 6..9 lost; 6..13 written again by other messages.
    after = FakeLog({**ids("A", range(0, 6)), **ids("C", range(6, 14))})
    got = cursor.refused(after.diverged())
    assert got is not None and got.rewind is None and not got.messages
    # Read again without prev, from the oldest offset remembered.
    assert params(cursor.request()) == {"offset": "0", "max": "3", "wait_ms": str(SEARCH_WAIT_MS)}
    found, reads = searched(cursor, after)
    assert found == Rewind(TOPIC, 0, old_offset=10, offset=6, epoch=1, missed_before=None)
    assert reads == 3  # 0..2, 3..5, then 6 differs
    assert cursor.offset == 6 and cursor.epoch == 1
    assert cursor.remembered() == {o: before.msg_ids[o] for o in range(0, 6)}
    assert params(cursor.request())["prev"] == before.msg_ids[5]
    assert read(cursor, after) == [after.msg_ids[o] for o in range(6, 9)]
    text = found.describe()
    assert "orders/0" in text and "from offset 6 instead of 10" in text
    assert "missed" not in text


def test_a_log_that_ends_before_the_old_position_resumes_at_its_end() -> None:
    before = FakeLog(ids("A", range(0, 50)))
    cursor = QueueCursor(FetchStart(TOPIC, 0, 0), max_messages=1000, wait_ms=5000)
    read(cursor, before)
    # The leader answers: the queue ends at 30; 0..29 are what was read.
    after = FakeLog(ids("A", range(0, 30)))
    found, reads = rewind(cursor, after)
    assert found == Rewind(TOPIC, 0, 50, 30, 1) and reads == 1
    assert params(cursor.request())["max"] == "1000"
    # The search reads no further than the queue's end the node named.
    cursor2 = QueueCursor(FetchStart(TOPIC, 0, 0), max_messages=1000, wait_ms=5000)
    read(cursor2, before)
    cursor2.refused(after.diverged())
    assert params(cursor2.request())["max"] == "30"


def test_when_even_the_oldest_offset_remembered_changed_earlier_ones_may_be_missed() -> None:
    before = FakeLog(ids("A", range(0, 10)))
    cursor = QueueCursor(FetchStart(TOPIC, 0, 0), max_messages=32, wait_ms=0, remember=4)
    read(cursor, before)
    assert list(cursor.remembered()) == [6, 7, 8, 9]
    after = FakeLog({**ids("A", range(0, 3)), **ids("C", range(3, 12))})
    found, _ = rewind(cursor, after)
    assert found == Rewind(TOPIC, 0, 10, 6, 1, missed_before=6)
    assert cursor.remembered() == {} and "prev" not in params(cursor.request())
    assert "messages before offset 6 may have been missed" in found.describe()


def test_a_queue_that_now_ends_below_everything_remembered_resumes_at_its_end_at_once() -> None:
    before = FakeLog(ids("A", range(0, 10)))
    cursor = QueueCursor(FetchStart(TOPIC, 0, 0), max_messages=32, wait_ms=0, remember=4)
    read(cursor, before)
    got = cursor.refused(FakeLog(ids("A", range(0, 3))).diverged())
    assert got is not None
    assert got.rewind == Rewind(TOPIC, 0, 10, 3, 1, missed_before=3)
    assert params(cursor.request())["offset"] == "3"


def test_below_the_queue_minimum_nothing_is_compared_and_nothing_missed() -> None:
    before = FakeLog(ids("A", range(0, 10)))
    cursor = QueueCursor(FetchStart(TOPIC, 0, 0), max_messages=32, wait_ms=0)
    read(cursor, before)
    # Retention deleted 0..7; 8 was written again.
    after = FakeLog({8: "C" * 32, 9: "D" * 32}, min_offset=8)
    assert cursor.refused(after.diverged()) is not None
    assert params(cursor.request())["offset"] == "8"
    found, reads = searched(cursor, after)
    assert found == Rewind(TOPIC, 0, 10, 8, 1, missed_before=None) and reads == 1


def test_a_gap_in_the_log_is_where_reading_resumes() -> None:
    before = FakeLog(ids("A", range(0, 10)))
    cursor = QueueCursor(FetchStart(TOPIC, 0, 0), max_messages=32, wait_ms=0)
    read(cursor, before)
    after = FakeLog({o: m for o, m in before.msg_ids.items() if o != 4})
    found, _ = rewind(cursor, after)
    assert found is not None and found.offset == 4


def test_a_search_that_reads_nothing_stops_where_it_is_rather_than_skip() -> None:
    before = FakeLog(ids("A", range(0, 10)))
    cursor = QueueCursor(FetchStart(TOPIC, 0, 0), max_messages=4, wait_ms=0)
    read(cursor, before)
    read(cursor, before)
    read(cursor, before)
    assert cursor.refused(before.diverged()) is not None
    assert cursor.answered(before.answer(cursor.request())).rewind is None  # 0..3 the same
    empty = {"messages": [], "next_offset": 4, "max_offset": 4}
    for _ in range(MAX_EMPTY_SEARCH_READS - 1):
        assert params(cursor.request())["offset"] == "4"
        assert cursor.answered(empty).rewind is None
    got = cursor.answered(empty)
    assert got.rewind == Rewind(TOPIC, 0, 10, 4, 1)


def test_when_nothing_differs_reading_goes_on_without_a_rewind() -> None:
    log = FakeLog(ids("A", range(0, 10)))
    cursor = QueueCursor(FetchStart(TOPIC, 0, 0), max_messages=32, wait_ms=0)
    read(cursor, log)
    found, reads = rewind(cursor, log)
    assert found is None and reads == 1
    assert cursor.offset == 10 and cursor.epoch == 0
    assert params(cursor.request())["prev"] == log.msg_ids[9]


def test_a_cursor_needs_room_to_remember() -> None:
    with pytest.raises(ValueError):
        QueueCursor(FetchStart(TOPIC, 0, 0), 32, 0, remember=0)


# ---------------------------------------------------------------------- the bookkeeping


def msg(offset: int, tag: str = "A", queue: int = 0) -> MessageData:
    return MessageData(msg_id=f"{tag}{offset}", topic=TOPIC, queue=queue, offset=offset, body=b"")


def state_reading(offset: int = 0) -> ConsumerState:
    s = ConsumerState(
        "default",
        [TOPIC],
        start="earliest",
        auto_commit_interval_s=1.0,
        refresh_interval_s=5.0,
        now=0.0,
    )
    described = {"queues": [{"queue": 0, "min_offset": 0, "max_offset": 10}]}
    assert s.plan(TOPIC, described, []) == [FetchStart(TOPIC, 0, offset)]
    return s


def test_offsets_follow_the_resume_point_and_a_commit_moves_back() -> None:
    s = state_reading()
    key = (TOPIC, 0)
    for o in range(10):
        assert s.hand_out(msg(o))
    s.finish_in_hand()
    s.commit_done(key, 10)
    assert s.to_commit() == {}
    s.rewound(Rewind(TOPIC, 0, 10, 6, 1))
    assert s.to_commit() == {key: 6}  # below the 10 committed before: the log lost it
    assert (s.fetching[key], s.done[key], s.committed[key]) == (0, 6, 6)
    s.commit_done(key, 6)
    assert s.committed[key] == 6 and s.to_commit() == {}
    assert s.hand_out(msg(6, "C", 0), epoch=1) and s.hand_out(msg(7, "C"), epoch=1)
    assert s.to_commit() == {key: 7}


def test_messages_buffered_from_past_the_resume_point_are_dropped() -> None:
    s = state_reading()
    buffered = [msg(o) for o in range(10)]  # fetched in epoch 0, not handed out yet
    assert s.hand_out(buffered[0]) and s.hand_out(buffered[1])
    s.rewound(Rewind(TOPIC, 0, 10, 4, 1))  # a fetcher thread reports it
    handed = [m.offset for m in buffered[2:] if s.hand_out(m, epoch=0)]
    assert handed == [2, 3]  # the log still holds them; 4..9 were written again
    assert [o for o in (4, 5) if s.hand_out(msg(o, "C"), epoch=1)] == [4, 5]
    s.rewound(Rewind(TOPIC, 0, 8, 5, 2))  # again, before 5 was finished
    assert s.done[(TOPIC, 0)] == 5
    assert not s.hand_out(msg(6, "C"), epoch=1)
    assert s.hand_out(msg(5, "D"), epoch=2)
    assert s.to_commit() == {(TOPIC, 0): 5}


def test_a_message_in_hand_from_past_the_resume_point_finishes_nothing() -> None:
    s = state_reading()
    for o in range(8):
        s.hand_out(msg(o))
    s.rewound(Rewind(TOPIC, 0, 8, 3, 1))  # while the application holds offset 7
    s.finish_in_hand()
    assert s.done[(TOPIC, 0)] == 3 and s.in_hand is None
    s.finish(msg(6), epoch=0)  # sent back later: still nothing
    assert s.to_commit() == {(TOPIC, 0): 3}


def test_a_commit_asked_for_before_a_rewind_is_not_taken_for_what_the_group_holds() -> None:
    s = state_reading()
    key = (TOPIC, 0)
    for o in range(10):
        s.hand_out(msg(o))
    s.finish_in_hand()
    asked = s.to_commit()
    assert asked == {key: 10}
    s.rewound(Rewind(TOPIC, 0, 10, 6, 1))  # while that commit was on its way
    s.commit_done(key, asked[key])
    assert s.committed.get(key, -1) <= 6
    assert s.to_commit() == {key: 6}  # sent again, lower


def test_a_rewind_of_one_queue_leaves_the_others_alone() -> None:
    s = ConsumerState(
        "default",
        [TOPIC],
        start="earliest",
        auto_commit_interval_s=None,
        refresh_interval_s=5.0,
        now=0.0,
    )
    described = {"queues": [{"queue": q, "min_offset": 0, "max_offset": 9} for q in (0, 1)]}
    s.plan(TOPIC, described, [])
    for o in range(5):
        s.hand_out(msg(o, queue=0))
        s.hand_out(msg(o, queue=1))
    s.finish_in_hand()
    s.rewound(Rewind(TOPIC, 0, 5, 2, 1))
    assert s.to_commit() == {(TOPIC, 0): 2, (TOPIC, 1): 5}
    assert s.hand_out(msg(5, queue=1), epoch=0)


def test_the_warning_names_the_queue_and_both_positions() -> None:
    text = Rewind("%RETRY%billing", 3, 120, 97, 1).describe()
    assert text.startswith("%RETRY%billing/3: ")
    assert "from offset 97 instead of 120" in text and "flush = async" in text
