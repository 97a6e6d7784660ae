"""What the ``chronomq bench`` commands share: progress lines, the CPU their processes spend,
and the table and JSON file each run ends with.

CPU is read from Linux's ``/proc``: a node process's user + system time from
``/proc/<pid>/stat``, the whole machine's busy and total jiffies from ``/proc/stat``. Where
``/proc`` cannot tell (another OS, a process gone), the figure is ``None``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from chronomq.cluster.cli.output import print_rows, write_json
from chronomq.cluster.config.nodeconfig import ConfigError

EXIT_BAD_CONFIG = 2
EXIT_COULD_NOT_RUN = 3


def _whole(text: str, low: int, high: int | None = None) -> int:
    try:
        value = int(text.replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < low or (high is not None and value > high):
        raise argparse.ArgumentTypeError(
            f"must be at least {low}" if high is None else f"must be within {low}..{high}"
        )
    return value


def positive(text: str) -> int:
    """An ``argparse`` type: a whole number of at least 1 (counts, sizes, seconds)."""
    return _whole(text, 1)


def non_negative(text: str) -> int:
    """An ``argparse`` type: a whole number of at least 0 (0 switches a phase off)."""
    return _whole(text, 0)


def port_base(text: str) -> int:
    """An ``argparse`` type: a TCP port the nodes' ports start from."""
    return _whole(text, 1, 65_000)


def cluster_command(
    command: str, main: Callable[[argparse.Namespace], int]
) -> Callable[[argparse.Namespace], int]:
    """``main`` of a benchmark that starts its own cluster, telling a cluster that cannot start
    in one line rather than a traceback: ports that clash or a bad setting (exit 2, naming
    the settings), a node that exits or is killed, or no leader (exit 3)."""

    def run(args: argparse.Namespace) -> int:
        try:
            return main(args)
        except ConfigError as exc:
            print(f"chronomq {command}: bad configuration: {exc}", file=sys.stderr)
            return EXIT_BAD_CONFIG
        except (RuntimeError, TimeoutError) as exc:
            print(f"chronomq {command}: could not run: {exc}", file=sys.stderr)
            return EXIT_COULD_NOT_RUN

    return run


def progress(msg: str) -> None:
    """A line on stderr, at once: how far a long run has come."""
    print(msg, file=sys.stderr, flush=True)


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time a process has used so far (Linux ``/proc/<pid>/stat``)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def _machine_jiffies() -> tuple[int, int] | None:
    """(busy, total) CPU jiffies of the whole machine since boot (Linux ``/proc/stat``)."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


@dataclass(frozen=True, slots=True)
class CpuSample:
    """CPU used so far by this process (the benchmark's client), each node and the machine."""

    wall_s: float
    client_s: float
    nodes_s: dict[int, float | None]
    machine: tuple[int, int] | None


def cpu_sample(pids: Mapping[int, int]) -> CpuSample:
    """A sample of the node processes ``pids`` (node index -> pid), this process and the machine."""
    t = os.times()
    return CpuSample(
        wall_s=time.monotonic(),
        client_s=t.user + t.system,
        nodes_s={i: cpu_seconds(pid) for i, pid in pids.items()},
        machine=_machine_jiffies(),
    )


def node_cpu_s(before: CpuSample, after: CpuSample) -> dict[int, float | None]:
    """CPU seconds each node spent between two samples (``None`` where one is unknown)."""
    spent: dict[int, float | None] = {}
    for i, b in before.nodes_s.items():
        a = after.nodes_s.get(i)
        spent[i] = a - b if a is not None and b is not None else None
    return spent


def cpu_figures(before: CpuSample, after: CpuSample, leader: int) -> dict[str, Any]:
    """CPU of a phase as percent of one core: the client, the leader, every node, the machine."""
    wall = max(after.wall_s - before.wall_s, 1e-9)

    def pct(seconds: float | None) -> float | None:
        return round(100 * seconds / wall, 1) if seconds is not None else None

    spent = node_cpu_s(before, after)
    nodes = {f"node{i}" + ("(leader)" if i == leader else ""): pct(s) for i, s in spent.items()}
    machine = None
    if before.machine and after.machine:
        busy = after.machine[0] - before.machine[0]
        total = after.machine[1] - before.machine[1]
        machine = round(100 * (os.cpu_count() or 1) * busy / total, 1) if total > 0 else None
    return {
        "client_pct": pct(after.client_s - before.client_s),
        "leader_pct": pct(spent.get(leader)),
        "nodes_pct": nodes,
        "machine_pct": machine,
    }


def figure_rows(
    result: Mapping[str, Any], keys: Iterable[str], *, with_settings: bool = False
) -> list[tuple[str, Any]]:
    """``(key, value)`` for each of ``keys`` that ``result`` holds, in that order; with
    ``with_settings``, then a ``settings`` row of the ``--set`` keys the nodes ran with, if any."""
    rows = [(k, result[k]) for k in keys if k in result]
    settings = result.get("settings") if with_settings else None
    if settings:
        rows.append(("settings", " ".join(f"{k}={v}" for k, v in settings.items())))
    return rows


def print_figures(
    rows: Sequence[tuple[str, Any]], result: Mapping[str, Any], out: str | None
) -> None:
    """How a benchmark ends: ``rows`` as a table on stdout, and all of ``result`` as JSON in
    ``out`` (the ``--out`` file; nothing is written without one)."""
    print_rows(rows)
    write_json(result, out)
