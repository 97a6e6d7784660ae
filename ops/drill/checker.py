"""Check a drill's history: what was acknowledged, what arrived, when, and how often.

Safety counts (any of them non-zero fails the drill):

- ``lost``: produce acknowledged (``ok``), not a timer whose cancel was confirmed (answer
  ``cancelled``), and never consumed or, when the drill read every queue again from offset 0
  at the end (``final`` records), not in the log any more. ``lost_after_consumed`` counts those
  consumed before they went (a power cut took them back), ``lost_unconsumed_in_log`` those the
  final read found but no consumer saw (written at offsets the consumers had passed: the log
  had shrunk under them, which a consumer's ``prev`` check now detects: ``rewinds`` counts the
  times a consumer was told and read again from where the log changed).
- ``duplicated``: consumed at more than one position (topic, queue, offset);
  ``duplicated_after_loss`` counts those of them read at a position the final read no longer
  finds them at (a power cut took that copy, and a retry of the produce stored it again). With pop
  consumption (``delivery="pop"``, the gRPC workload's ``SimpleConsumer``) there are no
  positions: a message is duplicated when it was acked successfully more than once, each time
  on its own receive.
- ``early``: a delayed message consumed before it was due, by the delivering leader's clock
  (the copy's ``store_ms``; for a pop, ``handed_ms``, when the broker answered the receive) or
  by the drill's clock when it was read, less the clock skew the drill injected
  (``skew_allowance_ms``). The timer wheel delivers a slot once its last millisecond has
  come, so its precision needs no allowance.
- ``unexpected``: consumed but never produced by this drill.
- ``cancelled_delivered``: a timer whose cancel was confirmed, delivered anyway.

Per fault, ``faults`` gives each start with ``lost``: the lost messages whose acknowledgement
came after the previous fault's start and before this one's (the first fault that could have
taken them), and ``lost_acked_ms_before``, how long before the start the newest and oldest of
them were acknowledged (what a power cut's loss window is measured by). ``lost_after_faults``
counts the lost ones acknowledged after the last fault began. ``gone`` and
``gone_acked_ms_before`` are the same for the lost messages the final read found no more in
the log (what the storage lost, as against what consumers missed), each given to the fault
that cut every node while it was acknowledged (its kills take a moment after its start: the
age is then negative), else to the first fault that began after it: a minority's cut cannot
take what the others acknowledged while it lasted.

Reported only: ``recovered`` (a produce that failed or whose outcome was unknown, delivered
anyway, which is allowed: "unknown" means exactly that), with pop consumption ``redelivered``
(received more than once but acked successfully at most once: after an ack failed or went
unanswered, or after the invisible time passed, which is at-least-once delivery) and
``unacked`` (acknowledged and received, never acked successfully, and no ack left without an
answer that may have counted: the broker still owed it a delivery), lateness of delayed messages (copy
``store_ms`` minus due), and per fault the time from its start to the next acknowledged produce
(invoked after the start) and to the next delivery of a delayed message (RTO). A fault made of
several disruptions (``transfer-leader``: each transfer; ``membership``: the removal and the
re-add) records each as a ``disruption``; its times are measured from each of them instead,
and the time they left the cluster without a leader (their ``leaderless_ms``) is summed up in
``leaderless_s``.
"""

from __future__ import annotations

import bisect
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from chronomq.ops.stats import percentile

SAFETY = ("lost", "duplicated", "early", "unexpected", "cancelled_delivered")


