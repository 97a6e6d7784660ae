"""Small, dependency-free SVG charts for the HTML report.

Charts are inline ``<svg>`` elements: the report stays one self-contained file that renders
offline in any browser, scales without blurring, and needs no plotting library. Only what the
report draws is here: line charts over time (with vertical markers and shaded spans) and grouped
bar charts, on a linear or logarithmic y axis.
"""

from __future__ import annotations

import datetime as dt
import html
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#17becf", "#7f7f7f")
MAX_POINTS = 2_000
"""Points per series drawn; longer series are reduced to per-bucket maxima first."""

_MARGIN_LEFT, _MARGIN_RIGHT, _MARGIN_TOP, _MARGIN_BOTTOM = 64, 16, 36, 64


@dataclass(frozen=True, slots=True)
class Series:
    name: str
    xs: Sequence[float]
    ys: Sequence[float]


@dataclass(frozen=True, slots=True)
class Marker:
    """A vertical line at ``x`` with a short label, e.g. a leader change."""

    x: float
    label: str


@dataclass(frozen=True, slots=True)
class Span:
    """A shaded band from ``x0`` to ``x1``, e.g. a failover window."""

    x0: float
    x1: float
    label: str


@dataclass(frozen=True, slots=True)
class BarGroup:
    """One bar per category, all in the same colour: e.g. every group's p99."""

    name: str
    values: Sequence[float | None]


@dataclass(slots=True)
class _Frame:
    width: int
    height: int
    x0: float
    x1: float
    y0: float
    y1: float
    log_y: bool
    parts: list[str] = field(default_factory=list)

    @property
    def plot_w(self) -> float:
        return self.width - _MARGIN_LEFT - _MARGIN_RIGHT

    @property
    def plot_h(self) -> float:
        return self.height - _MARGIN_TOP - _MARGIN_BOTTOM

    def px(self, x: float) -> float:
        span = self.x1 - self.x0 or 1.0
        return _MARGIN_LEFT + (x - self.x0) / span * self.plot_w

    def py(self, y: float) -> float:
        if self.log_y:
            lo, hi, y = math.log10(self.y0), math.log10(self.y1), math.log10(max(y, self.y0))
        else:
            lo, hi = self.y0, self.y1
        span = hi - lo or 1.0
        return _MARGIN_TOP + self.plot_h - (y - lo) / span * self.plot_h


def _esc(text: str) -> str:
    return html.escape(text, quote=True)


def nice_ticks(lo: float, hi: float, count: int = 6) -> list[float]:
    """Round tick values (1, 2, 5 times a power of ten) covering [lo, hi]."""
    if not math.isfinite(lo) or not math.isfinite(hi):
        return [0.0]
    if hi <= lo:
        hi = lo + 1.0
    raw = (hi - lo) / max(count - 1, 1)
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    first = math.floor(lo / step) * step
    ticks = []
    value = first
    while value <= hi + step * 1e-9:
        if value >= lo - step * 1e-9:
            ticks.append(round(value, 12))
        value += step
    return ticks


def _log_ticks(lo: float, hi: float) -> list[float]:
    """Powers of ten within [lo, hi]; also 2x and 5x when that alone would give too few."""
    first, last = math.floor(math.log10(lo)), math.floor(math.log10(hi))
    decades = [10.0**e for e in range(first, last + 1)]
    steps = (1, 2, 5) if last - first < 3 else (1,)
    return [d * m for d in decades for m in steps if lo <= d * m <= hi]


def format_number(value: float) -> str:
    if value == 0:
        return "0"
    magnitude = abs(value)
    if magnitude >= 1_000_000:
        return f"{value / 1_000_000:g}M"
    if magnitude >= 10_000:
        return f"{value / 1_000:g}k"
    if magnitude >= 1:
        return f"{value:g}"
    return f"{value:.3g}"


def _time_label(seconds: float, span_s: float) -> str:
    moment = dt.datetime.fromtimestamp(seconds, tz=dt.UTC)
    return moment.strftime("%H:%M:%S" if span_s < 86_400 * 2 else "%m-%d %H:%M")


def reduce_points(xs: Sequence[float], ys: Sequence[float], limit: int = MAX_POINTS) -> Series:
    """At most ``limit`` points, keeping each bucket's maximum so that spikes stay visible."""
    if len(xs) <= limit:
        return Series("", list(xs), list(ys))
    size = math.ceil(len(xs) / limit)
    out_x, out_y = [], []
    for start in range(0, len(xs), size):
        chunk = range(start, min(start + size, len(xs)))
        best = max(chunk, key=lambda i: ys[i])
        out_x.append(xs[best])
        out_y.append(ys[best])
    return Series("", out_x, out_y)


