"""Consumer-group offsets: read from the replicated key-value table, committed through Raft
(the keys: :mod:`chronomq.cluster.node.offsets`).
"""

from __future__ import annotations

from typing import Any

from chronomq.cluster.node.broker.base import BrokerBase
from chronomq.cluster.node.offsets import GROUP_OFFSET_PREFIX, group_offset_key


class GroupOffsets(BrokerBase):
    """The broker's consumer-group offsets."""

    def group_offsets(self, group: str, topic: str | None) -> list[dict[str, Any]]:
        prefix = f"{GROUP_OFFSET_PREFIX}{group}/"
        out = []
        for k, v in list(self.raftlog.store.kv.items()):
            if k.startswith(prefix):
                t, _, q = k[len(prefix) :].rpartition("/")
                if topic is None or t == topic:
                    out.append({"topic": t, "queue": int(q), "offset": v})
        return sorted(out, key=lambda x: (x["topic"], x["queue"]))

    async def commit_offset(self, group: str, topic: str, queue: int, offset: int) -> None:
        await self.commit(self.raftlog.update({group_offset_key(group, topic, queue): offset}))
