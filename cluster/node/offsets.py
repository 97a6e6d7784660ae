"""Consumer-group offsets: where they live in the replicated key-value table.

One entry per (group, topic, queue), ``go/<group>/<topic>/<queue>`` -> the next offset to
consume, written by a commit (``PUT /v1/groups/{group}/offsets``, the gRPC
``UpdateOffset``) and read by lookups, lag metrics and the offsets answers.
"""

from __future__ import annotations

from typing import Final

GROUP_OFFSET_PREFIX: Final = "go/"


def group_offset_key(group: str, topic: str, queue: int) -> str:
    return f"{GROUP_OFFSET_PREFIX}{group}/{topic}/{queue}"
