"""The drill's history: one JSON object per line, appended as operations happen.

Every record has ``op`` (``produce``, ``cancel``, ``consume``, ``ack``, ``fault``), ``type`` and
``t_ms`` (the drill's wall clock). Produce and cancel records go ``invoke`` then one of ``ok``,
``fail`` (the broker refused: it was not stored) or ``unknown`` (no answer: it may or may not
be stored). Consume records are ``ok``. Ack records (the gRPC workload's pop consumption) are
``invoke`` then ``ok``, ``fail`` or ``unknown``, or ``skip`` (left unacked on purpose). Fault records are ``start`` and ``end``. A message is
identified by its ``token`` (also its body), chosen by the workload before it is sent, so a
message whose produce outcome is unknown can still be recognised when it is consumed.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import orjson


def now_ms() -> int:
    return int(time.time() * 1000)


class History:
    """Appends records to a file; cheap enough to call from the event loop."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[bytes] = open(self.path, "ab")  # noqa: SIM115 - closed in close()
        self.count = 0

    def add(self, op: str, type_: str, **fields: Any) -> dict[str, Any]:
        rec = {"op": op, "type": type_, "t_ms": fields.pop("t_ms", None) or now_ms(), **fields}
        self._file.write(orjson.dumps(rec) + b"\n")
        self.count += 1
        return rec

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_history(path: str | Path) -> Iterator[dict[str, Any]]:
    """The records of a history file; a torn last line (the drill was killed) is ignored."""
    with open(path, "rb") as f:
        for line in f:
            if not line.endswith(b"\n"):
                break
            try:
                yield orjson.loads(line)
            except orjson.JSONDecodeError:
                continue
