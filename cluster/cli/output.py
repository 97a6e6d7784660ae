"""How the commands print: tables (name and value rows, or rows by column), the JSON file named
by ``--out``, and their ``--help`` text."""

from __future__ import annotations

import json
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


def print_rows(rows: Sequence[tuple[str, Any]]) -> int:
    """Print ``rows`` as name and value columns; return the name column's width."""
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k.ljust(width)}  {v}")
    return width


def write_json(result: Mapping[str, Any], out: str | None) -> None:
    """Write ``result`` to ``out`` as indented JSON (nothing when ``out`` is not given)."""
    if out:
        Path(out).write_text(json.dumps(result, indent=2) + "\n")


def _table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    widths = {
        c: max(len(c), *(len(str(r.get(c, ""))) for r in rows)) if rows else len(c) for c in columns
    }
    lines = ["  ".join(c.upper().ljust(widths[c]) for c in columns)]
    for r in rows:
        lines.append("  ".join(str(r.get(c, "")).ljust(widths[c]) for c in columns))
    return "\n".join(lines)


def print_table(rows: list[dict[str, Any]], columns: list[str]) -> None:
    print(_table(rows, columns))


def paragraph(text: str) -> str:
    """A description wrapped for --help: the raw formatter, which keeps an epilog's examples
    as written, does not wrap descriptions either."""
    return textwrap.fill(text, 88)


def example_epilog(*lines: str) -> str:
    """An epilog listing example command lines."""
    return ("examples:\n" if len(lines) > 1 else "example:\n") + "".join(
        f"  {line}\n" for line in lines
    )
