"""The report as one self-contained HTML page: inline CSS, inline SVG charts, no scripts.

Nothing is fetched when the page opens (no fonts, scripts or images from the network), so it
reads the same offline, attached to an incident ticket or opened from a CI artifact.
"""

from __future__ import annotations

import datetime as dt
import html
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from chronomq.ops import svgchart as chart

if TYPE_CHECKING:
    from chronomq.ops.report import ReportData
    from chronomq.ops.report_tables import Table

MAX_HTML_ROWS = 200

_CSS = """
body{font-family:-apple-system,'Segoe UI',Roboto,Helvetica,Arial,sans-serif;margin:24px auto;
max-width:980px;color:#222;line-height:1.4}
h1{font-size:22px;margin-bottom:4px}h2{font-size:18px;margin-top:32px;border-bottom:1px solid #ddd}
.meta{color:#555;font-size:13px}
table{border-collapse:collapse;font-size:12px;margin:8px 0 16px}
.scroll{overflow-x:auto;max-width:100%}
th,td{border:1px solid #ddd;padding:3px 7px;text-align:right;white-space:nowrap}
th{background:#f3f3f3}td.l,th.l{text-align:left}
.cards{display:flex;flex-wrap:wrap;gap:10px;margin:14px 0}
.card{border:1px solid #ddd;border-radius:6px;padding:8px 12px;min-width:150px}
.card b{display:block;font-size:20px}.card span{color:#555;font-size:12px}
.warn{background:#fff4e5;border:1px solid #f0b35a;padding:8px 12px;border-radius:6px}
.note{color:#555;font-size:12px}svg{display:block;margin:8px 0}
"""


def _esc(value: Any) -> str:
    return html.escape(str(value), quote=True)


def fmt_time(ms: int | None) -> str:
    if ms is None:
        return "-"
    moment = dt.datetime.fromtimestamp(ms / 1000, tz=dt.UTC)
    return moment.strftime("%Y-%m-%d %H:%M:%S.") + f"{ms % 1000:03d}Z"


TIME_COLUMNS = frozenset(
    {
        "ts_ms",
        "first_commit_ms",
        "last_commit_ms",
        "old_last_commit_ms",
        "new_first_commit_ms",
        "last_delivery_before_ms",
        "first_delivery_after_ms",
    }
)


def _fmt(value: Any, column: str) -> str:
    if value is None:
        return "-"
    if column in TIME_COLUMNS and isinstance(value, int):
        return fmt_time(value)
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:,.2f}".rstrip("0").rstrip(".")
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def table_html(table: Table, columns: Sequence[str] | None = None) -> str:
    names = list(columns) if columns else [c for c, _ in table.columns]
    types = dict(table.columns)
    records = table.records()
    if not records:
        return '<p class="note">no data</p>'
    head = "".join(
        f'<th class="{"l" if types.get(n) == "string" else ""}">{_esc(n)}</th>' for n in names
    )
    body = []
    for r in records[:MAX_HTML_ROWS]:
        cells = "".join(
            f'<td class="{"l" if types.get(n) == "string" else ""}">{_esc(_fmt(r.get(n), n))}</td>'
            for n in names
        )
        body.append(f"<tr>{cells}</tr>")
    more = ""
    if len(records) > MAX_HTML_ROWS:
        more = (
            f'<p class="note">first {MAX_HTML_ROWS} of {len(records):,} rows; all in '
            f"csv/{_esc(table.name)}.csv</p>"
        )
    return f'<div class="scroll"><table><tr>{head}</tr>{"".join(body)}</table></div>{more}'


def _short(group: str) -> str:
    if group.startswith("level "):
        return "L" + group.split()[1]
    return {"levels (all)": "levels", "all": "all"}.get(group, group)


def _lateness_chart(table: Table) -> str:
    rows = table.records()
    names = ("p50_ms", "p90_ms", "p99_ms", "p999_ms")
    labels = ("p50", "p90", "p99", "p99.9")
    return chart.bar_chart(
        [_short(r["group"]) for r in rows],
        [
            chart.BarGroup(label, [r[n] for r in rows])
            for n, label in zip(names, labels, strict=True)
        ],
        title="Delivery lateness (delivered - due) by delay level and for timers",
        y_label="ms (log scale)",
    )


