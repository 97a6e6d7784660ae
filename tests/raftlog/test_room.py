"""When a node pauses for want of disk room and when it resumes (raftlog/room.py)."""

from __future__ import annotations

from types import SimpleNamespace

from chronomq.raftlog.room import (
    MIN_FLOOR_BYTES,
    Room,
    RoomGauge,
    RoomWatch,
    floor_bytes,
    resume_bytes,
)

MIB = 1 << 20
TOTAL = 96 * MIB


def test_the_floor_is_a_share_of_the_disk_and_never_below_the_minimum() -> None:
    assert floor_bytes(TOTAL) == MIN_FLOOR_BYTES
    assert floor_bytes(1000 * MIB) == 20 * MIB
    assert resume_bytes(TOTAL) == 2 * floor_bytes(TOTAL)


def test_a_write_that_would_cross_the_floor_pauses_until_twice_the_floor_is_free() -> None:
    watch = RoomWatch()
    assert watch.allows(Room(10 * MIB, TOTAL), 4 * MIB, 0.0)
    assert not watch.allows(Room(10 * MIB, TOTAL), 9 * MIB, 1.0)
    assert watch.pause is not None and watch.pause.since_s == 1.0
    assert "below the floor of 2.0 MiB" in watch.pause.reason
    # Paused: nothing, not even a heartbeat's nothing, until resume_bytes are free.
    assert not watch.allows(Room(3 * MIB, TOTAL), 0, 2.0)
    assert watch.allows(Room(5 * MIB, TOTAL), 0, 3.0)
    assert watch.pause is None and watch.pauses == 1


def test_an_enospc_pauses_at_once() -> None:
    watch = RoomWatch()
    watch.hit("writing journal failed: [Errno 28]", 5.0)
    assert not watch.allows(Room(3 * MIB, TOTAL), 0, 6.0)
    assert watch.allows(Room(50 * MIB, TOTAL), 0, 7.0)


def test_an_unknown_disk_is_not_guessed() -> None:
    assert RoomWatch().allows(Room(0, 0), 1 << 40, 0.0)


def test_the_gauge_samples_at_most_every_interval_and_subtracts_what_was_written() -> None:
    now = [0.0]
    calls = []

    def statvfs(path: str) -> SimpleNamespace:
        calls.append(path)
        return SimpleNamespace(f_bavail=100, f_blocks=1000, f_frsize=MIB)

    gauge = RoomGauge("/data", statvfs=statvfs, clock=lambda: now[0])
    assert gauge.room() == Room(100 * MIB, 1000 * MIB)
    gauge.spent(10 * MIB)
    assert gauge.room() == Room(90 * MIB, 1000 * MIB)
    assert len(calls) == 1
    now[0] = 1.0
    assert gauge.room() == Room(100 * MIB, 1000 * MIB)
    assert len(calls) == 2


def test_a_leader_sends_a_paused_follower_heartbeats_without_entries() -> None:
    from chronomq.raftlog.transport import GuardedTransport, without_entries

    append = {"type": "append_entries", "term": 3, "commit_index": 9, "prevLogIdx": 8}
    full = {**append, "entries": [(b"cmd", 9, 3)]}
    assert without_entries(full) == {**append, "entries": []}
    part = {**append, "transmission": "process", "data": b"x" * 10}
    assert without_entries(part) == {**append, "entries": []}
    chunk = {"type": "append_entries", "term": 3, "commit_index": 9, "serialized": (b"s", 1, 0)}
    assert without_entries(chunk)["serialized"] is None

    paused = {"node-b"}
    fake = SimpleNamespace(
        vote_fields=None,
        append_fields=lambda: {"lease": True},
        ack_fields=None,
        holds_entries=lambda node: node in paused,
    )
    assert GuardedTransport.marked(fake, full, "node-b") == {  # type: ignore[arg-type]
        **append,
        "entries": [],
        "lease": True,
    }
    assert GuardedTransport.marked(fake, full, "node-c")["entries"] == [(b"cmd", 9, 3)]  # type: ignore[arg-type]