@dataclass
class CheckResult:
    produced: int = 0
    acknowledged: int = 0
    produce_errors: int = 0
    """Produces whose last answer was an error or unknown (the client gave up retrying)."""
    consumed: int = 0
    lost: int = 0
    duplicated: int = 0
    early: int = 0
    unexpected: int = 0
    cancelled_delivered: int = 0
    recovered: int = 0
    cancelled: int = 0
    delivery: str = "pull"
    redelivered: int = 0
    unacked: int = 0
    lateness_ms: dict[str, float | None] = field(default_factory=dict)
    rto_s: dict[str, dict[str, float | int | None]] = field(default_factory=dict)
    produce_rto_s: dict[str, dict[str, float | int | None]] = field(default_factory=dict)
    leaderless_s: dict[str, dict[str, float | int | None]] = field(default_factory=dict)
    detected_by: dict[str, dict[str, int]] = field(default_factory=dict)
    """Per fault type: how the new leaders noticed the old one was gone (connection_closed,
    timeout, transfer), counted over the elections the faults caused."""
    faults: list[dict[str, Any]] = field(default_factory=list)
    lost_after_faults: int = 0
    lost_after_consumed: int = 0
    lost_unconsumed_in_log: int = 0
    rewinds: int = 0
    duplicated_after_loss: int = 0
    examples: dict[str, list[str]] = field(default_factory=dict)

    @property
    def safe(self) -> bool:
        return all(getattr(self, name) == 0 for name in SAFETY)

    def as_dict(self) -> dict[str, Any]:
        pop = (
            {"delivery": self.delivery, "redelivered": self.redelivered, "unacked": self.unacked}
            if self.delivery == "pop"
            else {}
        )
        return {
            "produced": self.produced,
            "acknowledged": self.acknowledged,
            "produce_errors": self.produce_errors,
            "consumed": self.consumed,
            "lost": self.lost,
            "duplicated": self.duplicated,
            "early": self.early,
            "unexpected": self.unexpected,
            "cancelled_delivered": self.cancelled_delivered,
            "recovered": self.recovered,
            "cancelled": self.cancelled,
            **pop,
            "lateness_ms": self.lateness_ms,
            "rto_s": self.rto_s,
            "produce_rto_s": self.produce_rto_s,
            "leaderless_s": self.leaderless_s,
            "detected_by": self.detected_by,
            "faults": self.faults,
            "lost_after_faults": self.lost_after_faults,
            "lost_after_consumed": self.lost_after_consumed,
            "lost_unconsumed_in_log": self.lost_unconsumed_in_log,
            "rewinds": self.rewinds,
            "duplicated_after_loss": self.duplicated_after_loss,
            "examples": self.examples,
            "safe": self.safe,
        }


@dataclass
class _Message:
    token: str
    kind: str = "plain"
    invoked: bool = False
    outcome: str | None = None  # ok / fail / unknown (the last answer)
    ok_ms: int | None = None  # when it was acknowledged
    due_ms: int | None = None
    cancel: str | None = None  # the confirmed answer of a cancel, if any
    copies: list[Mapping[str, Any]] = field(default_factory=list)
    acks_ok: int = 0
    acks_unknown: int = 0


def _server_ms(copy: Mapping[str, Any]) -> int | None:
    """When the broker gave out this copy, by its clock: the delivered record's store time
    (pull), or the receive's answer time (pop)."""
    value = copy.get("store_ms")
    if value is None:
        value = copy.get("handed_ms")
    return None if value is None else int(value)


def _summary(values: list[float]) -> dict[str, float | int | None]:
    if not values:
        return {"n": 0, "min": None, "median": None, "max": None}
    values = sorted(values)
    return {
        "n": len(values),
        "min": round(values[0], 3),
        "median": round(percentile(values, 0.5), 3),
        "max": round(values[-1], 3),
    }


