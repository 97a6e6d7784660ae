"""Membership at runtime: adding and removing members (the Raft change and the replicated
``member/<id>`` entry with its history), a leader removing itself by handing over first, a
leader handing over before it stops, telling a removed node so, and what a removed node answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import aiohttp

from chronomq.cluster.config.nodeconfig import Peer
from chronomq.cluster.node import membership
from chronomq.cluster.node.broker.base import MEMBER_PREFIX, REMOVED, BrokerBase
from chronomq.cluster.node.errors import ApiError
from chronomq.raftlog import removal
from chronomq.raftlog.errors import ConditionFailed
from chronomq.raftlog.removal import RemovalNotice
from chronomq.raftlog.store import ApplyResult
from chronomq.raftlog.transfer import TransferResult
from chronomq.raftlog.transfer_driver import transfer_leadership

log = logging.getLogger(__name__)


class Members(BrokerBase):
    """The broker's membership changes (see the module)."""

    def membership_history(self) -> list[dict[str, Any]]:
        """The replicated membership history, oldest first (identical on every node)."""
        return membership.parse_history(self.raftlog.store.kv.get(membership.HISTORY_KEY))

    def _log_membership(self, _result: ApplyResult) -> None:
        """Apply listener (Raft thread): log each membership change when this node applies it."""
        value = self.raftlog.store.kv.get(membership.HISTORY_KEY)
        if value is self._history_seen:
            return
        self._history_seen = value
        for entry in membership.parse_history(value):
            if entry.get("seq", 0) > self._history_logged_seq:
                self._history_logged_seq = entry["seq"]
                log.info("membership change applied: %s", membership.describe(entry))

    async def _record_membership(self, action: str, peer: Peer, member_value: str) -> None:
        """Commit ``member/<id>`` and the history entry together (compare-and-set on the
        history, retried when another leader's entry got in first)."""
        for attempt in range(3):
            old = self.raftlog.store.kv.get(membership.HISTORY_KEY)
            entry = membership.HistoryEntry(
                action=action,
                id=peer.id,
                raft=peer.raft,
                http=peer.http,
                at_ms=self.raftlog.clock.now_ms(),
                term=self.raftlog.machine.raftCurrentTerm,
            )
            new = membership.append_history(old, entry)
            try:
                await self.commit(
                    self.raftlog.update(
                        {f"{MEMBER_PREFIX}{peer.id}": member_value, membership.HISTORY_KEY: new},
                        expect={membership.HISTORY_KEY: old},
                    )
                )
                return
            except ConditionFailed:
                if attempt == 2:
                    raise

    async def _change_raft(self, action: str, raft: str, timeout_s: float = 30.0) -> None:
        """The Raft half of a membership change, waiting (bounded) for this leader to have
        applied the first entry of its term, which pysyncobj requires; a refusal for that
        reason is retried until ``timeout_s``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            while not self.raftlog.first_entry_applied() and loop.time() < deadline:
                self.raftlog._check_leader()
                await asyncio.sleep(0.02)
            try:
                await asyncio.wait_for(
                    asyncio.wrap_future(self.raftlog.change_membership(action, raft)),
                    max(0.1, deadline - loop.time()),
                )
                return
            except ConditionFailed:
                if self.raftlog.first_entry_applied() or loop.time() >= deadline:
                    raise
            except TimeoutError:
                raise ApiError(
                    504,
                    "membership_timeout",
                    f"the membership change ({action} {raft}) did not commit within {timeout_s:g} s",
                    None,
                ) from None

    async def add_member(self, peer: Peer) -> None:
        for member in [self._me(), *self.peers()]:
            for field in ("id", "raft", "http", "fetch"):
                if getattr(member, field) == getattr(peer, field):
                    raise ApiError(
                        409,
                        "member_exists",
                        f"node {member.id} already has {field} {getattr(peer, field)}",
                        field,
                    )
        async with self._membership_lock:
            await self._change_raft("add", peer.raft)
            await self._record_membership("add", peer, f"{peer.raft} {peer.http} {peer.fetch}")
        self._notifying.pop(peer.http, None)

    async def remove_member(self, node_id: int) -> dict[str, Any]:
        """Remove member ``node_id`` (on the leader). This node itself: hand the leadership
        over first, then let the new leader remove it."""
        if node_id == int(self.config.node_id):
            return await self._remove_this_leader()
        peer = next((p for p in self.peers() if p.id == node_id), None)
        if peer is None:
            raise ApiError(404, "unknown_member", f"node {node_id} is not a member", "id")
        async with self._membership_lock:
            await self._change_raft("remove", peer.raft)
            index = self.raftlog.machine.raftCommitIndex
            term = self.raftlog.machine.raftCurrentTerm
            await self._record_membership("remove", peer, REMOVED)
        notice = RemovalNotice(
            peer.id, peer.raft, index, term, self.raftlog.clock.now_ms(), int(self.config.node_id)
        )
        self._notifying[peer.http] = notice
        self._notify_tasks.add(task := asyncio.create_task(self._notify_removed(peer, notice)))
        task.add_done_callback(self._notify_tasks.discard)
        return {"status": "removed", "id": node_id, "leader": int(self.config.node_id)}

    async def _remove_this_leader(self) -> dict[str, Any]:
        if not self.peers():
            raise ApiError(
                409,
                "last_member",
                "this node is the only member: there is nobody to hand over to",
                "id",
            )
        timeout_s = max(5.0, 3 * self.raftlog.config.raft_max_timeout_ms / 1000)
        new_leader = await self.hand_over_leadership(timeout_s)
        url = self.peer_http(self.raftlog.leader_address()) if new_leader is not None else None
        if new_leader is None or url is None:
            raise ApiError(
                409,
                "leader_not_handed_over",
                f"node {self.config.node_id} leads and could not hand the leadership to another "
                f"member within {timeout_s:g} s (none caught up and connected); retry",
                "id",
            )
        log.info(
            "removing this node (the leader until now): node %s leads now and removes it",
            new_leader,
        )
        return await self._relay_removal(url, int(self.config.node_id), timeout_s)

    async def _relay_removal(self, url: str, node_id: int, timeout_s: float) -> dict[str, Any]:
        """``DELETE /v1/admin/members/{node_id}`` on the new leader at ``url``, retried while
        it confirms its leadership (503)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            status, payload = 503, {}
            try:
                async with self.peer_client.request(
                    "DELETE",
                    f"{url}/v1/admin/members/{node_id}",
                    headers={"X-Chronomq-Forwarded": self.config.http_url},
                    timeout=aiohttp.ClientTimeout(total=40),
                ) as r:
                    status = r.status
                    with contextlib.suppress(ValueError, aiohttp.ContentTypeError):
                        payload = await r.json()
            except (aiohttp.ClientError, TimeoutError) as exc:
                payload = {"error": "leader_unreachable", "message": str(exc)}
            if status == 200 and isinstance(payload, dict):
                return payload
            if status != 503 or loop.time() >= deadline:
                p = payload if isinstance(payload, dict) else {}
                raise ApiError(
                    status if status >= 400 else 502,
                    str(p.get("error", "removal_failed")),
                    f"the new leader at {url} answered: {p.get('message', status)}",
                    p.get("field"),
                )
            await asyncio.sleep(0.1)

    async def hand_over_leadership(self, timeout_s: float) -> int | None:
        """Hand this node's leadership to the most caught-up other member
        (:func:`chronomq.raftlog.transfer_driver.transfer_leadership`); the new leader's id, or None when it
        did not move in ``timeout_s``."""
        result = await transfer_leadership(self, None, timeout_s)
        if not result.moved:
            log.warning("handing the leadership over failed: %s", result.message)
            return None
        return result.leader_id

    async def hand_over_before_stop(self, timeout_s: float) -> TransferResult | None:
        """Before this node stops (SIGTERM): hand its leadership to the most caught-up
        follower, so that writers go on with the new leader at once instead of after an
        election timeout. Writes proposed before the hand-over commit; those held during it
        fail with NotLeader, never proposed (their answer names the new leader). At most
        ``timeout_s`` (and the driver's settling, about a second more); never raises.

        Logs one line: to whom and how long, or why not. None when there was nothing to hand
        over (this node does not lead, or is the only member)."""
        if not self.raftlog.is_leader:
            if self.raftlog.machine._isLeader():
                log.warning(
                    "stopping: leadership not handed over (no majority has acknowledged this "
                    "leader within the lease: its followers are down or cut off)"
                )
            return None
        if not self.peers():
            log.info("stopping: this node is the only member; no leadership to hand over")
            return None
        started = time.monotonic()
        try:
            result = await transfer_leadership(self, None, timeout_s)
        except Exception:
            log.exception("stopping: handing the leadership over failed")
            return None
        took_ms = (time.monotonic() - started) * 1000
        if result.moved:
            log.info(
                "stopping: leadership handed to node %s in %.0f ms (term %d)",
                result.leader_id,
                took_ms,
                result.term,
            )
        else:
            log.warning(
                "stopping: leadership not handed over after %.0f ms (%s: %s); the other "
                "members elect a leader once their election timeout passes",
                took_ms,
                result.outcome.value,
                result.message,
            )
        return result

    async def _notify_removed(self, peer: Peer, notice: RemovalNotice) -> None:
        """Tell a removed node it was removed, retrying for at most a minute (it may be down:
        then it keeps its term, pre-vote failing, and waits leaderless)."""
        body = notice.encode()
        headers = {
            "Content-Type": "application/json",
            removal.SIGNATURE_HEADER: removal.sign(self.raftlog.config.cluster_secret, body),
        }
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 60
        delay_s = 0.2
        try:
            while loop.time() < deadline and self._notifying.get(peer.http) is notice:
                try:
                    async with self.peer_client.request(
                        "POST",
                        f"{peer.http}/v1/admin/node/removal",
                        data=body,
                        headers=headers,
                        timeout=aiohttp.ClientTimeout(total=2.0),
                    ) as r:
                        if r.status == 200:
                            log.info("node %s was told it was removed", peer.id)
                            return
                        text = await r.text()
                        log.warning(
                            "node %s refused its removal notice (%s): %s", peer.id, r.status, text
                        )
                        if r.status < 500:
                            return
                except (aiohttp.ClientError, TimeoutError) as exc:
                    log.debug("telling node %s it was removed failed: %s", peer.id, exc)
                await asyncio.sleep(delay_s)
                delay_s = min(5.0, delay_s * 2)
            log.warning(
                "node %s could not be told it was removed (not reachable for 60 s): if it runs, "
                "it waits without a leader and answers 503",
                peer.id,
            )
        finally:
            if self._notifying.get(peer.http) is notice:
                self._notifying.pop(peer.http, None)

    def receive_removal(self, body: bytes, signature: str) -> dict[str, Any]:
        """A leader's notice that this node was removed (``POST /v1/admin/node/removal``)."""
        try:
            notice = removal.verify(
                self.raftlog.config.cluster_secret,
                body,
                signature,
                node_id=int(self.config.node_id),
                raft=self.config.raft_address,
                applied_index=self.raftlog.machine.raftLastApplied,
            )
        except removal.NoticeRefused as exc:
            raise ApiError(409, "notice_refused", str(exc), "body") from None
        self.raftlog.mark_removed(notice)
        return {"status": "removed", "removal": removal.as_json(self.raftlog.removal)}

    def removed_error(self) -> ApiError | None:
        """410 ``removed_from_cluster`` when this node was removed; None otherwise."""
        notice = self.raftlog.removal
        if notice is None:
            return None
        members = ", ".join(p.http for p in self.config.peers) or "none known"
        return ApiError(
            410,
            "removed_from_cluster",
            f"this node ({self.config.node_id}) was removed from the cluster "
            f"({notice.describe()}); it serves nothing until an operator adds it back. "
            f"Ask a member instead (configured peers: {members})",
            None,
        )
