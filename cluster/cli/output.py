"""How the bench, drill and status commands print their figures: a two-column table, and the
JSON file named by ``--out``."""

from __future__ import annotations

import json
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
