"""The report's figures recomputed in plain Python from the raw log files, for comparison.

Nothing here uses Spark or the report's code: files are read with the standard library's json
module, and percentiles follow the definition of Spark's exact ``percentile`` aggregate
(position ``p * (n - 1)`` in the sorted values, linear interpolation between the two ranks
around it).
"""

from __future__ import annotations

import json
import math
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

TIMES = ("store_ms", "due_ms", "delivered_ms", "consumed_ms")


def percentile(sorted_values: list[int], p: float) -> float:
    position = p * (len(sorted_values) - 1)
    lower, higher = math.floor(position), math.ceil(position)
    low, high = sorted_values[lower], sorted_values[higher]
    if lower == higher or low == high:
        return float(low)
    return (higher - position) * low + (position - lower) * high


def stats(values: list[int]) -> dict[str, Any]:
    if not values:
        return {"count": 0}
    s = sorted(values)
    return {
        "count": len(s),
        "p50_ms": percentile(s, 0.5),
        "p90_ms": percentile(s, 0.9),
        "p99_ms": percentile(s, 0.99),
        "p999_ms": percentile(s, 0.999),
        "max_ms": s[-1],
        "min_ms": s[0],
        "mean_ms": sum(s) / len(s),
    }


def read(root: Path, record_type: str) -> list[dict[str, Any]]:
    rows = []
    for path in sorted(root.glob(f"*/{record_type}-*.jsonl")):
        for line in path.read_text().splitlines():
            rows.append(json.loads(line))
    return rows


def messages(root: Path) -> dict[str, dict[str, Any]]:
    merged: dict[str, dict[str, Any]] = {}
    for row in read(root, "latency"):
        m = merged.setdefault(
            row["msg_id"], {"kind": row["kind"], "level": row.get("level"), "deliveries": 0}
        )
        for t in TIMES:
            if row.get(t) is not None:
                m[t] = min(m.get(t, row[t]), row[t])
        m["deliveries"] += row["stage"] == "delivered"
    return merged


def _groups(msgs: list[dict[str, Any]], value: Any, with_plain: bool) -> dict[str, list[int]]:
    groups: dict[str, list[int]] = defaultdict(list)
    for m in msgs:
        v = value(m)
        if v is None:
            continue
        if m["kind"] == "level":
            groups[f"level {m['level']}"].append(v)
            groups["levels (all)"].append(v)
        elif m["kind"] == "timer":
            groups["timer"].append(v)
        elif with_plain:
            groups["plain"].append(v)
        groups["all"].append(v)
    return groups


def lateness(msgs: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    delayed = [m for m in msgs.values() if m["kind"] != "plain"]

    def late(m: dict[str, Any]) -> int | None:
        if m.get("delivered_ms") is None:
            return None
        return m["delivered_ms"] - m["due_ms"]

    out = {}
    for name, values in _groups(delayed, late, with_plain=False).items():
        out[name] = stats(values) | {"early_count": sum(v < 0 for v in values)}
    return out


def end_to_end(msgs: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    def e2e(m: dict[str, Any]) -> int | None:
        if m.get("consumed_ms") is None:
            return None
        return m["consumed_ms"] - (m["due_ms"] if m.get("due_ms") is not None else m["store_ms"])

    return {k: stats(v) for k, v in _groups(list(msgs.values()), e2e, with_plain=True).items()}


def throughput(msgs: dict[str, dict[str, Any]]) -> dict[str, Counter[int]]:
    out: dict[str, Counter[int]] = {}
    for what, column in (
        ("produced", "store_ms"),
        ("delivered", "delivered_ms"),
        ("consumed", "consumed_ms"),
    ):
        out[what] = Counter(m[column] // 1000 for m in msgs.values() if m.get(column) is not None)
    return out


def replication(root: Path) -> dict[str, Any]:
    rows = read(root, "replication")
    leader_rows = {r["index"]: r for r in rows if "propose_ms" in r}
    commit: dict[str, list[int]] = defaultdict(list)
    for r in leader_rows.values():
        value = r["commit_ms"] - r["propose_ms"]
        commit[r["node"]].append(value)
        commit["all"].append(value)
    lag: dict[str, list[int]] = defaultdict(list)
    for r in rows:
        leader = leader_rows.get(r["index"])
        if leader is not None and r["node"] != leader["node"]:
            lag[r["node"]].append(r["apply_ms"] - leader["commit_ms"])
    terms: dict[int, dict[str, Any]] = {}
    for r in leader_rows.values():
        t = terms.setdefault(r["term"], {"leader": r["node"], "first": r["commit_ms"], "last": 0})
        t["first"] = min(t["first"], r["commit_ms"])
        t["last"] = max(t["last"], r["commit_ms"])
    return {
        "commit": {k: stats(v) for k, v in commit.items()},
        "lag": {k: stats(v) for k, v in lag.items()},
        "terms": dict(sorted(terms.items())),
        "commands": len(leader_rows),
    }


def failovers(root: Path, msgs: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    terms = list(replication(root)["terms"].items())
    delivered = sorted(m["delivered_ms"] for m in msgs.values() if m.get("delivered_ms"))
    out = []
    for (old_term, old), (new_term, new) in zip(terms, terms[1:], strict=False):
        a, b = old["last"], new["first"]
        before = max(d for d in delivered if d <= a)
        after = min(d for d in delivered if d > a)
        due_in = [m for m in msgs.values() if m.get("due_ms") is not None and a < m["due_ms"] <= b]
        late = [m["delivered_ms"] - m["due_ms"] for m in due_in if m.get("delivered_ms")]
        out.append(
            {
                "old_term": old_term,
                "new_term": new_term,
                "old_leader": old["leader"],
                "new_leader": new["leader"],
                "window_ms": b - a,
                "delivery_gap_ms": after - before,
                "due_in_window": len(due_in),
                "max_lateness_due_in_window_ms": max(late) if late else None,
            }
        )
    return out
