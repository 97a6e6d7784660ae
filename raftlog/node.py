"""One node's replicated log: the facade the broker uses.

:class:`RaftLog` owns the :class:`Store`, the Raft machine, the catch-up server, the group
committer and the leadership watch. On the leader, :meth:`RaftLog.append` validates messages,
decides everything that must not be decided by apply (message id, store time, queue), encodes
the records and queues them for group commit.

Leadership is *confirmed*, not assumed: after pysyncobj says this node leads, a barrier command
must commit in the current term before listeners hear ``leader=True`` (so every earlier entry is
applied here), and a leader that has committed nothing for ``leader_lease_ms`` is reported as
lost: pysyncobj alone would keep believing it leads for ``leaderFallbackTimeout``.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from chronomq.raftlog import command as cmdcodec
from chronomq.raftlog import record
from chronomq.raftlog.applycheck import RecordRule
from chronomq.raftlog.catchup import CatchupServer
from chronomq.raftlog.clock import Clock, SystemClock
from chronomq.raftlog.committer import GroupCommitter, PendingBatch, _failure
from chronomq.raftlog.config import RaftConfig, host_port
from chronomq.raftlog.consumequeue import tags_hash
from chronomq.raftlog.errors import (
    CommitOutcomeUnknown,
    ConditionFailed,
    InvalidInput,
    MessageTooLarge,
    NotLeader,
    UnknownQueue,
    UnknownTopic,
)
from chronomq.raftlog.extension import ApplyExtension, check_name
from chronomq.raftlog.machine import ReplicatedLog
from chronomq.raftlog.readiness import RaftView, Readiness, judge
from chronomq.raftlog.removal import RemovalNotice
from chronomq.raftlog.store import ApplyResult, BatchOutcome, Store, TopicLimits

log = logging.getLogger(__name__)


def _bind_error(address: str) -> str:
    """What binding ``address`` (``host:port``) fails with now, as pysyncobj binds it."""
    host, port = host_port(address)
    host = host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            return str(exc)
    return "the listener was not bound in time"


LeaderListener = Callable[[bool, int], None]


@dataclass(frozen=True, slots=True)
class NewMessage:
    """A message to append, as the caller gives it."""

    topic: str
    body: bytes
    queue_id: int | None = None
    properties: Mapping[str, str] = field(default_factory=dict)
    flag: int = 0
    sys_flag: int = 0
    born_ms: int = 0
    reconsume_times: int = 0
    tags_code: int | None = None
    msg_id: bytes | None = None  # kept when a delayed message is delivered


class RaftLog:
    def __init__(
        self,
        config: RaftConfig,
        *,
        clock: Clock | None = None,
        auto_create_topics: bool = True,
        extensions: Iterable[str] | None = None,
        record_rules: Mapping[str, RecordRule] | None = None,
    ) -> None:
        """``extensions``: the names of every apply extension the cluster runs (a command for
        another is rejected at apply; None waits for any). ``record_rules``: checks for the
        records of some topics (:mod:`chronomq.raftlog.applycheck`). Both are in force before the first
        command applies, and must be equal on every node."""
        self.config = config
        self.clock = clock or SystemClock()
        self.auto_create_topics = auto_create_topics
        self.store = Store(
            config.data_dir,
            segment_bytes=config.commitlog_segment_bytes,
            flush=config.flush,
            flush_interval_ms=config.flush_interval_ms,
            idempotency_window_batches=config.idempotency_window_batches,
            client_window_ms=config.idempotency_window_s * 1000,
            client_max_keys=config.idempotency_max_keys,
            topic_limits=TopicLimits(config.max_topics, config.max_queues),
            max_open_cq_files=config.max_open_cq_files,
        )
        if extensions is not None:
            self.store.expected_extensions = frozenset(extensions)
        self.store.record_rules.update(record_rules or {})
        self._ids = record.MessageIdSource()
        # Batch keys: unique per process start, cheap per batch (no urandom per call).
        self._key_prefix = uuid.uuid4().hex[:16]
        self._key_seq = itertools.count()
        self._rr: dict[str, itertools.count[int]] = {}
        self._listeners: list[LeaderListener] = []
        self._leader_term: int | None = None
        self._barrier_inflight = False
        self._last_ok = 0.0
        self._stop = threading.Event()
        host, port = host_port(config.fetch_address)
        self.catchup = CatchupServer(
            host,
            port,
            self.store.commitlog,
            lambda: self.store.applied_length,
            secret=config.cluster_secret,
        )
        self.machine = ReplicatedLog(config, self.store)
        self.machine.addOnTickCallback(self._first_tick)
        # Followers are ready only while their leader says its lease holds.
        self.machine.advertise(lambda: {"lease": self._leader_term is not None})
        self.catchup.start()
        self.committer = GroupCommitter(
            lambda data, cb: self.machine._apply_cmd(data, callback=cb),
            max_messages=config.batch_max_messages,
            max_bytes=config.batch_max_bytes,
            max_inflight=config.max_inflight_commands,
            max_pending_messages=config.max_pending_messages,
            max_pending_bytes=config.max_pending_bytes,
            max_command_bytes=max(config.append_entries_batch_bytes, config.batch_max_bytes),
            commit_timeout_ms=config.commit_timeout_ms,
            now_ms=self.clock.now_ms,
            idem=self.store.default_idem,
        )
        self._watch = threading.Thread(
            target=self._watch_leadership, name="leadership", daemon=True
        )
        self._watch.start()

    def _first_tick(self) -> None:
        # Runs on every tick; cheap. (Removing itself here would deadlock: pysyncobj holds
        # its callback lock while calling.)
        self.machine.mark_started()

    # ------------------------------------------------------------------ leadership

    @property
    def is_leader(self) -> bool:
        """True once leadership is confirmed by a commit in the current term."""
        return self._leader_term is not None

    @property
    def leader_term(self) -> int | None:
        return self._leader_term

    def leader_address(self) -> str | None:
        """The leader to name in answers and to forward to: pysyncobj's, but never this node
        while its leadership is not confirmed (a leader that stepped down, or one not yet
        confirmed, would send clients back to itself)."""
        leader = getattr(self.machine._getLeader(), "id", None)
        if leader == self.config.raft_address and not self.is_leader:
            return None
        return leader

    def readiness(self) -> Readiness:
        """Whether a write sent to this node can commit now (:mod:`chronomq.raftlog.readiness`)."""
        machine = self.machine
        view = RaftView(
            self_address=self.config.raft_address,
            leads=machine._isLeader(),
            confirmed=self.is_leader,
            leader=getattr(machine._getLeader(), "id", None),
            leader_heard_s=machine.leader_heard_s(),
            leader_lease=machine.leader_lease,
            window_s=self.config.leader_lease_ms / 1000,
        )
        return judge(view, machine.monotonic_s())

    def add_leader_listener(self, listener: LeaderListener) -> None:
        """``listener(is_leader, term)`` runs on the leadership thread on every change."""
        self._listeners.append(listener)

    def _fire(self, leader: bool, term: int) -> None:
        log.info("leadership %s in term %d", "confirmed" if leader else "lost", term)
        for listener in list(self._listeners):
            try:
                listener(leader, term)
            except Exception:
                log.exception("leader listener failed")

    def _barrier(self, term: int) -> None:
        self._barrier_inflight = True
        data = cmdcodec.encode(cmdcodec.Command(cmdcodec.Kind.BARRIER, self.clock.now_ms()))

        def done(res: Any, err: int) -> None:
            self._barrier_inflight = False
            if err == 0 and self.machine.raftCurrentTerm == term:
                self._last_ok = time.monotonic()
                if self._leader_term is None and self.machine._isLeader():
                    self._leader_term = term
                    self._fire(True, term)

        try:
            self.machine._apply_cmd(data, callback=done)
        except Exception:
            self._barrier_inflight = False
            log.exception("proposing a barrier failed")

    def _watch_leadership(self) -> None:
        lease_s = self.config.leader_lease_ms / 1000
        barrier_sent = 0.0
        while not self._stop.wait(0.02):
            try:
                leads = self.machine._isLeader()
                term = self.machine.raftCurrentTerm
                now = time.monotonic()
                # A majority answering this leader's appends keeps the lease too: a large
                # command may take longer than the lease to commit while followers ack.
                last_ok = max(
                    self._last_ok,
                    self.committer.last_commit_monotonic,
                    now - self.machine.quorum_silence_s(),
                )
                if self._leader_term is not None and (
                    not leads or term != self._leader_term or now - last_ok > lease_s
                ):
                    lost = self._leader_term
                    self._leader_term = None
                    self.committer.fail_all(
                        NotLeader(
                            "leadership lost; the write was not proposed", self.leader_address()
                        ),
                        CommitOutcomeUnknown(
                            "leadership lost after the write was proposed; it may have "
                            "committed: retry with the same idempotency key"
                        ),
                    )
                    self._fire(False, lost)
                if not leads:
                    continue
                # Confirm a new term, and keep the lease alive when nothing else commits.
                stale = now - last_ok > lease_s / 3
                if (self._leader_term is None or stale) and (
                    not self._barrier_inflight or now - barrier_sent > lease_s
                ):
                    barrier_sent = now
                    self._barrier(term)
            except Exception:
                log.exception("leadership watch failed")

    def wait_leader(self, timeout_s: float) -> bool:
        """Block until this node has confirmed leadership (for tests and benchmarks)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.is_leader:
                return True
            self._stop.wait(0.01)
        return False

    # ------------------------------------------------------------------ writes

    def _check_leader(self) -> None:
        if not self.is_leader:
            raise NotLeader("this node is not the leader", self.leader_address())

    def prepare(
        self,
        messages: Sequence[NewMessage],
        store_ms: int | None = None,
        creates: Mapping[str, int] | None = None,
    ) -> tuple[list[str], list[tuple[int, int, int]], bytes, dict[str, int]]:
        """Validate and encode ``messages``: decide ids, store time and queues.

        ``creates`` are topics the same batch creates, with their queue counts.
        """
        topics: list[str] = []
        tindex: dict[str, int] = {}
        metas: list[tuple[int, int, int]] = []
        creates = dict(creates or {})
        parts: list[bytes | bytearray] = []
        store_ms = self.clock.now_ms() if store_ms is None else store_ms
        max_bytes = self.config.max_message_bytes
        max_record = self.store.commitlog.segment_bytes - record.BLANK_SIZE
        for i, m in enumerate(messages):
            record.validate_topic(m.topic, f"messages[{i}].topic")
            n = self.store.queue_count(m.topic) or creates.get(m.topic)
            if n is None:
                if not self.auto_create_topics:
                    raise UnknownTopic(f"topic {m.topic} does not exist", "topic")
                n = creates[m.topic] = self.config.default_topic_queues
            if m.queue_id is None:
                rr = self._rr.get(m.topic)
                if rr is None:
                    rr = self._rr[m.topic] = itertools.count()
                qid = next(rr) % n
            else:
                qid = m.queue_id
                if not 0 <= qid < n:
                    raise UnknownQueue(
                        f"topic {m.topic} has queues 0..{n - 1}, not {qid}", f"messages[{i}].queue"
                    )
            props = dict(m.properties)
            tags_code = (
                m.tags_code
                if m.tags_code is not None
                else tags_hash(props.get(record.PROPERTY_TAGS))
            )
            try:
                rec = record.encode(
                    topic=m.topic,
                    queue_id=qid,
                    msg_id=m.msg_id or self._ids.next_id(store_ms),
                    body=m.body,
                    properties=props,
                    flag=m.flag,
                    sys_flag=m.sys_flag,
                    born_ms=m.born_ms or store_ms,
                    store_ms=store_ms,
                    reconsume_times=m.reconsume_times,
                    tags_code=tags_code,
                    max_message_bytes=max_bytes,
                )
            except InvalidInput as exc:
                raise type(exc)(
                    str(exc), f"messages[{i}].{exc.field}" if exc.field else None
                ) from None
            if len(rec) > max_record:
                # Apply could not place it, on any node.
                raise MessageTooLarge(
                    f"message record is {len(rec)} bytes, more than a CommitLog segment holds ({max_record})",
                    f"messages[{i}].body",
                )
            t = tindex.get(m.topic)
            if t is None:
                t = tindex[m.topic] = len(topics)
                topics.append(m.topic)
            metas.append((t, qid, len(rec)))
            parts.append(rec)
        return topics, metas, b"".join(parts), creates

    def append(
        self,
        messages: Sequence[NewMessage],
        *,
        key: str | None = None,
        expect: Mapping[str, cmdcodec.Scalar] | None = None,
        updates: Mapping[str, cmdcodec.Scalar] | None = None,
        creates: Mapping[str, int] | None = None,
        store_ms: int | None = None,
        fingerprint: str | None = None,
    ) -> Future[BatchOutcome]:
        """Append messages (and state updates) atomically; the future resolves on commit.

        ``key`` makes the batch idempotent: a batch whose key was applied before is not applied
        again and resolves to the first outcome (``duplicate=True``). With ``fingerprint`` (a
        hash of the client's request, hex) the key is a client's: it is remembered for
        ``idempotency_window_s`` of propose time, and the same key with another fingerprint
        fails with :class:`IdempotencyKeyReused`. Without, it is kept among the last
        ``idempotency_window_batches`` internal batches.
        """
        self._check_leader()
        topics, metas, blob, auto = self.prepare(messages, store_ms, creates)
        all_creates = {**auto, **(creates or {})}
        batch = PendingBatch(
            key=key or f"{self._key_prefix}-{next(self._key_seq)}",
            topics=topics,
            messages=metas,
            blob=blob,
            expect=expect,
            updates=updates,
            creates=all_creates or None,
            fingerprint=fingerprint if key else None,
        )
        return self.committer.submit(batch)

    def update(
        self,
        updates: Mapping[str, cmdcodec.Scalar],
        *,
        expect: Mapping[str, cmdcodec.Scalar] | None = None,
        key: str | None = None,
    ) -> Future[BatchOutcome]:
        return self.append((), key=key, expect=expect, updates=updates)

    def create_topic(self, topic: str, queues: int) -> Future[BatchOutcome]:
        record.validate_topic(topic)
        if not 1 <= queues <= 1024:
            raise InvalidInput("queues must be between 1 and 1024", "queues")
        return self.append((), creates={topic: queues})

    # ------------------------------------------------------------------ extensions

    def register_extension(self, ext: ApplyExtension) -> None:
        """Register an apply extension (see :mod:`chronomq.raftlog.extension`) on this node.

        Every node must register the same extensions: a command for one this node lacks
        waits for it, then stops the node.
        """
        self.store.register_extension(ext)

    def propose_extension(self, name: str, payload: object) -> Future[ApplyResult]:
        """Propose an ``EXTENSION`` command; the future resolves with its :class:`ApplyResult`
        (``result.ext`` is what the extension's apply returned) once committed and applied here.

        Not group-committed: an extension batches its own work. The future fails with
        :class:`NotLeader` when leadership changes first. pysyncobj may also never answer (the
        index covered by an installed snapshot), so callers bound their wait; the outcome is
        then unknown and an extension's commands must be safe to apply late or twice.
        """
        self._check_leader()
        check_name(name)
        data = cmdcodec.encode(
            cmdcodec.Command(
                cmdcodec.Kind.EXTENSION, self.clock.now_ms(), extra={"e": name, "p": payload}
            )
        )
        fut: Future[ApplyResult] = Future()

        def done(res: Any, err: int) -> None:
            with contextlib.suppress(Exception):  # the caller may have cancelled it
                if err == 0:
                    self._last_ok = time.monotonic()
                    fut.set_result(res)
                else:
                    fut.set_exception(_failure(err))

        try:
            self.machine._apply_cmd(data, callback=done)
        except Exception as exc:
            fut.set_exception(exc)
        return fut

    # ------------------------------------------------------------------ membership

    def is_member(self, raft_address: str) -> bool:
        """True when ``raft_address`` is another member in this node's Raft configuration."""
        return raft_address in {n.id for n in list(self.machine.otherNodes)}

    def wait_listening(self, timeout_s: float) -> str | None:
        """Wait until the Raft listener is bound; None once it is, else why it is not.

        pysyncobj binds on its tick thread and, when the address is taken, only retries
        every second, silently: the node would serve HTTP while no peer can reach it, and
        never learn a leader. The caller stops the node instead (fail-stop)."""
        deadline = time.monotonic() + timeout_s
        while not self.machine.raft_listening():
            if time.monotonic() >= deadline:
                return _bind_error(self.config.raft_address)
            time.sleep(0.02)
        return None

    def leads_caught_up(self) -> bool:
        """True when this node is the confirmed leader and has applied everything it knows
        committed: a message its queues lack now is not in the log (not merely not applied
        yet here)."""
        m = self.machine
        return (
            self.is_leader and m._SyncObj__raftLastApplied >= m._SyncObj__raftCommitIndex  # noqa: SLF001
        )

    def first_entry_applied(self) -> bool:
        """True when this leader has applied the no-op entry that opens its term.

        pysyncobj refuses a membership change (``REQUEST_DENIED``) until then: its pending
        change guard is the index of that no-op, set when a node becomes leader and only
        checked against what it has applied. A leader with a backlog of entries to apply
        after an election (a transfer under load) refuses every change until the backlog is
        applied.
        """
        noop = getattr(self.machine, "_SyncObj__noopIDx", None)
        return (
            self.machine._isLeader() and noop is not None and self.machine.raftLastApplied >= noop
        )

    def change_membership(self, action: str, raft_address: str) -> Future[None]:
        """Add (``"add"``) or remove (``"remove"``) a Raft member; resolves when committed.

        Fails with :class:`ConditionFailed` when pysyncobj refuses it (``REQUEST_DENIED``);
        :meth:`membership_refusal` says why.
        """
        self._check_leader()
        if action not in ("add", "remove"):
            raise InvalidInput(f"unknown membership action {action!r}", "action")
        fut: Future[None] = Future()
        if (action == "add") == self.is_member(raft_address):
            # Already done (a retried request): asking pysyncobj again would be refused.
            fut.set_result(None)
            return fut

        def done(_res: Any, err: int) -> None:
            if fut.done():
                return
            if err == 0:
                log.info("Raft membership change committed: %s %s", action, raft_address)
                fut.set_result(None)
            elif err == 6:  # REQUEST_DENIED
                fut.set_exception(ConditionFailed(self.membership_refusal(action, raft_address)))
            else:
                fut.set_exception(
                    NotLeader(f"membership change failed (reason {err})", self.leader_address())
                )

        if action == "add":
            self.machine.addNodeToCluster(raft_address, callback=done)
        else:
            self.machine.removeNodeFromCluster(raft_address, callback=done)
        return fut

    def membership_refusal(self, action: str, raft_address: str) -> str:
        """Why pysyncobj refused a membership change, as far as this node can tell."""
        if not self.machine._isLeader():
            return "this node stopped leading before the change was proposed; retry"
        if not self.first_entry_applied():
            return (
                "the leader has not applied the first entry of its term yet (it is still "
                "applying entries after an election); retry"
            )
        if action == "add" and self.is_member(raft_address):
            return f"{raft_address} is already a member"
        if action == "remove" and not self.is_member(raft_address):
            return f"{raft_address} is not a member"
        return "another membership change is still in progress; retry"

    # ------------------------------------------------------------------ reads

    @property
    def removal(self) -> RemovalNotice | None:
        """The recorded removal of this node from the cluster, or None."""
        return self.machine.removal

    def mark_removed(self, notice: RemovalNotice) -> bool:
        return self.machine.mark_removed(notice)

    def add_apply_listener(self, listener: Callable[[ApplyResult], None]) -> None:
        """``listener(result)`` runs on the Raft thread after every applied command."""
        self.store.listeners.append(listener)

    def read(
        self, topic: str, queue_id: int, offset: int, max_messages: int
    ) -> list[record.Message]:
        return self.store.read_messages(topic, queue_id, offset, max_messages)

    def status(self) -> dict[str, Any]:
        st = self.machine.status()
        st.update(
            confirmed_leader=self.is_leader,
            digest=self.store.digest(),
            queued_messages=self.committer.queued_messages,
            inflight_commands=self.committer.inflight_commands,
        )
        return st

    def digest(self) -> dict[str, object]:
        return self.store.digest()

    def close(self) -> None:
        self._stop.set()
        self._watch.join(timeout=2)
        self.committer.close()
        self.catchup.close()
        self.machine.destroy()
        # destroy() only asks the tick thread to stop; until it has, it may still apply or
        # snapshot into the store, so the store must not be closed under it.
        deadline = time.monotonic() + 10
        while self.machine.tick_thread_alive():
            if time.monotonic() > deadline:
                log.warning(
                    "the Raft tick thread did not stop within 10 s; closing the store anyway"
                )
                break
            time.sleep(0.005)
        self.store.close()