def check(
    records: Iterable[Mapping[str, Any]], *, skew_allowance_ms: int = 0, delivery: str = "pull"
) -> CheckResult:
    """Check a history (records as :mod:`chronomq.ops.drill.history` writes them). ``delivery`` is
    ``"pull"`` (the HTTP workload reads queues by offset) or ``"pop"`` (the gRPC workload
    receives and acks)."""
    if delivery not in ("pull", "pop"):
        raise ValueError(f"delivery is 'pull' or 'pop', not {delivery!r}")
    messages: dict[str, _Message] = {}
    faults: list[dict[str, Any]] = []
    disruptions: list[dict[str, Any]] = []
    produce_oks: list[tuple[int, int]] = []  # (invoke t_ms, ok t_ms)
    invoke_at: dict[str, int] = {}
    unexpected: set[str] = set()
    final: set[str] | None = None
    final_copies: Counter[str] = Counter()  # how many positions of the final read hold each
    ends: list[tuple[str, int]] = []
    detected: dict[str, Counter[str]] = defaultdict(Counter)
    rewinds = 0

    def msg(token: str) -> _Message:
        m = messages.get(token)
        if m is None:
            m = messages[token] = _Message(token)
        return m

    for rec in records:
        op, kind = rec.get("op"), rec.get("type")
        if op == "produce":
            m = msg(rec["token"])
            if kind == "invoke":
                m.invoked = True
                m.kind = rec.get("kind", "plain")
                invoke_at[m.token] = rec["t_ms"]
            else:
                m.outcome = kind
                if kind == "ok":
                    m.ok_ms = int(rec["t_ms"])
                    if rec.get("due_ms") is not None:
                        m.due_ms = int(rec["due_ms"])
                    produce_oks.append((invoke_at.get(m.token, rec["t_ms"]), rec["t_ms"]))
        elif op == "cancel" and kind == "ok":
            msg(rec["token"]).cancel = rec.get("status")
        elif op == "consume":
            token = rec.get("token")
            if token is None or token not in messages or not messages[token].invoked:
                unexpected.add(str(token if token is not None else rec.get("msg_id")))
                continue
            messages[token].copies.append(rec)
        elif op == "ack" and kind in ("ok", "unknown"):
            token = rec.get("token")
            if token in messages:
                if kind == "ok":
                    messages[token].acks_ok += 1
                else:
                    messages[token].acks_unknown += 1
        elif op == "fault" and kind == "start":
            faults.append(dict(rec))
        elif op == "rewind":
            rewinds += 1
        elif op == "final":
            final = (final or set()) | {str(t) for t in rec.get("tokens", [])}
            final_copies.update(str(t) for t in rec.get("tokens", []))
        elif op == "fault" and kind == "end":
            ends.append((str(rec.get("fault")), int(rec["t_ms"])))
        elif op == "fault" and kind == "disruption":
            disruptions.append(dict(rec))
        elif op == "fault" and kind == "elected":
            detected[str(rec.get("fault"))][str(rec.get("detected_by"))] += 1

    result = CheckResult(faults=faults, delivery=delivery, rewinds=rewinds)
    examples: dict[str, list[str]] = defaultdict(list)
    lateness: list[float] = []
    lost_messages: list[_Message] = []
    for m in messages.values():
        if not m.invoked:
            continue
        result.produced += 1
        positions = {(c.get("topic"), c.get("queue"), c.get("offset")) for c in m.copies}
        if m.copies:
            result.consumed += 1
        if m.cancel == "cancelled":
            result.cancelled += 1
            if m.copies:
                result.cancelled_delivered += 1
                examples["cancelled_delivered"].append(m.token)
            continue
        if m.outcome in ("fail", "unknown"):
            result.produce_errors += 1
        if m.outcome == "ok":
            result.acknowledged += 1
            gone = final is not None and m.token not in final
            if not m.copies or gone:
                result.lost += 1
                examples["lost"].append(m.token)
                lost_messages.append(m)
                if m.copies:
                    result.lost_after_consumed += 1
                elif final is not None and not gone:
                    result.lost_unconsumed_in_log += 1
        elif m.copies:
            result.recovered += 1
        if delivery == "pull" and len(positions) > 1:
            result.duplicated += 1
            examples["duplicated"].append(m.token)
            if final is not None and final_copies[m.token] < len(positions):
                # Read at a position that no longer holds it: that copy went with a power
                # cut, and the producer's retry (its idempotency record gone too) stored it
                # again.
                result.duplicated_after_loss += 1
        if delivery == "pop":
            if m.acks_ok > 1:
                result.duplicated += 1
                examples["duplicated"].append(m.token)
            elif len(m.copies) > 1:
                result.redelivered += 1
                examples["redelivered"].append(m.token)
            if m.outcome == "ok" and m.copies and m.acks_ok == 0 and m.acks_unknown == 0:
                result.unacked += 1
                examples["unacked"].append(m.token)
        if m.copies and m.due_ms is not None:
            store_ms = min(_server_ms(c) or 0 for c in m.copies)
            seen_ms = min(int(c["t_ms"]) for c in m.copies)
            if min(store_ms, seen_ms) < m.due_ms - skew_allowance_ms:
                result.early += 1
                examples["early"].append(m.token)
            lateness.append(store_ms - m.due_ms)
    result.unexpected = len(unexpected)
    examples["unexpected"].extend(sorted(unexpected))
    result.examples = {k: v[:10] for k, v in examples.items() if v}
    lateness.sort()
    result.lateness_ms = {
        "p50": round(percentile(lateness, 0.5), 1) if lateness else None,
        "p99": round(percentile(lateness, 0.99), 1) if lateness else None,
        "max": lateness[-1] if lateness else None,
    }
    result.lost_after_faults = _lost_per_fault(faults, ends, lost_messages)
    if final is not None:
        _gone_per_fault(faults, ends, [m for m in lost_messages if m.token not in final])
    marks = recovery_marks(faults, disruptions)
    result.rto_s, result.produce_rto_s = _recovery(marks, messages, produce_oks)
    result.leaderless_s = _leaderless(disruptions)
    result.detected_by = {name: dict(sorted(c.items())) for name, c in sorted(detected.items())}
    return result