def _segments(series: Series, max_gap: float | None) -> list[list[tuple[float, float]]]:
    segments: list[list[tuple[float, float]]] = [[]]
    last_x: float | None = None
    for x, y in zip(series.xs, series.ys, strict=True):
        if max_gap is not None and last_x is not None and x - last_x > max_gap:
            segments.append([])
        segments[-1].append((x, y))
        last_x = x
    return [seg for seg in segments if seg]


def _open(frame: _Frame, title: str) -> None:
    frame.parts.append(
        f'<svg xmlns="http://www.w3.org/2000/svg" role="img" width="{frame.width}" '
        f'height="{frame.height}" viewBox="0 0 {frame.width} {frame.height}" '
        'font-family="sans-serif" font-size="11">'
        f"<title>{_esc(title)}</title>"
        f'<rect width="{frame.width}" height="{frame.height}" fill="#ffffff"/>'
        f'<text x="{_MARGIN_LEFT}" y="20" font-size="13" font-weight="bold">{_esc(title)}</text>'
    )


def _y_axis(frame: _Frame, label: str) -> None:
    ticks = _log_ticks(frame.y0, frame.y1) if frame.log_y else nice_ticks(frame.y0, frame.y1)
    right = frame.width - _MARGIN_RIGHT
    for tick in ticks:
        y = frame.py(tick)
        frame.parts.append(
            f'<line x1="{_MARGIN_LEFT}" x2="{right}" y1="{y:.1f}" y2="{y:.1f}" stroke="#e5e5e5"/>'
            f'<text x="{_MARGIN_LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">'
            f"{format_number(tick)}</text>"
        )
    mid = _MARGIN_TOP + frame.plot_h / 2
    frame.parts.append(
        f'<text transform="translate(14 {mid:.1f}) rotate(-90)" text-anchor="middle">'
        f"{_esc(label)}</text>"
    )


def _legend(frame: _Frame, names: Sequence[str]) -> None:
    x = _MARGIN_LEFT
    y = frame.height - 14
    for i, name in enumerate(names):
        colour = PALETTE[i % len(PALETTE)]
        frame.parts.append(
            f'<rect x="{x}" y="{y - 9}" width="12" height="10" fill="{colour}"/>'
            f'<text x="{x + 16}" y="{y}">{_esc(name)}</text>'
        )
        x += 28 + 7 * len(name)


def _empty(title: str, width: int, height: int) -> str:
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" role="img" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">'
        f'<title>{_esc(title)}</title><rect width="{width}" height="{height}" fill="#fafafa" '
        f'stroke="#dddddd"/><text x="{width / 2}" y="{height / 2}" text-anchor="middle">'
        f"{_esc(title)}: no data</text></svg>"
    )


