"""The replicated membership history: the last changes, identical on every node.

Kept in the replicated key-value table under :data:`HISTORY_KEY` as one JSON array (the
leader writes it with compare-and-set in the same command as the ``member/<id>`` entry), at
most :data:`HISTORY_MAX` entries, oldest first::

    {"seq": 7, "action": "add" | "remove", "id": 3, "raft": "127.0.0.1:26303",
     "http": "http://127.0.0.1:26003", "at_ms": 1790000000000, "term": 12}

``seq`` numbers changes from 1; ``at_ms`` is the leader's clock when it proposed the change,
``term`` its term. Parsing is total: a damaged value reads as an empty history.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import orjson

HISTORY_KEY = "membership/history"
HISTORY_MAX = 100
ACTIONS = ("add", "remove")


@dataclass(frozen=True, slots=True)
class HistoryEntry:
    action: str
    id: int
    raft: str
    http: str
    at_ms: int
    term: int


def parse_history(value: object) -> list[dict[str, Any]]:
    """The entries of a stored history (``[]`` for None or anything damaged)."""
    if not isinstance(value, str):
        return []
    try:
        raw = orjson.loads(value)
    except orjson.JSONDecodeError:
        return []
    if not isinstance(raw, list):
        return []
    return [e for e in raw if isinstance(e, dict) and isinstance(e.get("seq"), int)]


def append_history(old: object, entry: HistoryEntry) -> str:
    """The stored history ``old`` with ``entry`` appended, the oldest dropped past
    :data:`HISTORY_MAX`."""
    entries = parse_history(old)
    seq = entries[-1]["seq"] + 1 if entries else 1
    entries.append({"seq": seq, **asdict(entry)})
    return orjson.dumps(entries[-HISTORY_MAX:]).decode()


def describe(entry: dict[str, Any]) -> str:
    verb = {"add": "added", "remove": "removed"}.get(str(entry.get("action")), "changed")
    return (
        f"#{entry.get('seq')}: node {entry.get('id')} {verb} (raft {entry.get('raft')}, "
        f"http {entry.get('http')}) in term {entry.get('term')}"
    )
