"""The cluster view: this node's status, every member's (asked over HTTP, briefly), the leader,
the term, each node's replication lag and the membership history.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp

from chronomq.cluster.node.broker.members import Members
from chronomq.raftlog import removal
from chronomq.version import VERSION


class ClusterView(Members):
    """The broker's node status and cluster view (see the module)."""

    def node_status(self) -> dict[str, Any]:
        st = self.raftlog.status()
        # Never this node while it is not a confirmed leader (a leader that stepped down).
        leader_addr = self.raftlog.leader_address()
        readiness = self.raftlog.readiness()
        return {
            "id": int(self.config.node_id),
            "role": "leader"
            if self.raftlog.is_leader
            else ("leader-unconfirmed" if st["role"] == "leader" else st["role"]),
            "http_url": self.config.http_url,
            "raft": self.config.raft_address,
            "leader": self.node_id_of(leader_addr),
            "leader_url": self.peer_http(leader_addr),
            "term": st["term"],
            "commit_index": st["commit_index"],
            "applied_index": st["applied_index"],
            "log_len": st["log_len"],
            "slow_ticks": st["slow_ticks"],
            "max_tick_ms": st["max_tick_ms"],
            "has_quorum": st["has_quorum"],
            "ready": readiness.ready,
            "ready_reason": readiness.reason,
            "digest": st["digest"],
            "match_index": st["match_index"],
            "peers_connected": st["peers_connected"],
            "version": VERSION,
            "wire_version": self.raftlog.machine.wire_version,
            "peer_versions": st["peer_versions"],
            "uptime_s": round(time.monotonic() - self.started_monotonic, 1),
            "queued_messages": st["queued_messages"],
            "inflight_commands": st["inflight_commands"],
            "client_idempotency_keys": len(self.raftlog.store.clients),
            "client_idempotency_keys_evicted": self.raftlog.store.clients_evicted,
            "last_election_ms": self.last_election_ms,
            "pull_waiters": self.waiters.waiting,
            "pull_waited_queues": self.waiters.queues,
            "pull_wakes": self.waiters.wakes,
            "http_connections": self.connections.stats() if self.connections else None,
            "leader_changes": list(self.leader_changes)[-5:],
            "disk": None if self.disk is None else self.disk.stats(),
            "removed": removal.as_json(self.raftlog.removal),
            "reachable": True,
        }

    async def peer_status(self, url: str) -> dict[str, Any] | None:
        try:
            async with self.peer_client.request(
                "GET", f"{url}/v1/admin/node", timeout=aiohttp.ClientTimeout(total=1.0)
            ) as r:
                if r.status == 200:
                    data: dict[str, Any] = await r.json()
                    return data
        except (aiohttp.ClientError, TimeoutError, ValueError):
            pass
        return None

    async def cluster_view(self) -> dict[str, Any]:
        peers = self.peers()
        remote = await asyncio.gather(*(self.peer_status(p.http) for p in peers))
        me = self.node_status()
        nodes = [me]
        for p, st in zip(peers, remote, strict=True):
            if st is None:
                st = {"id": p.id, "role": "unknown", "http_url": p.http, "reachable": False}
                # What its Raft hello said, when it reached this node (an HTTP port down, or
                # a node of another version).
                heard = me["peer_versions"].get(p.raft)
                if heard is not None:
                    st["version"] = heard["version"]
                    st["wire_version"] = heard["wire_version"]
            nodes.append(st)
        nodes.sort(key=lambda n: n["id"])
        reachable = [n for n in nodes if n.get("reachable")]
        leaders = [n["id"] for n in reachable if n.get("role") == "leader"]
        term = max((n.get("term", 0) for n in reachable), default=0)
        leader = leaders[0] if leaders else None
        commit = max((n.get("commit_index", 0) for n in reachable), default=0)
        for n in nodes:
            if n.get("reachable"):
                n["replication_lag"] = commit - n.get("applied_index", 0)
        return {
            "leader": leader,
            "term": term,
            "nodes": nodes,
            "leader_changes": list(self.leader_changes),
            "membership_history": self.membership_history(),
        }