def line_chart(
    series: Sequence[Series],
    *,
    title: str,
    y_label: str,
    markers: Sequence[Marker] = (),
    spans: Sequence[Span] = (),
    time_x: bool = True,
    log_y: bool = False,
    max_gap: float | None = None,
    width: int = 920,
    height: int = 300,
) -> str:
    """Lines over x (epoch seconds when ``time_x``); markers and spans drawn behind the lines.

    With ``max_gap``, a line is broken where two consecutive points are further apart than
    that on x (no data there), instead of being drawn straight across.
    """
    drawn = [
        Series(s.name, r.xs, r.ys) for s in series if s.xs for r in [reduce_points(s.xs, s.ys)]
    ]
    if not drawn:
        return _empty(title, width, height)
    xs = [x for s in drawn for x in s.xs]
    ys = [y for s in drawn for y in s.ys]
    x0, x1 = min(xs), max(xs)
    if x1 == x0:
        x0, x1 = x0 - 1, x1 + 1
    if log_y:
        positive = [y for y in ys if y > 0] or [1.0]
        y0, y1 = 10 ** math.floor(math.log10(min(positive))), max(positive) * 1.2
    else:
        ticks = nice_ticks(min(0.0, min(ys)), max(ys) * 1.05 if max(ys) > 0 else 1.0)
        y0, y1 = ticks[0], ticks[-1]
    frame = _Frame(width, height, x0, x1, y0, y1, log_y)
    _open(frame, title)
    _y_axis(frame, y_label)
    top, bottom = _MARGIN_TOP, _MARGIN_TOP + frame.plot_h
    for span in spans:
        if span.x1 < x0 or span.x0 > x1:
            continue
        a, b = frame.px(max(span.x0, x0)), frame.px(min(span.x1, x1))
        frame.parts.append(
            f'<rect x="{a:.1f}" y="{top}" width="{max(b - a, 2):.1f}" height="{frame.plot_h:.1f}" '
            f'fill="#f4a582" fill-opacity="0.45"><title>{_esc(span.label)}</title></rect>'
        )
    for marker in markers:
        if not x0 <= marker.x <= x1:
            continue
        x = frame.px(marker.x)
        frame.parts.append(
            f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{top}" y2="{bottom:.1f}" stroke="#444444" '
            f'stroke-dasharray="4 3"><title>{_esc(marker.label)}</title></line>'
            f'<text x="{x + 3:.1f}" y="{top + 10}" fill="#444444">{_esc(marker.label)}</text>'
        )
    span_s = x1 - x0
    for tick in nice_ticks(x0, x1, 8):
        x = frame.px(tick)
        text = _time_label(tick, span_s) if time_x else format_number(tick)
        frame.parts.append(
            f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{bottom:.1f}" y2="{bottom + 4:.1f}" '
            f'stroke="#888888"/><text x="{x:.1f}" y="{bottom + 16:.1f}" text-anchor="middle">'
            f"{_esc(text)}</text>"
        )
    if time_x:
        frame.parts.append(
            f'<text x="{width - _MARGIN_RIGHT}" y="{bottom + 30:.1f}" text-anchor="end" '
            f'fill="#666666">time (UTC)</text>'
        )
    for i, s in enumerate(drawn):
        colour = PALETTE[i % len(PALETTE)]
        for segment in _segments(s, max_gap):
            points = " ".join(f"{frame.px(x):.1f},{frame.py(y):.1f}" for x, y in segment)
            frame.parts.append(
                f'<polyline fill="none" stroke="{colour}" stroke-width="1.5" points="{points}"/>'
            )
    frame.parts.append(
        f'<rect x="{_MARGIN_LEFT}" y="{top}" width="{frame.plot_w:.1f}" '
        f'height="{frame.plot_h:.1f}" fill="none" stroke="#888888"/>'
    )
    _legend(frame, [s.name for s in drawn])
    frame.parts.append("</svg>")
    return "".join(frame.parts)


def bar_chart(
    categories: Sequence[str],
    groups: Sequence[BarGroup],
    *,
    title: str,
    y_label: str,
    log_y: bool = True,
    width: int = 920,
    height: int = 320,
) -> str:
    """Grouped bars: for each category one bar per group (e.g. p50, p99, p99.9)."""
    values = [v for g in groups for v in g.values if v is not None]
    if not categories or not values:
        return _empty(title, width, height)
    if log_y:
        positive = [v for v in values if v > 0] or [1.0]
        y0, y1 = 10 ** math.floor(math.log10(min(positive))), max(positive) * 1.3
    else:
        ticks = nice_ticks(min(0.0, min(values)), max(values) * 1.05 if max(values) > 0 else 1.0)
        y0, y1 = ticks[0], ticks[-1]
    frame = _Frame(width, height, 0, len(categories), y0, y1, log_y)
    _open(frame, title)
    _y_axis(frame, y_label)
    slot = frame.plot_w / len(categories)
    bar_w = max(1.0, slot * 0.8 / max(len(groups), 1))
    base = _MARGIN_TOP + frame.plot_h
    for c, category in enumerate(categories):
        left = _MARGIN_LEFT + c * slot + slot * 0.1
        for g, group in enumerate(groups):
            value = group.values[c] if c < len(group.values) else None
            if value is None or (log_y and value <= 0):
                continue
            top = frame.py(value)
            frame.parts.append(
                f'<rect x="{left + g * bar_w:.1f}" y="{top:.1f}" width="{bar_w:.1f}" '
                f'height="{max(base - top, 0.5):.1f}" fill="{PALETTE[g % len(PALETTE)]}">'
                f"<title>{_esc(category)} {_esc(group.name)}: {value:g}</title></rect>"
            )
        x = left + slot * 0.4
        frame.parts.append(
            f'<text x="{x:.1f}" y="{base + 14:.1f}" text-anchor="middle">{_esc(category)}</text>'
        )
    frame.parts.append(
        f'<rect x="{_MARGIN_LEFT}" y="{_MARGIN_TOP}" width="{frame.plot_w:.1f}" '
        f'height="{frame.plot_h:.1f}" fill="none" stroke="#888888"/>'
    )
    _legend(frame, [g.name for g in groups])
    frame.parts.append("</svg>")
    return "".join(frame.parts)
