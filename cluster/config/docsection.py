"""Generated parts of the docs: splice a reference between two markers, or check it.

``chronomq config reference`` (:mod:`chronomq.cluster.config.doc`) and ``chronomq api reference``
(:mod:`chronomq.cluster.httpapi.apidoc`) print their table; ``--write FILE`` replaces the part of ``FILE``
between their markers, and ``--check FILE`` exits 1 when that part is stale.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path


def splice(text: str, start_marker: str, end_marker: str, body: str) -> str:
    """``text`` with the part between the markers replaced by ``body``."""
    start, end = text.find(start_marker), text.find(end_marker)
    if start < 0 or end < start:
        raise ValueError(f"the markers {start_marker!r} and {end_marker!r} are missing")
    return text[: start + len(start_marker)] + "\n" + body + text[end:]


def run(
    mode: str | None,
    path: str | None,
    *,
    what: str,
    command: str,
    splice_into: Callable[[str], str],
    reference: Callable[[], str],
    missing: list[str],
    missing_label: str,
) -> int:
    """Print the reference (``mode`` None), or ``"write"`` or ``"check"`` it in ``path``."""
    if missing:
        print(f"{missing_label}: {', '.join(missing)}", file=sys.stderr)
        return 1
    if mode is None:
        sys.stdout.write(reference())
        return 0
    assert path is not None
    target = Path(path)
    current = target.read_text()
    try:
        wanted = splice_into(current)
    except ValueError as exc:
        print(f"{path}: {exc}", file=sys.stderr)
        return 1
    if mode == "check":
        if wanted != current:
            print(f"{path}: {what} is stale; run `{command} --write {path}`", file=sys.stderr)
            return 1
        return 0
    target.write_text(wanted)
    return 0
