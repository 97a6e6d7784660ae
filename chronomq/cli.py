"""The ``chronomq`` command: the node's commands (:mod:`chronomq.cluster.cli.commands`) and the operator tools
of :mod:`chronomq.ops` (bench, drill, report), assembled here, above both packages, so that the node
package never imports the tooling."""

from __future__ import annotations

import argparse
from typing import Any

from chronomq.cluster.cli.commands import build_parser as build_node_parser
from chronomq.cluster.cli.commands import main as node_main
from chronomq.cluster.cli.output import example_epilog, paragraph
from chronomq.ops.bench_grpc import register as register_bench_grpc
from chronomq.ops.bench_models import register as register_bench_models
from chronomq.ops.bench_produce import register as register_bench_produce
from chronomq.ops.bench_schedule import register as register_bench_schedule
from chronomq.ops.bench_timer import register as register_bench_timer
from chronomq.ops.cli import register as register_ops
from chronomq.ops.drill.run import register as register_drill


def add_ops_commands(sub: Any) -> None:
    """``bench``, ``drill``, ``report`` and ``synth`` on the command's subparsers."""
    bench = sub.add_parser(
        "bench",
        help="benchmarks (print a table, write JSON with --out)",
        description=paragraph(
            "Benchmarks, each on a cluster of its own (models: in this process): each "
            "prints a table and, with --out, writes its figures as one JSON object."
        ),
        epilog=example_epilog(
            "chronomq bench produce --nodes 3 --messages 200000 --out produce.json",
            "chronomq bench schedule --levels 4 --messages-per-level 20000 --out schedule.json",
            "chronomq bench timer --rate 2000 --duration 60 --out timer.json",
            "chronomq bench grpc --out grpc.json",
            "chronomq bench models --out models.json",
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bsub = bench.add_subparsers(dest="bench_cmd", required=True, metavar="BENCH")
    register_bench_produce(bsub)
    register_bench_timer(bsub)
    register_bench_schedule(bsub)
    register_bench_grpc(bsub)
    register_bench_models(bsub)
    register_drill(sub)
    register_ops(sub)


def build_parser() -> argparse.ArgumentParser:
    return build_node_parser(add_ops_commands)


def main(argv: list[str] | None = None) -> int:
    return node_main(argv, build_parser)
