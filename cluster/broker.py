"""One broker node: the replicated log plus what the HTTP API needs around it.

The :class:`Broker` lives on the asyncio loop. It turns JSON messages into
:class:`chronomq.raftlog.node.NewMessage` (rewriting delayed ones into the schedule topic), waits for
commits without blocking the loop, wakes long-polling consumers when new entries apply, and
aggregates the cluster view from every node.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import contextlib
import itertools
import logging
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import aiohttp
import orjson

from chronomq.cluster import idempotency, membership, models, reserved
from chronomq.cluster.config import NodeConfig, Peer
from chronomq.cluster.errors import ApiError, bad_request
from chronomq.cluster.models import MessageIn, ProduceRequest
from chronomq.cluster.nodemetrics import DeliveryLateness
from chronomq.cluster.peerhttp import PeerHttp
from chronomq.cluster.pull import (
    INLINE_READ_BYTES,
    READ_THREADS,
    PullPage,
    QueueWaiters,
    plan_units,
    read_page,
)
from chronomq.raftlog import record, removal
from chronomq.raftlog.errors import ApplyRejected, ConditionFailed, Overloaded, UnknownTopic
from chronomq.raftlog.node import NewMessage, RaftLog
from chronomq.raftlog.removal import RemovalNotice
from chronomq.raftlog.store import TOO_MANY_TOPICS, ApplyResult, BatchOutcome
from chronomq.raftlog.transfer import transfer_leadership
from chronomq.schedule import properties as schedule_props
from chronomq.schedule import rewrite
from chronomq.schedule.levels import SCHEDULE_TOPIC, DelayLevelTable

log = logging.getLogger(__name__)

VERSION = "0.1.0"
GROUP_OFFSET_PREFIX = "go/"
MEMBER_PREFIX = "member/"
REMOVED = "removed"
_DELAY_FIELDS = ("delay_level", "delay_ms", "deliver_at_ms")


def group_offset_key(group: str, topic: str, queue: int) -> str:
    return f"{GROUP_OFFSET_PREFIX}{group}/{topic}/{queue}"


def _member(pid: int, value: str) -> Peer:
    """A member from its replicated entry ``"<raft> <http> <fetch>"``. Total: entries written
    before URLs were validated may hold spaces in the URL, and must still list (and remove)."""
    parts = value.split(" ")
    if len(parts) < 3:
        parts += [""] * (3 - len(parts))
    return Peer(pid, parts[0], " ".join(parts[1:-1]), parts[-1])


def _id_or(node_id: int | None, address: str | None) -> int | str | None:
    return address if node_id is None else node_id


class Broker:
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
        self._pull_pool: ThreadPoolExecutor | None = None
        self.offloaded_pulls = 0
        # The HTTP connection guard (cluster.httpconn), set by the app, for node_status.
        self.connections: Any = None
        self._rr: dict[str, itertools.count[int]] = {}
        self.last_election_ms: float | None = None
        self.leader_changes: collections.deque[dict[str, Any]] = collections.deque(maxlen=100)
        self.leader_changes_total = 0  # after the first leader this node knew
        # How late the schedule and timer services deliver (cluster.services observes it).
        self.lateness = DeliveryLateness()
        self._leader_seen: str | None = None
        self._leaderless_since: float | None = None
        self._monitor: asyncio.Task[None] | None = None
        # Leader-only services, set by cluster.services when they run on this node.
        self.schedule: Any = None
        self.timer: Any = None
        # RocketMQ 5 pop consumption (cluster.pop.service.PopService), for the gRPC endpoint.
        self.pop: Any = None
        # The owner of their leader-only work (raftlog.leadership), set by cluster.services.
        self.leadership: Any = None
        # CommitLog retention and the produce guard (cluster.disk), set by cluster.services.
        self.disk: Any = None
        # Structured ops logs (replication, latency, events), set by the server when enabled.
        self.logs: Any = None
        raftlog.add_apply_listener(self._on_apply)
        raftlog.add_apply_listener(self._log_membership)

    # ------------------------------------------------------------------ lifecycle

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
            self.leader_changes.append(
                {
                    "at_ms": self.raftlog.clock.now_ms(),
                    "from": self.node_id_of(seen),
                    "to": self.node_id_of(leader),
                    "term": self.raftlog.machine.raftCurrentTerm,
                    "election_ms": election_ms,
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

    # ------------------------------------------------------------------ waking consumers

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

    # ------------------------------------------------------------------ leader and peers

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

    # ------------------------------------------------------------------ produce

    def parse_messages(
        self, topic: str, raw: Any
    ) -> tuple[list[NewMessage], list[dict[str, Any]], int]:
        """Messages (:class:`~chronomq.cluster.models.MessageIn`, or their JSON objects) ->
        NewMessages (delayed ones rewritten) and per-message answer extras. The model checked
        types and shapes; what is checked here depends on this node (limits, topics, the delay
        table, reserved properties)."""
        record.validate_topic(topic)
        reserved.check_user_topic(topic)
        if not isinstance(raw, list) or not raw:
            raise bad_request("messages must be a non-empty list", "messages")
        raw = _messages_in(raw)
        if not self.config.auto_create_topic and self.raftlog.store.queue_count(topic) is None:
            # Also for delayed messages, which are stored in a system topic first: they would
            # be accepted and dropped when due.
            raise UnknownTopic(f"topic {topic} does not exist", "topic")
        if len(raw) > self.config.max_messages_per_request:
            raise ApiError(
                413,
                "too_many_messages",
                f"{len(raw)} messages in one request, more than {self.config.max_messages_per_request}",
                "messages",
            )
        store_ms = self.raftlog.clock.now_ms()
        out: list[NewMessage] = []
        extras: list[dict[str, Any]] = []
        for i, m in enumerate(raw):
            f = f"messages[{i}]"
            body = self._body(m, f)
            props = {} if m.properties is None else m.properties
            reserved.check_user_properties(props, f"{f}.properties")
            props = dict(props)
            if m.keys is not None:
                if not all(k and " " not in k for k in m.keys):
                    raise bad_request(
                        "keys must be a list of non-empty strings without spaces", f"{f}.keys"
                    )
                if m.keys:
                    props[record.PROPERTY_KEYS] = " ".join(m.keys)
            if m.tags is not None:
                props[record.PROPERTY_TAGS] = m.tags
            queue = m.queue
            delays = [k for k in _DELAY_FIELDS if getattr(m, k) is not None]
            if len(delays) > 1:
                raise bad_request(
                    f"give at most one of {', '.join(_DELAY_FIELDS)}", f"{f}.{delays[1]}"
                )
            extra: dict[str, Any] = {}
            if delays and delays[0] == "delay_level":
                level = m.delay_level
                qid = queue if queue is not None else self._next_queue(topic)
                real_queues = (
                    self.raftlog.store.queue_count(topic) or self.config.default_topic_queues
                )
                if qid >= real_queues:
                    raise ApiError(
                        400,
                        "unknown_queue",
                        f"topic {topic} has queues 0..{real_queues - 1}, not {qid}",
                        f"{f}.queue",
                    )
                try:
                    placed = rewrite.place(topic, qid, level, props, self.levels)
                except ApiError:
                    raise
                except Exception as exc:
                    err = getattr(exc, "field", None)
                    raise bad_request(str(exc), f"{f}.{err or 'delay_level'}") from None
                if placed.level.is_delayed:
                    extra = {
                        "delay_level": placed.level.level,
                        "deliver_ms": placed.deliver_ms(store_ms),
                    }
                    if placed.level.clamped:
                        extra["clamped"] = True
                    out.append(
                        NewMessage(
                            placed.topic,
                            body,
                            queue_id=placed.queue_id,
                            properties=placed.properties,
                            tags_code=placed.deliver_ms(store_ms),
                        )
                    )
                    extras.append(extra)
                    continue
            elif delays:
                timer = self.timer_hook
                if timer is None:
                    raise bad_request(
                        f"{delays[0]} is not supported by this node", f"{f}.{delays[0]}"
                    )
                out.append(
                    timer(
                        topic,
                        body,
                        queue,
                        props,
                        delays[0],
                        getattr(m, delays[0]),
                        store_ms,
                        f,
                        extra,
                    )
                )
                extras.append(extra)
                continue
            out.append(NewMessage(topic, body, queue_id=queue, properties=props))
            extras.append(extra)
        return out, extras, store_ms

    timer_hook: Any = None

    def _create_schedule_topic(self, creates: dict[str, int]) -> None:
        """Create the schedule topic with the first batch that needs it (queue n-1 holds level n)."""
        if self.raftlog.store.queue_count(SCHEDULE_TOPIC) is None:
            creates[SCHEDULE_TOPIC] = self.levels.max_level

    def _stored_extra(self, placed: Any, extra: dict[str, Any]) -> dict[str, Any]:
        if "deliver_ms" not in extra:
            return extra
        try:
            msg = self.raftlog.store.commitlog.read_message(placed.physical_offset, placed.size)
        except Exception:  # the answer keeps this attempt's figure rather than failing
            log.exception("could not read a replayed message at %d", placed.physical_offset)
            return extra
        props = msg.properties
        if "TIMER_OUT_MS" in props and props["TIMER_OUT_MS"].isdigit():
            return {**extra, "deliver_ms": int(props["TIMER_OUT_MS"])}
        level = props.get(schedule_props.DELAY, "")
        if msg.topic == SCHEDULE_TOPIC and level.isdigit():
            return {**extra, "deliver_ms": msg.store_ms + self.levels.delay_ms(int(level))}
        return extra

    def _body(self, m: MessageIn, f: str) -> bytes:
        if m.body_base64 is not None:
            if m.body is not None:
                raise bad_request("give body or body_base64, not both", f"{f}.body_base64")
            try:
                body = base64.b64decode(m.body_base64, validate=True)
            except (ValueError, TypeError):
                raise bad_request("body_base64 is not valid base64", f"{f}.body_base64") from None
        else:
            text = m.body
            if text is None:
                raise bad_request("body is required and must be a string", f"{f}.body")
            body = text.encode()
        if len(body) > self.config.max_message_size:
            raise ApiError(
                413,
                "message_too_large",
                f"body is {len(body)} bytes, more than max_message_size {self.config.max_message_size}",
                f"{f}.body",
            )
        return body

    def _next_queue(self, topic: str) -> int:
        n = self.raftlog.store.queue_count(topic) or self.config.default_topic_queues
        rr = self._rr.get(topic)
        if rr is None:
            rr = self._rr[topic] = itertools.count()
        return next(rr) % n

    async def produce(self, topic: str, raw: Any, idempotency_key: str | None) -> dict[str, Any]:
        if self.disk is not None:
            self.disk.check_produce()  # 507 disk_full before anything is proposed
        raw = _messages_in(raw)
        messages, extras, store_ms = self.parse_messages(topic, raw)
        # A client's key is scoped to the topic: the same key sent to another topic is another
        # request, not a replay of the first one's placement. Within the topic it is bound to
        # its request's fingerprint (see cluster.idempotency).
        key = fingerprint = None
        if idempotency_key:
            key = idempotency.client_key(topic, idempotency_key)
            fingerprint = idempotency.request_fingerprint(topic, raw)
            idempotency.check_reuse(
                self.raftlog.store, key, fingerprint, store_ms, self.config.idempotency_window_s
            )
        creates = {}
        if self.config.auto_create_topic and self.raftlog.store.queue_count(topic) is None:
            creates[topic] = self.config.default_topic_queues
        if any(m.topic == SCHEDULE_TOPIC for m in messages):
            self._create_schedule_topic(creates)
        self.check_topic_room(creates)
        fut = self.raftlog.append(
            messages,
            key=key,
            creates=creates or None,
            store_ms=store_ms,
            fingerprint=fingerprint,
        )
        outcome = await self.commit(fut)
        if self.logs is not None and not outcome.duplicate:
            self.logs.stored(topic, outcome.placed, extras, store_ms)
        if outcome.duplicate:
            # A replayed request: the answer must describe what was stored the first time
            # (its due time came from that store time), not this attempt.
            extras = [
                self._stored_extra(p, e) for p, e in zip(outcome.placed, extras, strict=False)
            ]
        results = []
        for placed, extra in zip(outcome.placed, extras, strict=False):
            results.append(
                {
                    "msg_id": record.msg_id_hex(placed.msg_id),
                    "topic": placed.topic,
                    "queue": placed.queue_id,
                    "offset": placed.queue_offset,
                    **extra,
                }
            )
        return {"results": results, "duplicate": outcome.duplicate}

    # ------------------------------------------------------------------ consume

    async def pull(
        self,
        topic: str,
        queue: int,
        offset: int,
        max_messages: int,
        wait_ms: int,
        gone: asyncio.Future[None] | None = None,
        prev: str | None = None,
    ) -> tuple[PullPage, int]:
        """A page of at most ``max_pull_bytes`` (at least one message) and the queue's end.

        With ``wait_ms`` it waits for a message on this queue, until the deadline or until
        ``gone`` (the client's connection is lost) resolves. With ``prev`` (the msg_id the
        consumer read at ``offset - 1``) it first checks that the log still holds that message
        there (see :meth:`check_prev`); when this node could not tell then, it checks again
        before answering with messages, which it holds only once it holds ``offset - 1``.
        """
        store = self.raftlog.store
        self.check_queue(topic, queue)
        unsure = prev is not None and not await self.check_prev(topic, queue, offset, prev)

        async def checked(page: PullPage) -> PullPage:
            if unsure and prev is not None and page.messages:
                await self.check_prev(topic, queue, offset, prev)
            return page

        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_ms / 1000
        while True:
            left = deadline - loop.time()
            if left <= 0 or (gone is not None and gone.done()):
                page = await self._read_page(topic, queue, offset, max_messages)
                return await checked(page), store.max_offset(topic, queue)
            woken = self.waiters.register(topic, queue, store.max_offset(topic, queue))
            try:
                page = await self._read_page(topic, queue, offset, max_messages)
                if page.messages:
                    return await checked(page), store.max_offset(topic, queue)
                await asyncio.wait(
                    [woken] if gone is None else [woken, gone],
                    timeout=left,
                    return_when=asyncio.FIRST_COMPLETED,
                )
            finally:
                self.waiters.release(topic, queue)
            if gone is not None and gone.done():
                return PullPage((), max(offset, 0)), store.max_offset(topic, queue)

    async def check_prev(self, topic: str, queue: int, offset: int, prev: str) -> bool:
        """409 ``offset_diverged`` when the message at ``offset - 1`` is not ``prev``; False
        when this node cannot tell (yet), True when it holds ``prev`` there or nothing needs
        comparing.

        A log loses its newest entries only when every node loses power at once under
        ``flush = async``; the offsets they held are then written again by other messages, and
        a consumer past them would skip those without noticing. The message is compared where
        this node holds it; where it does not, only a caught-up leader can tell that the log
        is shorter than the consumer read (a follower may not have applied it yet), and
        otherwise the pull goes on and :meth:`pull` asks again before it answers with
        messages. Below the queue's minimum (retention) there is nothing to compare."""
        at = offset - 1
        store = self.raftlog.store
        if at < 0 or at < store.min_offset(topic, queue):
            return True
        end = store.max_offset(topic, queue)
        if at < end:
            page = await self._read_page_from(topic, queue, at, 1)
            held = orjson.loads(page.messages[0])["msg_id"] if page.messages else None
            if held == prev:
                return True
            why = f"the message at offset {at} is {held}, not {prev}"
        elif self.raftlog.leads_caught_up():
            why = f"the queue ends at offset {end}: the message at offset {at} is gone"
        else:
            return False
        raise ApiError(
            409,
            "offset_diverged",
            f"{topic}/{queue}: {why}; the log lost its newest entries (every node lost power "
            "under flush = async) and the offsets were written again. Read again from the "
            "first offset whose message differs from what you read (max_offset is where the "
            "queue ends now).",
            "prev",
            extra={"max_offset": end, "min_offset": store.min_offset(topic, queue)},
        )

    async def _read_page(self, topic: str, queue: int, offset: int, max_messages: int) -> PullPage:
        """A page from ``offset``, or from the queue's minimum when retention deleted what
        lies below it (as RocketMQ answers a pull below the minimum)."""
        for _attempt in range(3):
            start = max(offset, self.raftlog.store.min_offset(topic, queue))
            try:
                return await self._read_page_from(topic, queue, start, max_messages)
            except IndexError:
                if start >= self.raftlog.store.min_offset(topic, queue):
                    raise
                # Retention deleted the segment between the two reads: from the new minimum.
        raise IndexError(f"{topic}/{queue} keeps losing its head to retention")

    async def _read_page_from(
        self, topic: str, queue: int, offset: int, max_messages: int
    ) -> PullPage:
        store = self.raftlog.store
        units = plan_units(
            store.read_units(topic, queue, offset, max_messages), self.config.max_pull_bytes
        )
        if sum(u.size for u in units) <= INLINE_READ_BYTES or self._pull_pool is None:
            return read_page(store.commitlog, units, offset, self.config.max_pull_bytes)
        self.offloaded_pulls += 1
        return await asyncio.get_running_loop().run_in_executor(
            self._pull_pool,
            read_page,
            store.commitlog,
            units,
            offset,
            self.config.max_pull_bytes,
        )

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

    def describe_topic(self, topic: str) -> dict[str, Any]:
        store = self.raftlog.store
        n = self.queue_count(topic)
        return {
            "topic": topic,
            "queues": [
                {
                    "queue": q,
                    "min_offset": store.min_offset(topic, q),
                    "max_offset": store.max_offset(topic, q),
                }
                for q in range(n)
            ],
        }

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

    # ------------------------------------------------------------------ consumer retry

    async def send_back(
        self, group: str, topic: str, queue: int, offset: int, delay_level: int
    ) -> dict[str, Any]:
        """Send a consumed message back: to ``%RETRY%{group}`` through a delay level, or to the DLQ.

        The message is read from the store (the leader's), so the client cannot forge its
        reconsume count. The request is idempotent per (group, topic, queue, offset): sending
        the same message back twice re-enqueues it once.
        """
        from chronomq.schedule.retry import RetryConfig, RetryTarget, plan_retry

        store = self.raftlog.store
        self.check_queue(topic, queue)
        found = store.read_messages(topic, queue, offset, 1)
        if not found:
            raise ApiError(
                404,
                "unknown_message",
                f"{topic}/{queue} has no message at offset {offset} "
                f"(max offset {store.max_offset(topic, queue)})",
                "offset",
            )
        msg = found[0]
        decision = plan_retry(
            topic=msg.topic,
            msg_id=record.msg_id_hex(msg.msg_id),
            reconsume_times=msg.reconsume_times,
            properties=msg.properties,
            group=group,
            config=RetryConfig(self.levels, self.config.max_reconsume_times),
            requested_level=delay_level,
        )
        store_ms = self.raftlog.clock.now_ms()
        creates = {}
        if store.queue_count(decision.topic) is None:
            creates[decision.topic] = 1
        answer: dict[str, Any] = {
            "target": decision.target.value,
            "topic": decision.topic,
            "reconsume_times": decision.reconsume_times,
        }
        if decision.target is RetryTarget.RETRY and decision.delay_level:
            placed = rewrite.place(
                decision.topic, 0, decision.delay_level, decision.properties, self.levels
            )
            self._create_schedule_topic(creates)
            new = NewMessage(
                placed.topic,
                msg.body,
                queue_id=placed.queue_id,
                properties=placed.properties,
                flag=msg.flag,
                born_ms=msg.born_ms,
                reconsume_times=decision.reconsume_times,
                tags_code=placed.deliver_ms(store_ms),
            )
            answer.update(
                delay_level=placed.level.level,
                deliver_ms=placed.deliver_ms(store_ms),
                clamped=decision.level_clamped,
            )
        else:
            new = NewMessage(
                decision.topic,
                msg.body,
                queue_id=0,
                properties=decision.properties,
                flag=msg.flag,
                born_ms=msg.born_ms,
                reconsume_times=decision.reconsume_times,
            )
        key = f"retry:{group}:{topic}:{queue}:{offset}"
        self.check_topic_room(creates)
        fut = self.raftlog.append(
            [new],
            key=key,
            creates=creates or None,
            store_ms=store_ms,
            fingerprint=idempotency.key_fingerprint(key),
        )
        outcome = await self.commit(fut)
        if self.logs is not None and not outcome.duplicate:
            self.logs.stored(decision.topic, outcome.placed, [dict(answer)], store_ms)
        if outcome.placed:
            p = outcome.placed[0]
            answer.update(
                msg_id=record.msg_id_hex(p.msg_id), queue=p.queue_id, offset=p.queue_offset
            )
        answer["duplicate"] = outcome.duplicate
        return answer

    # ------------------------------------------------------------------ membership

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
        (:func:`chronomq.raftlog.transfer.transfer_leadership`); the new leader's id, or None when it
        did not move in ``timeout_s``."""
        result = await transfer_leadership(self, None, timeout_s)
        if not result.moved:
            log.warning("handing the leadership over failed: %s", result.message)
            return None
        return result.leader_id

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

    # ------------------------------------------------------------------ status

    def node_status(self) -> dict[str, Any]:
        st = self.raftlog.status()
        leader_addr = st.get("leader")
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
            "digest": st["digest"],
            "match_index": st["match_index"],
            "peers_connected": st["peers_connected"],
            "version": VERSION,
            "uptime_s": round(time.monotonic() - self.started_monotonic, 1),
            "queued_messages": st["queued_messages"],
            "inflight_commands": st["inflight_commands"],
            "client_idempotency_keys": len(self.raftlog.store.clients),
            "client_idempotency_keys_evicted": self.raftlog.store.clients_evicted,
            "last_election_ms": self.last_election_ms,
            "pull_waiters": self.waiters.waiting,
            "pull_waited_queues": self.waiters.queues,
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
        nodes = [self.node_status()]
        for p, st in zip(peers, remote, strict=True):
            nodes.append(
                st or {"id": p.id, "role": "unknown", "http_url": p.http, "reachable": False}
            )
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


def _messages_in(raw: Any) -> Any:
    """Messages as :class:`MessageIn` (the gRPC endpoint and tests give JSON objects)."""
    if not isinstance(raw, list) or not raw or all(type(m) is MessageIn for m in raw):
        return raw
    return models.convert({"messages": raw}, ProduceRequest).messages


def _too_many_topics(problem: str) -> ApiError:
    message = problem.removeprefix(TOO_MANY_TOPICS + ": ")
    return ApiError(429, TOO_MANY_TOPICS, message, "topic")
