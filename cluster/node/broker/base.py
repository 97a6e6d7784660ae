"""The broker's state and what every part of it uses: its lifecycle, the leader it sees and
the members it knows, commits within the commit timeout, the limits on held produce bytes and
on topics, and a topic's queues.

Each part of the broker is a subclass of :class:`BrokerBase` in a module of its own (parse,
produce, pull, offsets, retry, members, view); :class:`chronomq.cluster.node.broker.Broker` is
all of them, one object.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import aiohttp

from chronomq.cluster.config.nodeconfig import NodeConfig, Peer
from chronomq.cluster.node.errors import ApiError
from chronomq.cluster.node.metrics import DeliveryLateness
from chronomq.cluster.node.peerhttp import PeerHttp
from chronomq.cluster.node.pull import READ_THREADS, QueueWaiters
from chronomq.cluster.node.readfence import ReadFence
from chronomq.raftlog.errors import ApplyRejected, NotLeader, Overloaded
from chronomq.raftlog.node import RaftLog
from chronomq.raftlog.removal import RemovalNotice
from chronomq.raftlog.store import TOO_MANY_TOPICS, ApplyResult, BatchOutcome
from chronomq.schedule.levels import SCHEDULE_TOPIC, DelayLevelTable

log = logging.getLogger(__name__)


MEMBER_PREFIX = "member/"
REMOVED = "removed"


def _member(pid: int, value: str) -> Peer:
    """A member from its replicated entry ``"<raft> <http> <fetch>"``. Total: entries written
    before URLs were validated may hold spaces in the URL, and must still list (and remove)."""
    parts = value.split(" ")
    if len(parts) < 3:
        parts += [""] * (3 - len(parts))
    return Peer(pid, parts[0], " ".join(parts[1:-1]), parts[-1])


def _id_or(node_id: int | None, address: str | None) -> int | str | None:
    return address if node_id is None else node_id


def _too_many_topics(problem: str) -> ApiError:
    message = problem.removeprefix(TOO_MANY_TOPICS + ": ")
    return ApiError(429, TOO_MANY_TOPICS, message, "topic")


class BrokerBase:
    """The broker's state, lifecycle, leader and members, commits and limits."""

    def __init__(self, config: NodeConfig, raftlog: RaftLog) -> None:
        self.config = config
        self.raftlog = raftlog
        self._held_request_bytes = 0  # produce bodies being read, parsed or committed
        self.levels = DelayLevelTable.parse(config.message_delay_level)
        self.started_monotonic = time.monotonic()
        self.loop: asyncio.AbstractEventLoop | None = None
        # Every request to another node goes through here: it attaches the token only for
        # members' URLs.
        # Removed nodes still being told so (URL -> notice), and the tasks telling them.
        self._notifying: dict[str, RemovalNotice] = {}
        self._notify_tasks: set[asyncio.Task[None]] = set()
        self._membership_lock = asyncio.Lock()
        self._history_seen: Any = None
        self._history_logged_seq = 0
        self.peer_client = PeerHttp.for_node(config, self._member_urls)
        self.waiters = QueueWaiters(lambda t, q: self.raftlog.store.max_offset(t, q))
        # Follower reads that see every acknowledged write (cluster.node.readfence).
        self.read_fence = ReadFence(
            self._leader_commit_index,
            self._applied_index,
            config.follower_read_timeout_ms / 1000,
        )
        self._pull_pool: ThreadPoolExecutor | None = None
        self.offloaded_pulls = 0
        # The HTTP connection guard (cluster.httpapi.httpconn), set by the app, for node_status.
        self.connections: Any = None
        self._rr: dict[str, itertools.count[int]] = {}
        self.last_election_ms: float | None = None
        self.leader_changes: collections.deque[dict[str, Any]] = collections.deque(maxlen=100)
        self.leader_changes_total = 0  # after the first leader this node knew
        # How late the schedule and timer services deliver (cluster.node.services observes it).
        self.lateness = DeliveryLateness()
        self._leader_seen: str | None = None
        self._leaderless_since: float | None = None
        self._monitor: asyncio.Task[None] | None = None
        # Leader-only services, set by cluster.node.services when they run on this node.
        self.schedule: Any = None
        self.timer: Any = None
        # RocketMQ 5 pop consumption (chronomq.pop.PopService), for the gRPC endpoint.
        self.pop: Any = None
        # The owner of their leader-only work (raftlog.leadership), set by cluster.node.services.
        self.leadership: Any = None
        # CommitLog retention and the produce guard (cluster.node.disk), set by cluster.node.services.
        self.disk: Any = None
        # Structured ops logs (replication, latency, events), set by the server when enabled.
        self.logs: Any = None
        raftlog.add_apply_listener(self._on_apply)

    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.waiters.bind(self.loop)
        self._pull_pool = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="pull-read")
        await self.peer_client.start()
        self._monitor = asyncio.create_task(self._watch_leader())

    async def stop(self) -> None:
        for task in list(self._notify_tasks):
            task.cancel()
        if self._monitor is not None:
            self._monitor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._monitor
        await self.peer_client.close()
        if self._pull_pool is not None:
            self._pull_pool.shutdown(wait=False, cancel_futures=True)

    async def _watch_leader(self) -> None:
        """Note when this node loses sight of the leader and how long until it knows a new one."""
        while True:
            self.observe_leader(self.raftlog.leader_address(), time.monotonic())
            await asyncio.sleep(0.01)

    def observe_leader(self, leader: str | None, now: float) -> None:
        seen = self._leader_seen
        if leader == seen:
            return
        if seen is not None and self._leaderless_since is None:
            self._leaderless_since = now
        if leader is not None:
            election_ms = None
            if self._leaderless_since is not None:
                election_ms = round((now - self._leaderless_since) * 1000, 1)
                self.last_election_ms = election_ms
            if seen is not None or election_ms is not None:
                self.leader_changes_total += 1
            self._leaderless_since = None
            term = self.raftlog.machine.raftCurrentTerm
            campaign = self.raftlog.machine.campaign
            self.leader_changes.append(
                {
                    "at_ms": self.raftlog.clock.now_ms(),
                    "from": self.node_id_of(seen),
                    "to": self.node_id_of(leader),
                    "term": term,
                    "election_ms": election_ms,
                    # What made this node campaign, when it is the one that won.
                    "detected_by": (
                        campaign[1]
                        if campaign is not None
                        and campaign[0] == term
                        and self.node_id_of(leader) == self.config.node_id
                        else None
                    ),
                }
            )
            log.info(
                "leader is now node %s (election took %s ms)", self.node_id_of(leader), election_ms
            )
            if self.logs is not None:
                self.logs.leader_changed(
                    _id_or(self.node_id_of(leader), leader),
                    _id_or(self.node_id_of(seen), seen),
                    self.raftlog.machine.raftCurrentTerm,
                    election_ms,
                )
        self._leader_seen = leader

    def _on_apply(self, result: ApplyResult) -> None:
        # Raft thread. Only cross to the loop when someone waits, and wake only the queues
        # written to. Where the outcomes do not say (an extension's deliveries, and every
        # command on a follower, whose store builds no placements), the loop looks.
        if not self.waiters.waiting or not result.messages:
            return
        written = {(p.topic, p.queue_id) for o in result.outcomes for p in o.placed}
        if written:
            self.waiters.applied(written)
        else:
            self.waiters.grown()

    async def _leader_commit_index(self) -> int:
        """The leader's commit index, asked now (``GET /v1/admin/read-index`` on the leader)."""
        leader = self.leader_url()
        if leader is None or leader == self.config.http_url:
            raise ApiError(
                503,
                "no_leader",
                "no leader is known, so this node cannot tell whether it holds every "
                "acknowledged write; retry shortly",
                None,
                {"Retry-After": "1"},
            )
        async with self.peer_client.request(
            "GET",
            f"{leader}/v1/admin/read-index",
            timeout=aiohttp.ClientTimeout(total=self.config.follower_read_timeout_ms / 1000),
        ) as r:
            data = await r.json(content_type=None)
            if r.status != 200 or not isinstance(data, dict):
                raise RuntimeError(f"the leader at {leader} answered {r.status}: {data}")
            index = data.get("commit_index")
            if not isinstance(index, int) or isinstance(index, bool):
                raise RuntimeError(f"the leader at {leader} answered no commit_index: {data}")
            return index

    def _applied_index(self) -> int:
        # The store's (set by each command it applies) or pysyncobj's (after every entry,
        # membership changes too), whichever is further.
        return max(self.raftlog.store.applied_index, self.raftlog.machine.raftLastApplied)

    def read_index(self) -> dict[str, int]:
        """On the leader: its commit index, for a follower's read (cluster.node.readfence).
        Only while its lease holds: a leader that may have been replaced cannot vouch."""
        if not self.raftlog.is_leader:
            raise NotLeader("this node does not lead (with a lease)", self.raftlog.leader_address())
        return {
            "commit_index": int(self.raftlog.machine.raftCommitIndex),
            "term": int(self.raftlog.machine.raftCurrentTerm),
        }

    def peers(self) -> list[Peer]:
        """The other members: the config's, changed by members added or removed at runtime.

        Runtime changes are replicated as ``member/<id>`` entries, so every node agrees.
        """
        peers = {p.id: p for p in self.config.peers}
        for key, value in list(self.raftlog.store.kv.items()):
            if not key.startswith(MEMBER_PREFIX):
                continue
            try:
                pid = int(key[len(MEMBER_PREFIX) :])
            except ValueError:
                continue
            if value == REMOVED:
                peers.pop(pid, None)
            elif pid != self.config.node_id and isinstance(value, str):
                peers[pid] = _member(pid, value)
        return sorted(peers.values(), key=lambda p: p.id)

    def peer_http(self, raft_address: str | None) -> str | None:
        if raft_address is None:
            return None
        if raft_address == self.config.raft_address:
            return self.config.http_url
        for p in self.peers():
            if p.raft == raft_address:
                return p.http
        return None

    def leader_url(self) -> str | None:
        return self.peer_http(self.raftlog.leader_address())

    def node_id_of(self, raft_address: str | None) -> int | None:
        if raft_address == self.config.raft_address:
            return int(self.config.node_id)
        for p in self.peers():
            if p.raft == raft_address:
                return p.id
        return None

    def _me(self) -> Peer:
        return Peer(
            int(self.config.node_id),
            self.config.raft_address,
            self.config.http_url,
            self.config.fetch_address,
        )

    def _member_urls(self) -> list[str]:
        """Members' HTTP URLs, and those of nodes removed whose notice is still being sent."""
        return [p.http for p in self.peers()] + list(self._notifying)

    @contextlib.contextmanager
    def hold_request(self, size: int) -> Iterator[None]:
        """Count a produce request's ``size`` bytes (its declared body) while it is read,
        parsed and committed; refuse it at once with 429 (:class:`Overloaded`) when they and
        the bytes of the produce requests already held pass ``max_pending_bytes``, or while
        commits are behind (:meth:`GroupCommitter.behind`). One request alone is always taken
        (``max_request_bytes`` bounds it). The group committer applies the same limits to the
        encoded batches of every writer (deliveries included)."""
        limit = self.raftlog.config.max_pending_bytes
        held = self._held_request_bytes
        if held and held + size > limit:
            raise Overloaded(
                f"{held} bytes of produce requests are held (max_pending_bytes {limit})"
            )
        behind = self.raftlog.committer.behind()
        if behind is not None:
            raise Overloaded(behind)
        self._held_request_bytes += size
        try:
            yield
        finally:
            self._held_request_bytes -= size

    async def commit(self, fut: Future[BatchOutcome]) -> BatchOutcome:
        try:
            return await asyncio.wait_for(
                asyncio.wrap_future(fut), self.config.commit_timeout_ms / 1000 + 1
            )
        except ApplyRejected as exc:
            if str(exc).startswith(TOO_MANY_TOPICS):  # the limit, met at apply
                raise _too_many_topics(str(exc)) from None
            raise

    def check_topic_room(self, creates: Mapping[str, int]) -> None:
        """429 ``too_many_topics`` when creating ``creates`` would pass ``max_topics`` or
        ``max_queues`` (apply checks again, so a race between two creators ends the same)."""
        store = self.raftlog.store
        fresh = {t: n for t, n in creates.items() if store.queue_count(t) is None}
        if not fresh:
            return
        queues = list(store.topics.values())  # the Raft thread adds topics: copy first
        problem = store.topic_limits.refusal(len(queues), sum(len(q) for q in queues), fresh)
        if problem is not None:
            raise _too_many_topics(problem)

    def queue_count(self, topic: str) -> int:
        """The topic's queue count; 404 naming ``topic`` when it does not exist."""
        n = self.raftlog.store.queue_count(topic)
        if n is None:
            raise ApiError(404, "unknown_topic", f"topic {topic} does not exist", "topic")
        return n

    def check_queue(self, topic: str, queue: int) -> None:
        """404 naming ``topic`` or ``queue`` unless the topic has that queue."""
        n = self.queue_count(topic)
        if queue >= n:
            raise ApiError(404, "unknown_queue", f"topic {topic} has queues 0..{n - 1}", "queue")

    def _create_schedule_topic(self, creates: dict[str, int]) -> None:
        """Create the schedule topic with the first batch that needs it (queue n-1 holds level n)."""
        if self.raftlog.store.queue_count(SCHEDULE_TOPIC) is None:
            creates[SCHEDULE_TOPIC] = self.levels.max_level

    timer_hook: Any = None