def _histogram_chart(table: Table) -> str:
    rows = table.records()
    buckets: list[tuple[Any, Any]] = sorted(
        {(r["from_ms"], r["to_ms"]) for r in rows}, key=lambda b: -1 if b[0] is None else b[0]
    )
    kinds = sorted({r["kind"] for r in rows})
    counts = {(r["kind"], r["from_ms"], r["to_ms"]): r["count"] for r in rows}

    def label(lo: Any, hi: Any) -> str:
        if lo is None:
            return "early"
        return f">={lo:,}" if hi is None else f"{lo:,}-{hi:,}"

    return chart.bar_chart(
        [label(lo, hi) for lo, hi in buckets],
        [chart.BarGroup(k, [counts.get((k, lo, hi)) for lo, hi in buckets]) for k in kinds],
        title="Deliveries by lateness (ms)",
        y_label="deliveries (log scale)",
    )


def _markers_and_spans(data: ReportData) -> tuple[list[chart.Marker], list[chart.Span]]:
    markers = [
        chart.Marker(r["ts_ms"] / 1000, f"{r['leader']} leads (term {r['term']})")
        for r in data.summary.get("leader_changes", [])
        if r.get("ts_ms") is not None
    ]
    spans = [
        chart.Span(
            f["old_last_commit_ms"] / 1000,
            f["new_first_commit_ms"] / 1000,
            f"no commits for {f['window_ms']} ms ({f['old_leader']} -> {f['new_leader']})",
        )
        for f in data.summary.get("failovers", [])
    ]
    return markers, spans


def _throughput_chart(table: Table, data: ReportData) -> str:
    rows = table.records()
    markers, spans = _markers_and_spans(data)
    bucket = rows[0]["bucket_s"] if rows else 1
    # Buckets without any message have no row: draw them as zero, not as a straight line.
    by_second = {r["second"]: r for r in rows}
    seconds = range(rows[0]["second"], rows[-1]["second"] + bucket, bucket) if rows else range(0)
    series = [
        chart.Series(
            what,
            list(seconds),
            [by_second[x][what] / bucket if x in by_second else 0.0 for x in seconds],
        )
        for what in ("produced", "delivered", "consumed")
    ]
    unit = "per second" if bucket == 1 else f"per second (averaged over {bucket} s)"
    return chart.line_chart(
        series,
        title="Throughput: messages produced, delivered and consumed",
        y_label=f"messages {unit}",
        markers=markers,
        spans=spans,
    )


def _lag_chart(table: Table, data: ReportData) -> str:
    rows = table.records()
    markers, spans = _markers_and_spans(data)
    series = []
    bucket = rows[0]["bucket_s"] if rows else 1
    for node in sorted({r["node"] for r in rows}):
        mine = [r for r in rows if r["node"] == node]
        series.append(
            chart.Series(
                f"{node} p99",
                [r["second"] for r in mine],
                [max(r["p99_ms"] or 0.0, 0.1) for r in mine],
            )
        )
    return chart.line_chart(
        series,
        title="Follower apply lag over time (p99 per second)",
        y_label="ms (log scale)",
        markers=markers,
        spans=spans,
        log_y=True,
        max_gap=2.5 * bucket,
    )


def _card(value: Any, label: str) -> str:
    return f'<div class="card"><b>{_esc(value)}</b><span>{_esc(label)}</span></div>'


def _warnings(summary: dict[str, Any]) -> list[str]:
    out = []
    for record_type, c in summary["inputs"].items():
        if c["corrupt"]:
            out.append(f"{c['corrupt']:,} corrupt or truncated {record_type} lines were skipped.")
        if c["newer_version"]:
            out.append(
                f"{c['newer_version']:,} {record_type} lines of a newer schema version were skipped."
            )
    if summary.get("writer_dropped_records"):
        out.append(
            f"The nodes' log writers dropped {summary['writer_dropped_records']:,} records "
            "(buffer full): figures below miss them."
        )
    messages = summary.get("messages", {})
    if messages.get("duplicate_deliveries"):
        out.append(f"{messages['duplicate_deliveries']:,} messages were delivered more than once.")
    if messages.get("undelivered"):
        out.append(
            f"{messages['undelivered']:,} delayed messages have no delivery line "
            "(still pending at the end of the logs, or lost)."
        )
    unmatched = summary.get("replication", {}).get("follower_lines_without_leader_line")
    if unmatched:
        out.append(f"{unmatched:,} follower apply lines have no leader line to join with.")
    return out


