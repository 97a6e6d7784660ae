"""Small statistics helpers shared by benchmarks and drills."""

from __future__ import annotations

import math
from collections.abc import Sequence


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Exact percentile with linear interpolation (Spark's ``percentile``), ``q`` in [0, 1]."""
    if not sorted_values:
        return math.nan
    if len(sorted_values) == 1:
        return float(sorted_values[0])
    pos = q * (len(sorted_values) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    frac = pos - lo
    return float(sorted_values[lo]) * (1 - frac) + float(sorted_values[hi]) * frac


def summary_ms(values: Sequence[float]) -> dict[str, float]:
    s = sorted(values)
    return {
        "p50": round(percentile(s, 0.50), 3),
        "p99": round(percentile(s, 0.99), 3),
        "max": round(s[-1], 3) if s else math.nan,
    }
