"""The drill checker on hand-made histories, one anomaly at a time."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from chronomq.ops.drill.checker import check, recovery_marks
from chronomq.ops.drill.history import History, read_history


def produce(
    token: str, t: int, outcome: str = "ok", due: int | None = None, kind: str = "level"
) -> list[dict[str, Any]]:
    recs: list[dict[str, Any]] = [
        {"op": "produce", "type": "invoke", "token": token, "kind": kind, "t_ms": t}
    ]
    recs.append({"op": "produce", "type": outcome, "token": token, "t_ms": t + 5, "due_ms": due})
    return recs


def consume(token: str, t: int, store_ms: int, offset: int, queue: int = 0) -> dict[str, Any]:
    return {
        "op": "consume",
        "type": "ok",
        "token": token,
        "t_ms": t,
        "store_ms": store_ms,
        "topic": "drill",
        "queue": queue,
        "offset": offset,
    }


def test_a_clean_history_is_safe() -> None:
    h = [
        *produce("a", 1000, due=2000),
        *produce("b", 1000, kind="plain"),
        consume("a", 2010, 2003, 0),
        consume("b", 1010, 1006, 1),
    ]
    r = check(h)
    assert r.safe
    assert (r.produced, r.acknowledged, r.consumed) == (2, 2, 2)
    assert r.lateness_ms["max"] == 3


def test_lost() -> None:
    r = check([*produce("a", 1000, due=2000)])
    assert r.lost == 1 and not r.safe and r.examples["lost"] == ["a"]


def test_duplicated_needs_two_positions() -> None:
    twice_same_offset = [
        *produce("a", 1000, due=2000),
        consume("a", 2010, 2003, 0),
        consume("a", 2020, 2003, 0),  # the same position read again is not a duplicate
    ]
    assert check(twice_same_offset).duplicated == 0
    two_offsets = [*twice_same_offset, consume("a", 2030, 2025, 7)]
    r = check(two_offsets)
    assert r.duplicated == 1 and not r.safe


def test_early_by_store_time_or_by_when_it_was_read() -> None:
    by_store = [*produce("a", 1000, due=2000), consume("a", 2100, 1999, 0)]
    assert check(by_store).early == 1
    by_read = [*produce("b", 1000, due=2000), consume("b", 1500, 2001, 0)]
    assert check(by_read).early == 1


def test_early_allows_for_injected_skew() -> None:
    h = [*produce("a", 1000, due=5000), consume("a", 3000, 3000, 0)]
    assert check(h).early == 1
    assert check(h, skew_allowance_ms=2500).early == 0


def test_unexpected() -> None:
    r = check([consume("ghost", 2000, 2000, 0)])
    assert r.unexpected == 1 and r.examples["unexpected"] == ["ghost"]


def test_confirmed_cancel_delivered_anyway() -> None:
    h = [
        *produce("t", 1000, due=9000, kind="timer"),
        {"op": "cancel", "type": "ok", "token": "t", "status": "cancelled", "t_ms": 2000},
        consume("t", 9100, 9001, 0),
    ]
    r = check(h)
    assert r.cancelled_delivered == 1 and not r.safe
    silent = check(h[:-1])
    assert silent.safe and silent.cancelled == 1 and silent.lost == 0


def test_unknown_or_failed_produce_delivered_is_recovered_not_unsafe() -> None:
    h = [
        *produce("u", 1000, outcome="unknown"),
        *produce("f", 1000, outcome="fail"),
        consume("u", 3000, 2900, 0),
    ]
    r = check(h)
    assert r.safe and r.recovered == 1 and r.lost == 0 and r.acknowledged == 0


def test_recovery_time_after_each_fault() -> None:
    h = [
        {"op": "fault", "type": "start", "fault": "kill-leader", "t_ms": 10_000},
        *produce("a", 9_000, due=10_000),
        consume("a", 10_900, 10_800, 0),  # first delivery 0.8 s after the fault
        *produce("b", 10_100, kind="plain"),  # invoked after the fault, ok at 10_105
        {"op": "fault", "type": "start", "fault": "kill-leader", "t_ms": 20_000},
        *produce("c", 19_000, due=20_000),
        consume("c", 21_300, 21_200, 1),
    ]
    r = check(h)
    assert r.rto_s["kill-leader"] == {"n": 2, "min": 0.8, "median": 1.0, "max": 1.2}
    assert r.produce_rto_s["kill-leader"]["min"] == 0.105


def test_how_each_new_leader_noticed_is_counted_per_fault() -> None:
    h = [
        {"op": "fault", "type": "start", "fault": "kill-leader", "t_ms": 10_000},
        {"op": "fault", "type": "elected", "fault": "kill-leader", "node": 1,
         "detected_by": "connection_closed", "t_ms": 11_000},
        {"op": "fault", "type": "start", "fault": "kill-leader", "t_ms": 20_000},
        {"op": "fault", "type": "elected", "fault": "kill-leader", "node": 2,
         "detected_by": "connection_closed", "t_ms": 21_000},
        {"op": "fault", "type": "start", "fault": "partition-leader", "t_ms": 30_000},
        {"op": "fault", "type": "elected", "fault": "partition-leader", "node": 0,
         "detected_by": "timeout", "t_ms": 32_000},
    ]  # fmt: skip
    r = check(h)
    assert r.detected_by == {
        "kill-leader": {"connection_closed": 2},
        "partition-leader": {"timeout": 1},
    }
    assert r.as_dict()["detected_by"] == r.detected_by


def test_produces_that_ended_in_an_error_or_unknown_are_counted() -> None:
    h = [
        *produce("a", 1000),
        *produce("b", 1000, outcome="fail"),
        *produce("c", 1000, outcome="unknown"),
        consume("a", 1500, 1400, 0),
    ]
    r = check(h)
    assert r.produce_errors == 2 and r.acknowledged == 1
    assert r.as_dict()["produce_errors"] == 2


def test_history_file_round_trip_ignores_a_torn_tail(tmp_path: Path) -> None:
    h = History(tmp_path / "h.jsonl")
    h.add("produce", "invoke", token="a", kind="plain")
    h.add("produce", "ok", token="a")
    h.close()
    with open(tmp_path / "h.jsonl", "ab") as f:
        f.write(b'{"op": "consu')
    recs = list(read_history(tmp_path / "h.jsonl"))
    assert [r["type"] for r in recs] == ["invoke", "ok"]
    assert check(recs).lost == 1


def test_a_fault_with_disruptions_is_measured_from_each_of_them() -> None:
    h = [
        {"op": "fault", "type": "start", "fault": "transfer-leader", "t_ms": 10_000},
        {
            "op": "fault",
            "type": "disruption",
            "fault": "transfer-leader",
            "step": "transfer",
            "t_ms": 10_100,
            "leaderless_ms": 300,
        },
        *produce("a", 10_200, kind="plain"),  # ok at 10_205: 0.105 s after the first
        {
            "op": "fault",
            "type": "disruption",
            "fault": "transfer-leader",
            "step": "transfer",
            "t_ms": 11_000,
            "leaderless_ms": 0,
        },
        *produce("b", 11_500, kind="plain"),  # ok at 11_505: 0.505 s after the second
        {"op": "fault", "type": "start", "fault": "kill-leader", "t_ms": 20_000},
        *produce("c", 20_700, kind="plain"),
        consume("a", 10_300, 10_205, 0),
        consume("b", 11_600, 11_505, 1),
        consume("c", 20_800, 20_705, 2),
    ]
    r = check(h)
    assert r.safe
    assert r.produce_rto_s["transfer-leader"] == {
        "n": 2,
        "min": 0.105,
        "median": 0.305,
        "max": 0.505,
    }
    assert r.produce_rto_s["kill-leader"]["n"] == 1  # its start, as before
    assert r.leaderless_s == {"transfer-leader": {"n": 2, "min": 0.0, "median": 0.15, "max": 0.3}}
    assert [f["fault"] for f in r.faults] == ["transfer-leader", "kill-leader"]
    assert set(r.as_dict()["leaderless_s"]) == {"transfer-leader"}


def test_recovery_marks_replace_a_faults_start_by_its_disruptions() -> None:
    starts = [
        {"fault": "membership", "t_ms": 5},
        {"fault": "kill-leader", "t_ms": 1},
    ]
    steps = [
        {"fault": "membership", "step": "add", "t_ms": 9},
        {"fault": "membership", "step": "remove", "t_ms": 6},
    ]
    marks = recovery_marks(starts, steps)
    assert [(m["fault"], m["t_ms"]) for m in marks] == [
        ("kill-leader", 1),
        ("membership", 6),
        ("membership", 9),
    ]


# ---------------------------------------------------------------------- pop (gRPC workload)


def receive(token: str, t: int, handed: int, attempt: int = 1) -> dict[str, Any]:
    return {
        "op": "consume",
        "type": "ok",
        "token": token,
        "t_ms": t,
        "handed_ms": handed,
        "topic": "drill",
        "attempt": attempt,
    }


def ack(token: str, t: int, outcome: str = "ok", attempt: int = 1) -> dict[str, Any]:
    return {"op": "ack", "type": outcome, "token": token, "t_ms": t, "attempt": attempt}


def test_pop_received_and_acked_once_is_safe() -> None:
    h = [
        *produce("a", 1000, due=2000),
        *produce("b", 1000, kind="plain"),
        receive("a", 2010, 2004),
        ack("a", 2015),
        receive("b", 1010, 1008),
        ack("b", 1012),
    ]
    r = check(h, delivery="pop")
    assert r.safe and (r.redelivered, r.unacked) == (0, 0)
    assert (r.produced, r.acknowledged, r.consumed) == (2, 2, 2)
    assert r.lateness_ms["max"] == 4
    d = r.as_dict()
    assert (d["delivery"], d["redelivered"], d["unacked"]) == ("pop", 0, 0)


def test_pop_redelivery_after_a_failed_or_skipped_ack_is_not_a_duplicate() -> None:
    h = [
        *produce("a", 1000, kind="plain"),
        receive("a", 1010, 1008),
        ack("a", 1020, "fail"),
        receive("a", 7010, 7008, attempt=2),
        ack("a", 7020),
        *produce("b", 1000, kind="plain"),
        receive("b", 1010, 1008),  # left unacked on purpose; back after its invisible time
        receive("b", 6010, 6008, attempt=2),
        ack("b", 6020, "unknown"),  # no answer: it may count, or come back once more
        receive("b", 11010, 11008, attempt=3),
        ack("b", 11020),
    ]
    r = check(h, delivery="pop")
    assert r.safe and r.duplicated == 0
    assert r.redelivered == 2 and r.examples["redelivered"] == ["a", "b"]


def test_pop_acked_successfully_twice_is_a_duplicate() -> None:
    h = [
        *produce("a", 1000, kind="plain"),
        receive("a", 1010, 1008),
        ack("a", 1020),
        receive("a", 7010, 7008, attempt=2),  # handed out again although acked
        ack("a", 7020),
    ]
    r = check(h, delivery="pop")
    assert r.duplicated == 1 and r.redelivered == 0 and not r.safe
    assert r.examples["duplicated"] == ["a"]
    # Pull semantics would see one position (none) and no duplicate: the mode matters.
    assert check(h).duplicated == 0


def test_pop_lost_unexpected_early_and_unacked() -> None:
    h = [
        *produce("lost", 1000, kind="plain"),
        receive("ghost", 1500, 1500),
        ack("ghost", 1510),
        *produce("early", 1000, due=5000, kind="timer"),
        receive("early", 5100, 4900),  # handed out 100 ms before due, by the broker's clock
        ack("early", 5110),
        *produce("early-read", 1000, due=5000, kind="timer"),
        receive("early-read", 4990, 5001),  # read before due, by the drill's clock
        ack("early-read", 5000),
        *produce("never-acked", 1000, kind="plain"),
        receive("never-acked", 1010, 1008),
        ack("never-acked", 1020, "fail"),
        *produce("maybe-acked", 1000, kind="plain"),
        receive("maybe-acked", 1010, 1008),
        ack("maybe-acked", 1020, "unknown"),  # it may have counted: nothing is owed
    ]
    r = check(h, delivery="pop")
    assert (r.lost, r.unexpected, r.early) == (1, 1, 2)
    assert r.examples["early"] == ["early", "early-read"]
    assert r.unacked == 1 and r.examples["unacked"] == ["never-acked"]
    assert check(h, delivery="pop", skew_allowance_ms=200).early == 0


def test_pull_results_keep_their_keys() -> None:
    d = check([*produce("a", 1000, kind="plain"), consume("a", 1010, 1006, 0)]).as_dict()
    assert not {"delivery", "redelivered", "unacked"} & set(d)


def test_delivery_mode_is_checked() -> None:
    with pytest.raises(ValueError, match="delivery"):
        check([], delivery="push")


def _fault(kind: str, fault: str, t: int, **detail: Any) -> dict[str, Any]:
    return {"op": "fault", "type": kind, "fault": fault, "t_ms": t, **detail}


def test_a_message_consumed_then_gone_from_the_final_read_is_lost() -> None:
    h = [
        *produce("a", 1000, kind="plain"),
        *produce("b", 1000, kind="plain"),
        *produce("c", 1000, kind="plain"),
        consume("a", 1010, 1006, 0),
        consume("b", 1010, 1006, 1),
        _fault("start", "power-cut", 2000, scope="all", nodes=[0, 1, 2]),
        _fault("end", "power-cut", 3000, scope="all", nodes=[0, 1, 2]),
        # The log after the cut holds a (consumed) and c (never consumed: the consumers had
        # passed its offset), not b.
        {"op": "final", "type": "ok", "t_ms": 9000, "queue": 0, "tokens": ["a", "c"]},
    ]
    r = check(h)
    assert r.lost == 2 and sorted(r.examples["lost"]) == ["b", "c"]
    assert r.lost_after_consumed == 1 and r.lost_unconsumed_in_log == 1
    # Without a final read only what was never consumed counts.
    assert check([x for x in h if x["op"] != "final"]).lost == 1


def test_lost_messages_are_charged_to_the_fault_they_preceded() -> None:
    h = [
        *produce("early", 1000, kind="plain"),
        _fault("start", "kill-leader", 2000),
        _fault("end", "kill-leader", 2500),
        *produce("before-cut", 4000, kind="plain"),
        _fault("start", "power-cut", 4200, scope="all"),
        *produce("during-cut", 4210, kind="plain"),  # answered as the nodes died
        _fault("end", "power-cut", 6000, scope="all"),
        *produce("after", 7000, kind="plain"),
    ]
    r = check(h)
    assert r.lost == 4
    kill, cut = r.faults
    assert kill["lost"] == 1 and kill["lost_acked_ms_before"] == {"min": 995, "max": 995}
    assert cut["lost"] == 2 and cut["lost_acked_ms_before"] == {"min": -15, "max": 195}
    assert r.lost_after_faults == 1


def test_messages_gone_from_the_log_are_charged_to_the_next_cut_and_rewinds_counted() -> None:
    """What the storage lost (not in the final read) goes to the first fault that began after
    its acknowledgement, even when a minority cut was on when it was acknowledged; what
    consumers missed but the log holds is lost without being gone."""
    h = [
        _fault("start", "power-cut", 1000, scope="minority", nodes=[2]),
        *produce("during-minority", 1500, kind="plain"),
        _fault("end", "power-cut", 3000, scope="minority", nodes=[2]),
        *produce("skipped", 3500, kind="plain"),
        *produce("gone", 3900, kind="plain"),
        _fault("start", "power-cut", 4000, scope="all", nodes=[0, 1, 2]),
        _fault("end", "power-cut", 6000, scope="all", nodes=[0, 1, 2]),
        {"op": "rewind", "type": "ok", "t_ms": 6500, "queue": 0, "offset": 9, "resume": 7},
        {"op": "final", "type": "ok", "t_ms": 9000, "queue": 0, "tokens": ["skipped"]},
    ]
    r = check(h)
    assert r.lost == 3 and r.lost_unconsumed_in_log == 1 and r.rewinds == 1
    minority, everyone = r.faults
    assert minority["lost"] == 1 and minority["gone"] == 0
    assert minority["gone_acked_ms_before"] is None
    assert everyone["gone"] == 2 and everyone["gone_acked_ms_before"] == {"min": 95, "max": 2495}


def test_a_message_acknowledged_while_every_node_is_being_cut_is_charged_to_that_cut() -> None:
    h = [
        _fault("start", "power-cut", 1000, scope="all", nodes=[0, 1, 2]),
        *produce("as-they-died", 1050, kind="plain"),
        _fault("end", "power-cut", 3000, scope="all", nodes=[0, 1, 2]),
        _fault("start", "power-cut", 9000, scope="leader", nodes=[1]),
        _fault("end", "power-cut", 9500, scope="leader", nodes=[1]),
        {"op": "final", "type": "ok", "t_ms": 12000, "queue": 0, "tokens": []},
    ]
    everyone, leader = check(h).faults
    assert everyone["gone"] == 1 and everyone["gone_acked_ms_before"] == {"min": -55, "max": -55}
    assert leader["gone"] == 0


def test_a_duplicate_whose_first_copy_a_cut_took_is_told_apart() -> None:
    h = [
        *produce("a", 1000, kind="plain"),
        *produce("b", 1000, kind="plain"),
        consume("a", 1010, 1006, 0),
        consume("b", 1010, 1006, 1),
        consume("a", 5000, 4006, 1),  # stored again at offset 1 after a cut took offset 0
        consume("b", 5000, 4006, 2),  # read twice while the log held it twice
        {"op": "final", "type": "ok", "t_ms": 9000, "queue": 0, "tokens": ["a", "b", "b"]},
    ]
    r = check(h)
    assert r.duplicated == 2 and r.duplicated_after_loss == 1
