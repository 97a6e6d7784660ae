"""Whether a node is ready to serve writes, without I/O: what ``/readyz``, the node status and
the cluster view report.

Ready means a write sent to this node can commit now:

* on the leader: its leadership is *confirmed* (a barrier committed in its term) and its lease
  holds (a majority acknowledged it within ``leader_lease_ms``); a node that pysyncobj still
  calls leader after losing its majority is not ready;
* on a follower: it knows a leader, heard from it within the window (``leader_lease_ms``, many
  heartbeats), and the leader's last message said that its own lease holds (the ``lease``
  field leaders add to their append messages; a leader of a version without the field is
  taken at its word).

A follower that only remembers the last leader it heard of (pysyncobj keeps it while the node
cannot campaign, e.g. alone after two of three nodes died) is therefore not ready.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Readiness:
    """A node's readiness: ``leader`` is the Raft address of the leader it would send a write
    to (None when there is none it can use); ``reason`` says why, in a sentence."""

    ready: bool
    leader: str | None
    reason: str


@dataclass(frozen=True, slots=True)
class RaftView:
    """What the node knows, read from its Raft machine at ``now_s`` (monotonic seconds)."""

    self_address: str
    leads: bool  # pysyncobj's role is leader
    confirmed: bool  # leadership confirmed and the lease holds
    leader: str | None  # pysyncobj's idea of the leader
    leader_heard_s: float | None  # when an append message from a leader last arrived
    leader_lease: bool  # what the leader's last append message said of its lease
    window_s: float


def judge(view: RaftView, now_s: float) -> Readiness:
    """The readiness of a node that knows ``view`` at ``now_s``."""
    if view.leads:
        if view.confirmed:
            return Readiness(True, view.self_address, "this node leads with a quorum")
        return Readiness(
            False,
            None,
            "this node holds the leader role but no majority has acknowledged it within the "
            "lease: writes are refused until it regains one or another node is elected",
        )
    if view.leader is None or view.leader == view.self_address:
        return Readiness(False, None, "no leader is known (an election has not completed)")
    if view.leader_heard_s is None:
        return Readiness(False, None, f"the leader {view.leader} has not been heard from yet")
    silent_s = now_s - view.leader_heard_s
    if silent_s > view.window_s:
        return Readiness(
            False,
            None,
            f"the last known leader {view.leader} has not been heard from for "
            f"{silent_s * 1000:.0f} ms (more than {view.window_s * 1000:.0f} ms)",
        )
    if not view.leader_lease:
        return Readiness(
            False,
            None,
            f"the leader {view.leader} reports that no majority acknowledges it",
        )
    return Readiness(True, view.leader, f"the leader {view.leader} is reachable with a quorum")
