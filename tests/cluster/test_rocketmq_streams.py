"""The Telemetry stream caps of :mod:`chronomq.cluster.rocketmq.streams`."""

from __future__ import annotations

import pytest

from chronomq.cluster.rocketmq.streams import Refused, StreamLimits, TelemetryStreams


def test_a_client_ids_next_stream_closes_its_oldest() -> None:
    held = TelemetryStreams(StreamLimits(total=100, per_client=2, per_connection=10))
    closed: list[int] = []
    tickets = [held.admit("c", f"conn-{i}", lambda i=i: closed.append(i)) for i in range(4)]
    assert closed == [0, 1] and len(held) == 2
    held.release(tickets[0])  # already closed: nothing more
    held.release(tickets[3])
    held.release(tickets[3])
    assert len(held) == 1


def test_a_connection_and_the_node_refuse_past_their_caps() -> None:
    held = TelemetryStreams(StreamLimits(total=5, per_client=8, per_connection=3))
    tickets = [held.admit(f"c{i}", "conn-a", lambda: None) for i in range(3)]
    with pytest.raises(Refused, match="connection"):
        held.admit("c9", "conn-a", lambda: None)
    held.admit(None, "conn-b", lambda: None)
    held.admit(None, "conn-b", lambda: None)
    with pytest.raises(Refused, match="node"):
        held.admit("c10", "conn-c", lambda: None)
    held.release(tickets[0])
    held.admit("c10", "conn-c", lambda: None)
    assert len(held) == 5


def test_memory_is_returned_when_streams_end() -> None:
    held = TelemetryStreams(StreamLimits(total=1000, per_connection=100))
    tickets = [held.admit(f"c{i % 50}", f"conn-{i % 7}", lambda: None) for i in range(300)]
    for t in tickets:
        held.release(t)
    assert len(held) == 0
    assert not held._by_client and not held._per_connection
