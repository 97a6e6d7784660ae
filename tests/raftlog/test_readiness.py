"""The readiness judgement (raftlog/readiness.py), with a clock in seconds."""

from __future__ import annotations

import dataclasses

from chronomq.raftlog.readiness import RaftView, judge

ME = "127.0.0.1:9001"
OTHER = "127.0.0.1:9002"
FOLLOWER = RaftView(
    self_address=ME,
    leads=False,
    confirmed=False,
    leader=OTHER,
    leader_heard_s=100.0,
    leader_lease=True,
    window_s=1.5,
)


def test_a_follower_hearing_a_leader_with_its_lease_is_ready() -> None:
    r = judge(FOLLOWER, 101.0)
    assert r.ready and r.leader == OTHER


def test_a_follower_that_has_not_heard_its_leader_within_the_window_is_not_ready() -> None:
    r = judge(FOLLOWER, 101.6)
    assert not r.ready and r.leader is None
    assert "1600 ms" in r.reason and OTHER in r.reason


def test_a_follower_whose_leader_lost_its_lease_is_not_ready() -> None:
    r = judge(dataclasses.replace(FOLLOWER, leader_lease=False), 100.1)
    assert not r.ready and "no majority" in r.reason


def test_no_leader_or_never_heard_is_not_ready() -> None:
    assert not judge(dataclasses.replace(FOLLOWER, leader=None), 100.0).ready
    assert not judge(dataclasses.replace(FOLLOWER, leader_heard_s=None), 100.0).ready


def test_a_leader_is_ready_only_while_confirmed() -> None:
    leader = dataclasses.replace(FOLLOWER, leads=True, leader=ME, confirmed=True)
    assert judge(leader, 500.0) == judge(leader, 100.0)
    assert judge(leader, 500.0).ready and judge(leader, 500.0).leader == ME
    stepped_down = judge(dataclasses.replace(leader, confirmed=False), 100.0)
    assert not stepped_down.ready and stepped_down.leader is None
