"""The replicated membership history: bounded, numbered, total when damaged."""

from __future__ import annotations

from chronomq.cluster.node.membership import (
    HISTORY_MAX,
    HistoryEntry,
    append_history,
    describe,
    parse_history,
)


def entry(i: int, action: str = "add") -> HistoryEntry:
    return HistoryEntry(action, i, f"h:{i}", f"http://h:{i}", 1000 + i, 2)


def test_entries_are_numbered_and_the_oldest_dropped() -> None:
    value = None
    for i in range(HISTORY_MAX + 5):
        value = append_history(value, entry(i, "add" if i % 2 else "remove"))
    got = parse_history(value)
    assert len(got) == HISTORY_MAX
    assert got[0]["seq"] == 6 and got[-1]["seq"] == HISTORY_MAX + 5
    assert got[-1] == {
        "seq": HISTORY_MAX + 5,
        "action": "remove",
        "id": HISTORY_MAX + 4,
        "raft": f"h:{HISTORY_MAX + 4}",
        "http": f"http://h:{HISTORY_MAX + 4}",
        "at_ms": 1000 + HISTORY_MAX + 4,
        "term": 2,
    }
    assert "removed" in describe(got[-1])


def test_a_damaged_history_reads_empty() -> None:
    for value in (None, 3, "", "{", "{}", '[1, {"seq": "x"}]'):
        assert parse_history(value) == []
    assert parse_history(append_history("garbage", entry(1)))[0]["seq"] == 1