def _lost_per_fault(
    faults: list[dict[str, Any]], ends: list[tuple[str, int]], lost: list[_Message]
) -> int:
    """Add ``lost`` (and the ack ages) to each fault during or before which the lost
    messages were acknowledged (the first fault to end after the acknowledgement); return how
    many were acknowledged after the last fault ended."""
    starts = [int(f["t_ms"]) for f in faults]
    until = _ends(faults, starts, ends)
    ages: dict[int, list[int]] = defaultdict(list)
    after = 0
    for m in lost:
        ok_ms = m.ok_ms if m.ok_ms is not None else 0
        at = bisect.bisect_left(until, ok_ms)
        if at == len(until):
            after += 1
        else:
            ages[at].append(starts[at] - ok_ms)
    for i, f in enumerate(faults):
        found = sorted(ages.get(i, []))
        f["lost"] = len(found)
        f["lost_acked_ms_before"] = {"min": found[0], "max": found[-1]} if found else None
    return after


def _ends(
    faults: list[dict[str, Any]], starts: list[int], ends: list[tuple[str, int]]
) -> list[int]:
    """Each start's end: the first end of the same fault after it (none: it never ended)."""
    until = []
    for f, start in zip(faults, starts, strict=True):
        name = str(f.get("fault"))
        until.append(min((t for n, t in ends if n == name and t >= start), default=2**62))
    return until


def _gone_per_fault(
    faults: list[dict[str, Any]], ends: list[tuple[str, int]], gone: list[_Message]
) -> None:
    """Add ``gone`` (and the ack ages) to the fault that took each message gone from the
    log: one cutting every node while it was acknowledged (the kills take a moment after the
    start), else the first fault that began after it."""
    starts = [int(f["t_ms"]) for f in faults]
    until = _ends(faults, starts, ends)
    ages: dict[int, list[int]] = defaultdict(list)
    for m in gone:
        ok_ms = m.ok_ms if m.ok_ms is not None else 0
        at = bisect.bisect_left(starts, ok_ms)
        during = at - 1
        if during >= 0 and faults[during].get("scope") == "all" and ok_ms <= until[during]:
            at = during
        if at < len(starts):
            ages[at].append(starts[at] - ok_ms)
    for i, f in enumerate(faults):
        found = sorted(ages.get(i, []))
        f["gone"] = len(found)
        f["gone_acked_ms_before"] = {"min": found[0], "max": found[-1]} if found else None


def recovery_marks(
    faults: list[dict[str, Any]], disruptions: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """What recovery is measured from: each disruption of a fault type that records them,
    else each start."""
    disrupting = {str(d.get("fault")) for d in disruptions}
    marks = [f for f in faults if str(f.get("fault")) not in disrupting]
    return sorted([*marks, *disruptions], key=lambda r: int(r["t_ms"]))


def _leaderless(disruptions: list[dict[str, Any]]) -> dict[str, dict[str, float | int | None]]:
    """Per fault type: the seconds without a leader that each disruption caused."""
    gaps: dict[str, list[float]] = defaultdict(list)
    for d in disruptions:
        if d.get("leaderless_ms") is not None:
            gaps[str(d.get("fault"))].append(int(d["leaderless_ms"]) / 1000)
    return {name: _summary(values) for name, values in sorted(gaps.items())}


def _recovery(
    faults: list[dict[str, Any]],
    messages: Mapping[str, _Message],
    produce_oks: list[tuple[int, int]],
) -> tuple[dict[str, dict[str, float | int | None]], dict[str, dict[str, float | int | None]]]:
    """Per fault type: seconds from each mark (a fault's start, or one of its disruptions) to
    the next delivery and produce."""
    deliveries = sorted(
        ms
        for m in messages.values()
        if m.kind != "plain"
        for c in m.copies
        if (ms := _server_ms(c)) is not None
    )
    produce_oks = sorted(produce_oks)
    invoked_at = [invoked for invoked, _ in produce_oks]
    rto: dict[str, list[float]] = defaultdict(list)
    produce_rto: dict[str, list[float]] = defaultdict(list)
    for fault in faults:
        name, start = str(fault.get("fault")), int(fault["t_ms"])
        at = bisect.bisect_left(deliveries, start)
        if at < len(deliveries):
            rto[name].append((deliveries[at] - start) / 1000)
        at = bisect.bisect_left(invoked_at, start)
        if at < len(produce_oks):
            produce_rto[name].append((produce_oks[at][1] - start) / 1000)
    names = sorted({str(f.get("fault")) for f in faults})
    return (
        {n: _summary(rto.get(n, [])) for n in names},
        {n: _summary(produce_rto.get(n, [])) for n in names},
    )