def render(data: ReportData, run: dict[str, Any], *, title: str = "chronomq report") -> str:
    s = data.summary
    tables = {t.name: t for t in data.tables}
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{_esc(title)}</title><style>{_CSS}</style></head><body>",
        f"<h1>{_esc(title)}</h1>",
        f'<p class="meta">logs {fmt_time(s["time_range_ms"]["first"])} to '
        f"{fmt_time(s['time_range_ms']['last'])} from {_esc(', '.join(run['logs']))}<br>"
        f"computed on {_esc(run['master'])} (Spark {_esc(run['spark_version'])}) in "
        f"{run['elapsed_s']:.1f} s, {run['lines']:,} lines, generated "
        f"{fmt_time(run['generated_at_ms'])}</p>",
    ]
    warnings = _warnings(s)
    if warnings:
        parts.append('<div class="warn">' + "<br>".join(_esc(w) for w in warnings) + "</div>")
    cards = []
    messages = s.get("messages", {})
    if messages:
        cards.append(_card(f"{messages['messages']:,}", "messages"))
    for row in s.get("lateness_ms", []):
        if row["group"] in ("levels (all)", "timer") and row["p99_ms"] is not None:
            cards.append(_card(f"{row['p99_ms']:,.0f} ms", f"p99 lateness, {row['group']}"))
    commit = [
        r for r in s.get("replication", {}).get("commit_latency_ms", []) if r["leader"] == "all"
    ]
    if commit and commit[0]["p99_ms"] is not None:
        cards.append(_card(f"{commit[0]['p99_ms']:,.1f} ms", "p99 commit latency"))
    if s.get("failovers"):
        worst = max(f["window_ms"] for f in s["failovers"])
        cards.append(_card(f"{worst:,} ms", f"longest failover window ({len(s['failovers'])})"))
    parts.append('<div class="cards">' + "".join(cards) + "</div>")

    parts.append("<h2>Delivery lateness</h2>")
    parts.append(
        '<p class="note">delivered - due, in ms; exact percentiles. "early" counts deliveries '
        "before their due time (clock differences between leaders, or a bug).</p>"
    )
    if "lateness" in tables:
        parts.append(_lateness_chart(tables["lateness"]))
        parts.append(
            table_html(
                tables["lateness"],
                (
                    "group",
                    "delay_ms",
                    "messages",
                    "count",
                    "undelivered",
                    "p50_ms",
                    "p90_ms",
                    "p99_ms",
                    "p999_ms",
                    "max_ms",
                    "early_count",
                ),
            )
        )
    if "lateness_histogram" in tables:
        parts.append(_histogram_chart(tables["lateness_histogram"]))

    parts.append("<h2>End-to-end latency</h2>")
    parts.append('<p class="note">consumed - due (consumed - stored for plain messages), ms.</p>')
    if "end_to_end" in tables:
        parts.append(table_html(tables["end_to_end"]))

    parts.append("<h2>Throughput</h2>")
    if "throughput" in tables:
        parts.append(_throughput_chart(tables["throughput"], data))
        parts.append(
            '<p class="note">dashed lines: leader changes; shaded: no commits between the old '
            "leader's last commit and the new leader's first. Per second figures in "
            "csv/throughput.csv.</p>"
        )

    parts.append("<h2>Replication</h2>")
    if "commit_latency" in tables:
        parts.append("<p>Commit latency (leader: commit - propose), ms</p>")
        parts.append(table_html(tables["commit_latency"]))
    if "apply_lag" in tables:
        parts.append("<p>Follower apply lag (follower apply - leader commit), ms</p>")
        parts.append(table_html(tables["apply_lag"]))
    if "apply_lag_over_time" in tables:
        parts.append(_lag_chart(tables["apply_lag_over_time"], data))
    if "terms" in tables:
        parts.append("<p>Terms</p>" + table_html(tables["terms"]))

    parts.append("<h2>Failovers</h2>")
    parts.append(
        "<p class=\"note\">window: old leader's last commit to the new leader's first. Delivery "
        "gap: last delivery before that window to the first one after it. Due in window: "
        "messages that fell due while nobody could deliver, and the worst of their lateness.</p>"
    )
    if "failovers" in tables:
        parts.append(table_html(tables["failovers"]))
    if "leader_changes" in tables:
        parts.append("<p>Leader changes (from the events)</p>")
        parts.append(table_html(tables["leader_changes"]))

    parts.append("<h2>Events</h2>")
    if "events" in tables:
        parts.append(table_html(tables["events"]))

    parts.append("<h2>Inputs</h2>")
    if "inputs" in tables:
        parts.append(table_html(tables["inputs"]))
    for record_type, examples in data.examples.items():
        if examples:
            parts.append(
                f'<p class="note">corrupt {_esc(record_type)} lines, for example:</p><pre>'
            )
            parts.append("\n".join(_esc(e) for e in examples) + "</pre>")
    parts.append(
        '<p class="note">tables: csv/*.csv and parquet/*/ next to this file; figures: '
        "summary.json; run details: run.json.</p></body></html>"
    )
    return "\n".join(parts)
