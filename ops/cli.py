"""Command line of the operator tools in this package: ``report`` and ``logs synth``.

:func:`register` adds the subcommands to the main ``chronomq`` parser. Each subcommand stores
its handler as ``func`` on the parsed namespace; a handler takes the namespace and returns the
process exit code. ``python -m ops.cli`` runs them without the rest of the command line.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson

from chronomq.ops.report import (
    DEFAULT_DRIVER_MEMORY,
    DEFAULT_MASTER,
    EXIT_BAD_INPUT,
    EXIT_OK,
    ReportOptions,
    report_main,
)
from chronomq.ops.synth import MAX_ROWS, SynthSpec, synth_logs

_REPORT_EXAMPLES = """\
examples:
  chronomq report --logs ./var/logs --out ./out/report
  chronomq report --logs /mnt/n0/logs /mnt/n1/logs /mnt/n2/logs --out ./out/report
  chronomq report --logs /shared/logs --out /shared/report --master spark://10.0.0.5:7077
  chronomq report --logs ./var/logs --out ./out/report --master sc://spark-connect:15002

--logs takes directories holding one subdirectory per node (DIR/<node>/latency-000001.jsonl)
or a node's directory itself. Exit codes: 0 done, 1 Spark failed, 2 bad input (missing or
empty logs, logs of a newer schema version), 130 interrupted.
"""

_SYNTH_EXAMPLES = """\
examples:
  chronomq logs synth --rows 100000 --out ./out/synth
  chronomq logs synth --rows 10000000 --out /tmp/logs-10m --seed 7
  chronomq report --logs /tmp/logs-10m --out /tmp/report-10m --master 'local[2]'

Writes DIR/<node>/{latency,replication,events}-NNNNNN.jsonl for nodes n0..n2 (and the
drill's events under DIR/drill), plus DIR/synth.json with the figures of the run.
"""


def _conf_pair(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key.strip(), value


def _positive_rows(text: str) -> int:
    try:
        rows = int(text.replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if not 1 <= rows <= MAX_ROWS:
        raise argparse.ArgumentTypeError(f"must be within 1..{MAX_ROWS:,}")
    return rows


def register(subparsers: Any) -> None:
    """Add ``report`` and ``logs synth`` to an ``argparse`` subparsers object."""
    report = subparsers.add_parser(
        "report",
        help="Spark report of replication and message latency logs",
        description="Read every node's replication, latency and event logs with PySpark and "
        "write report.html, summary.json, run.json and the tables as CSV and Parquet.",
        epilog=_REPORT_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    report.add_argument(
        "--logs", nargs="+", required=True, metavar="DIR", help="log directories to read"
    )
    report.add_argument("--out", required=True, metavar="DIR", help="directory for the report")
    report.add_argument(
        "--master",
        default=DEFAULT_MASTER,
        metavar="URL",
        help=f"local[N], spark://host:port or sc://host:port (default {DEFAULT_MASTER})",
    )
    report.add_argument(
        "--conf",
        action="append",
        type=_conf_pair,
        default=[],
        metavar="KEY=VALUE",
        help="a Spark setting, e.g. spark.executor.memory=4g (repeatable)",
    )
    report.add_argument(
        "--driver-memory",
        default=DEFAULT_DRIVER_MEMORY,
        help=f"driver JVM heap when this process starts the driver (default {DEFAULT_DRIVER_MEMORY})",
    )
    report.add_argument(
        "--skip-newer",
        action="store_true",
        help="skip lines of a newer schema version instead of stopping",
    )
    report.add_argument("--title", default="chronomq report", help="title of report.html")
    report.add_argument("--quiet", action="store_true", help="no progress on stderr")
    report.add_argument(
        "--spark-log-level",
        default="WARN",
        choices=("ERROR", "WARN", "INFO", "DEBUG"),
        help="level of Spark's own log on stderr (default WARN)",
    )
    report.set_defaults(func=_report)

    logs = subparsers.add_parser(
        "logs",
        help="tools for the nodes' structured logs",
        description="Tools for the nodes' replication, latency and event logs.",
        epilog="example:\n  chronomq logs synth --rows 100000 --out ./out/synth\n",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    logs_sub = logs.add_subparsers(dest="logs_command", metavar="COMMAND")
    logs.set_defaults(func=lambda _args: _help(logs))
    synth = logs_sub.add_parser(
        "synth",
        help="write realistic synthetic logs of a 3-node run",
        description="Write synthetic node logs: plain, delay-level and timer messages with "
        "realistic lateness, group-committed replication with apply lag, and two leader "
        "changes (a killed leader and a transfer) with their failover gaps.",
        epilog=_SYNTH_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    synth.add_argument("--rows", required=True, type=_positive_rows, help="latency rows to write")
    synth.add_argument("--out", required=True, metavar="DIR", help="directory to write into")
    synth.add_argument("--nodes", type=int, default=3, help="number of nodes (default 3)")
    synth.add_argument("--rate", type=int, default=5_000, help="messages per second (default 5000)")
    synth.add_argument("--seed", type=int, default=1, help="random seed (default 1)")
    synth.add_argument(
        "--start-ms", type=int, default=1_700_000_000_000, help="first timestamp, ms since epoch"
    )
    synth.add_argument(
        "--rotate-mb", type=int, default=64, help="rotate log files at this size (default 64)"
    )
    synth.set_defaults(func=_synth)


def _help(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return EXIT_BAD_INPUT


def _report(args: argparse.Namespace) -> int:
    if importlib.util.find_spec("pyspark") is None:
        print(
            "chronomq report needs Spark, which the broker install leaves out: "
            "pip install 'chronomq[report]' (and a Java 17 runtime), or use the report image "
            "(docker build --target report .)",
            file=sys.stderr,
        )
        return EXIT_BAD_INPUT
    options = ReportOptions(
        logs=tuple(args.logs),
        out=args.out,
        master=args.master,
        conf=tuple(args.conf),
        driver_memory=args.driver_memory,
        skip_newer=args.skip_newer,
        progress=not args.quiet,
        spark_log_level=args.spark_log_level,
        title=args.title,
    )
    return report_main(options)


def _synth(args: argparse.Namespace) -> int:
    try:
        spec = SynthSpec(
            rows=args.rows,
            nodes=args.nodes,
            rate_per_s=args.rate,
            seed=args.seed,
            start_ms=args.start_ms,
            rotate_bytes=args.rotate_mb * 1024 * 1024,
        )
    except ValueError as exc:
        sys.stderr.write(f"chronomq logs synth: error: {exc}\n")
        return EXIT_BAD_INPUT
    out = Path(args.out).absolute()
    try:
        result = synth_logs(out, spec)
    except OSError as exc:
        sys.stderr.write(f"chronomq logs synth: error: cannot write to {out}: {exc}\n")
        return EXIT_BAD_INPUT
    figures = result.as_dict()
    (out / "synth.json").write_bytes(
        orjson.dumps(figures, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS) + b"\n"
    )
    print(
        f"wrote {result.latency_rows:,} latency, {result.replication_rows:,} replication and "
        f"{result.event_rows:,} event rows ({result.messages:,} messages, "
        f"{result.bytes_written / 1e6:,.1f} MB in {result.files} files) to {out} "
        f"in {result.elapsed_s:.1f} s"
    )
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="chronomq", description="chronomq operator tools")
    register(parser.add_subparsers(dest="command", metavar="COMMAND", required=True))
    args = parser.parse_args(argv)
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
