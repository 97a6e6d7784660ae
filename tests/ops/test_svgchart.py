"""The report's SVG charts: axis ticks, point reduction, gaps, escaping, empty data."""

from __future__ import annotations

import xml.etree.ElementTree as ET

from chronomq.ops import svgchart as chart


def parse(svg: str) -> ET.Element:
    return ET.fromstring(svg)


def test_nice_ticks_are_round_and_cover_the_range() -> None:
    assert chart.nice_ticks(0, 100) == [0, 20, 40, 60, 80, 100]
    assert chart.nice_ticks(0, 7) == [0, 2, 4, 6]
    ticks = chart.nice_ticks(1_700_000_000, 1_700_000_090, 8)
    assert all(t % 10 == 0 for t in ticks) and len(ticks) >= 5
    assert chart.nice_ticks(5, 5) == [5, 5.2, 5.4, 5.6, 5.8, 6]


def test_reduce_points_keeps_spikes() -> None:
    xs = list(range(10_000))
    ys = [1.0] * 10_000
    ys[4_321] = 99.0
    reduced = chart.reduce_points(xs, ys, limit=100)
    assert len(reduced.xs) <= 100 and 99.0 in reduced.ys and 4_321 in reduced.xs


def test_line_chart_breaks_lines_over_gaps_and_draws_markers() -> None:
    svg = chart.line_chart(
        [chart.Series("n1 <p99>", [0, 1, 2, 50, 51], [1, 2, 3, 4, 5])],
        title="lag & more",
        y_label="ms",
        markers=[chart.Marker(20, "n1 leads")],
        spans=[chart.Span(30, 31, "no commits")],
        max_gap=2.5,
    )
    root = parse(svg)  # well-formed XML: labels are escaped
    ns = "{http://www.w3.org/2000/svg}"
    assert len(root.findall(f"{ns}polyline")) == 2
    texts = [t.text for t in root.iter(f"{ns}text")]
    assert "n1 <p99>" in texts and "n1 leads" in texts and "lag & more" in texts
    assert root.find(f"{ns}title").text == "lag & more"  # type: ignore[union-attr]


def test_log_axis_ticks_stay_inside_the_plot() -> None:
    svg = chart.bar_chart(
        ["L1", "timer"], [chart.BarGroup("p99", [120.0, 480.0])], title="t", y_label="ms"
    )
    labels = {t.text for t in parse(svg).iter("{http://www.w3.org/2000/svg}text")}
    assert {"100", "200", "500"} <= labels and "1000" not in labels


def test_empty_charts_say_so() -> None:
    for svg in (
        chart.line_chart([chart.Series("a", [], [])], title="Throughput", y_label="x"),
        chart.bar_chart([], [], title="Lateness", y_label="ms"),
    ):
        assert "no data" in svg
        parse(svg)
