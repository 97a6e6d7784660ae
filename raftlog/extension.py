"""Apply extensions: state machines that ride on the replicated log without raftlog knowing them.

Some services need writes that are *derived* on every replica from the log itself, in log
order, so that every CommitLog stays byte-identical: the timer delivers messages, moves its
read cursor, re-puts rolled messages and writes cancel tombstones, all decided when a command
is applied. raftlog offers one generic seam for that and knows nothing of what rides on it:

* A service registers an :class:`ApplyExtension` under a name
  (:meth:`chronomq.raftlog.node.RaftLog.register_extension`).
* The leader proposes :attr:`~chronomq.raftlog.command.Kind.EXTENSION` commands that carry the name and a
  JSON payload (:meth:`chronomq.raftlog.node.RaftLog.propose_extension`); the propose time in the
  command is the leader's clock, the only "now" apply may use.
* Every replica's :meth:`chronomq.raftlog.store.Store.apply` hands the payload to the extension with an
  :class:`ApplyContext`, through which it reads the store, appends derived records (placed in
  the CommitLog and ConsumeQueues exactly like produced ones, and covered by the digest) and
  changes replicated kv entries. Its return value reaches the proposer as
  :attr:`chronomq.raftlog.store.ApplyResult.ext`.

What an extension must keep across restarts and snapshot installs goes into kv: kv is in the
thin snapshot. Anything else it derives (its own files) it re-aligns to kv in
:meth:`ApplyExtension.attach`, which the store calls when the extension registers and again
after every snapshot restore or reset, so the files always match the state the log says.

Registration happens after the Raft machine has started (services are built once the node's
log exists), and pysyncobj may already be applying journal entries by then. A command for an
extension that is not registered yet therefore *waits* for it (``Store.extension_wait_s``), and
the node exits if it never comes: applying it without the extension would diverge this replica.
A node that knows which extensions its cluster runs (``Store.expected_extensions``) rejects a
command for any other name at once, on every replica alike.

An extension's apply must be total too: a payload or record that breaks its rules is answered
deterministically (counted, logged, ignored), or it raises
:class:`~chronomq.raftlog.errors.ApplyRejected` and the store records the rejection. Only a fault of
this node (``OSError``, :class:`~chronomq.raftlog.errors.NodeFault`) may escape and stop it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from chronomq.raftlog.errors import ApplyRejected, InvalidInput
from chronomq.raftlog.record import validate_topic

if TYPE_CHECKING:
    from chronomq.raftlog.store import Placed, Store

#: Longest extension name; it travels in every command of that extension.
MAX_NAME_LENGTH = 32


class ApplyExtension(Protocol):
    """What a registered extension provides. Every method runs with the store's extension lock
    held, so they never run concurrently with one another."""

    @property
    def name(self) -> str: ...

    def attach(self, store: Store) -> None:
        """Align derived local state to the replicated state in ``store`` (its kv).

        Called at registration, after :meth:`Store.restore` (startup or an installed snapshot)
        and after :meth:`Store.reset` (the journal is about to be replayed from its start).
        """

    def apply(self, ctx: ApplyContext, payload: Any) -> Any:
        """Apply one command of this extension. Must be deterministic: no clock, no randomness,
        nothing local that differs between replicas. The return value is handed to the
        proposer's callback as ``ApplyResult.ext``."""

    def before_snapshot(self, index: int) -> None:
        """The store is about to write a snapshot at ``index``: persist derived state that the
        snapshot's kv will describe (e.g. flush files), so a restart can trust it."""

    def close(self) -> None:
        """The store is closing (the Raft thread has stopped): release files."""


@dataclass(frozen=True, slots=True)
class DerivedRecord:
    """One record an extension appends: an encoded message record and where it goes.

    ``topic``/``queue_id`` must be the ones encoded in ``data``; the ConsumeQueue offset and the
    physical offset are filled in when it is placed.
    """

    topic: str
    queue_id: int
    data: bytes | bytearray


class ApplyContext:
    """An extension's view of the store while one command is applied."""

    __slots__ = ("_store", "index", "propose_ms", "messages", "bytes_written")

    def __init__(self, store: Store, index: int, propose_ms: int) -> None:
        self._store = store
        #: Raft index of the command being applied.
        self.index = index
        #: The leader's clock when it proposed the command: the only time apply may use.
        self.propose_ms = propose_ms
        self.messages = 0
        self.bytes_written = 0

    @property
    def store(self) -> Store:
        """Read access to the store (CommitLog, ConsumeQueues, topics, kv)."""
        return self._store

    def kv_get(self, key: str) -> int | str | None:
        return self._store.kv.get(key)

    def kv_set(self, key: str, value: int | str | None) -> None:
        """Set (``None``: delete) a replicated kv entry; it is part of the snapshot."""
        if value is None:
            self._store.kv.pop(key, None)
        else:
            self._store.kv[key] = value

    def ensure_topic(self, topic: str, queues: int) -> int:
        """Create ``topic`` with ``queues`` queues if it does not exist; its queue count."""
        existing = self._store.topics.get(topic)
        if existing is not None:
            return len(existing)
        try:
            validate_topic(topic)
        except InvalidInput as exc:
            raise ApplyRejected(f"extension asked for topic {topic[:40]!r}: {exc}") from None
        if not 1 <= queues <= 1024:
            raise ApplyRejected(f"extension asked for topic {topic} with {queues} queues")
        self._store.topics[topic] = [0] * queues
        return queues

    def append(self, records: Sequence[DerivedRecord], *, internal: bool = False) -> list[Placed]:
        """Place records at the end of the CommitLog and index them, as one write.

        ``internal``: the extension's own bookkeeping in a system topic no consumer reads; the
        bytes count, but not as messages (``ApplyResult.messages`` wakes long-polling pulls).
        """
        if not records:
            return []
        placed = self._store._append_derived(records)
        if not internal:
            self.messages += len(placed)
        self.bytes_written += sum(p.size for p in placed)
        return placed


def check_name(name: str) -> str:
    if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_LENGTH:
        raise ValueError(f"an extension name is 1..{MAX_NAME_LENGTH} characters, got {name!r}")
    return name
