"""pysyncobj's TCP transport with the Raft port closed to strangers.

Every adjustment to pysyncobj 0.3.17 that this takes, each small and in one place:

1. ``pysyncobj.transport.TcpConnection`` and ``pysyncobj.tcp_server.TcpConnection`` (the names
   the transport and the server build connections with) become :func:`chronomq.raftlog.wire.connection`:
   the handshake on the cluster secret, MACed frames, restricted unpickling
   (:func:`install`).
2. ``pysyncobj.syncobj.pickle`` and ``pysyncobj.serializer.pickle`` (the module
   ``pysyncobj.pickle``) and ``pysyncobj.journal.loads`` become
   :data:`chronomq.raftlog.safepickle.PYSYNCOBJ_PICKLE` / :func:`chronomq.raftlog.safepickle.loads_log`: the
   membership and version commands applied from the log, the reassembly of one large entry sent
   as a 'transmission', and a journal meta file of pysyncobj's format (read once by
   :mod:`chronomq.raftlog.journal`, which writes JSON) are unpickled with an allowlist (:func:`install`).
3. :class:`GuardedTransport`, given to ``SyncObj`` as its ``transportClass``, registers no
   utility command (pysyncobj's unauthenticated ``status``, ``add``, ``remove``,
   ``set_version``, ``transfer``: membership changes go through the HTTP admin API, which calls
   ``addNodeToCluster`` / ``removeNodeFromCluster`` in-process), refuses read-only clients and
   unknown node names on an incoming connection, logs each refusal, and sweeps handshakes that
   outlived their deadline on every tick.
4. ``SyncObjConf.bindAddress`` is the node's own Raft address (``raftlog/machine.py``), so the
   listener binds ``raft_host`` and not 0.0.0.0.
5. :class:`GuardedTransport` adds ``"transfer": True`` to the ``request_vote`` messages of an
   election that a leadership transfer's TimeoutNow started (``vote_fields``), so voters can
   tell it from a campaign of a node that merely stopped hearing its leader.
6. :class:`GuardedTransport` holds a follower's acknowledgements of appended entries
   (``next_node_idx``) while ``ack_gate()`` says the journal has entries not yet synced; the
   Raft thread syncs once per tick and then calls :meth:`GuardedTransport.release_acks`
   (``flush="sync"``, raftlog/machine.py): one fsync for every entry received meanwhile.
7. :class:`GuardedTransport` adds what :attr:`GuardedTransport.append_fields` gives (the
   leader's ``{"lease": bool}``, raftlog/readiness.py) to every ``append_entries`` message:
   a follower is ready only while its leader says a majority acknowledges it; and what
   :attr:`GuardedTransport.ack_fields` gives (the follower's ``{"disk": [free, total]}``,
   raftlog/room.py) to every ``next_node_idx``, which the leader's produce guard reads
   (pysyncobj ignores fields it does not know).
8. The hello of every connection carries the node's chronomq version and wire version
   (:mod:`chronomq.raftlog.wireproto`); a peer of another wire version is refused and said at
   ERROR with both versions, and what each peer's hello said is kept by Raft address
   (``context.versions``, shown in the node status).
9. ``pysyncobj.serializer.atomicReplace`` (the rename of a written or received snapshot into
   place) syncs the file and then its directory (:func:`durable_replace`): pysyncobj drops
   the journal entries a snapshot covers right after it.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

import pysyncobj.journal as _journal_module
import pysyncobj.serializer as _serializer_module
import pysyncobj.syncobj as _syncobj_module
import pysyncobj.tcp_server as _tcp_server_module
import pysyncobj.transport as _transport_module
from pysyncobj.tcp_connection import CONNECTION_STATE
from pysyncobj.transport import TCPTransport

from chronomq.raftlog import durable, safepickle, wire
from chronomq.raftlog.config import RaftConfig
from chronomq.raftlog.wire import WireContext, WireSettings
from chronomq.raftlog.wireproto import VERSION as WIRE_VERSION
from chronomq.version import VERSION as CHRONOMQ_VERSION

log = logging.getLogger(__name__)

_SLACK_BYTES = 1024 * 1024  # pickle and dict overhead around the entries of one message


#: Tests only: the wire version a node advertises in its hello instead of its own, to run a
#: node that peers see as another version (a real build of another wire version cannot be
#: installed beside this one in one environment). Not a setting: no operator needs it.
TEST_WIRE_VERSION_ENV = "CHRONOMQ_TEST_WIRE_VERSION"


def settings_for(config: RaftConfig) -> WireSettings:
    """The wire settings of a node: the largest frame is one append message's entries
    (``append_entries_batch_bytes``, plus the entry that crosses it) with room to spare; the
    hello carries this build's version."""
    largest_command = max(config.max_message_bytes, config.batch_max_bytes)
    advertised = os.environ.get(TEST_WIRE_VERSION_ENV, "")
    return WireSettings(
        secret=config.cluster_secret,
        max_payload_bytes=config.append_entries_batch_bytes + 2 * largest_command + _SLACK_BYTES,
        compression_level=config.wire_compression_level,
        about=CHRONOMQ_VERSION,
        wire_version=int(advertised) if advertised.isdigit() else WIRE_VERSION,
    )


def install() -> None:
    """Adjustments 1 and 2 of the module docstring (idempotent)."""
    _transport_module.TcpConnection = wire.connection
    _tcp_server_module.TcpConnection = wire.connection
    _syncobj_module.pickle = safepickle.PYSYNCOBJ_PICKLE
    _serializer_module.pickle = safepickle.PYSYNCOBJ_PICKLE
    _journal_module.loads = safepickle.loads_log
    _serializer_module.atomicReplace = durable_replace


def durable_replace(src: str, dst: str) -> None:
    """Rename ``src`` over ``dst``, both the file's bytes and its new name synced; a failed
    fsync stops the node."""
    durable.sync_file(src)
    durable.replace(src, dst)


def _describe(message: Any) -> str:
    if isinstance(message, list) and message and isinstance(message[0], str):
        return f"pysyncobj admin command {message[0][:32]!r} (use the HTTP admin API)"
    if message == "readonly":
        return "pysyncobj read-only client"
    return f"first message names no member ({str(message)[:80]!r})"


def without_entries(message: dict[str, Any]) -> dict[str, Any]:
    """An append message as a bare heartbeat: no entries, no part of a large entry, no
    snapshot chunk (the leader sends them again once the follower takes them)."""
    if message.get("transmission") is not None:
        bare = {k: v for k, v in message.items() if k not in ("transmission", "data")}
        return {**bare, "entries": []}
    if "serialized" in message:
        return {**message, "serialized": None}
    if message.get("entries"):
        return {**message, "entries": []}
    return message


class GuardedTransport(TCPTransport):
    """pysyncobj's TCP transport on :mod:`chronomq.raftlog.wire`, without admin commands or read-only
    clients. Built by ``SyncObj`` as ``transportClass(syncObj, selfNode, otherNodes)``: bind
    ``settings`` first (``functools.partial``)."""

    def __init__(
        self,
        syncObj: Any,
        selfNode: Any,
        otherNodes: Any,
        *,
        settings: WireSettings,
    ) -> None:
        self.context = WireContext(settings, wire.RefusalLog(logging.getLogger(wire.__name__)))
        # Before the base class connects to the other nodes.
        wire.register(syncObj._poller, self.context)
        super().__init__(syncObj, selfNode, otherNodes)

    #: Fields added to every ``request_vote`` sent while set: ``{"transfer": True}`` during the
    #: tick in which a follower told TimeoutNow starts its election (raftlog/machine.py).
    vote_fields: dict[str, Any] | None = None

    #: Called for the fields added to every ``append_entries`` sent (None: none added).
    append_fields: Callable[[], dict[str, Any]] | None = None
    #: Called for the fields added to every ``next_node_idx`` (a follower's answer) sent.
    ack_fields: Callable[[], dict[str, Any]] | None = None

    #: ``holds_entries(node)``: True while that follower said it has no disk room; its
    #: append messages then go without entries (raftlog/room.py).
    holds_entries: Callable[[Any], bool] | None = None

    def marked(self, message: Any, node: Any = None) -> Any:
        """``message`` with :attr:`vote_fields` when it is a ``request_vote`` sent while set,
        with :attr:`append_fields` when it is an ``append_entries`` (and without its entries
        to a follower that :attr:`holds_entries`)."""
        if not isinstance(message, dict):
            return message
        kind = message.get("type")
        fields = self.vote_fields
        if fields and kind == "request_vote":
            return {**message, **fields}
        extra = self.append_fields
        if extra is not None and kind == "append_entries":
            message = {**message, **extra()}
            held = self.holds_entries
            if held is not None and node is not None and held(node):
                message = without_entries(message)
            return message
        extra = self.ack_fields
        if extra is not None and kind == "next_node_idx":
            return {**message, **extra()}
        return message

    #: While set and true, ``next_node_idx`` messages wait in :attr:`held_acks`.
    ack_gate: Any = None
    held_acks: list[tuple[Any, Any]] | None = None

    def send(self, node: Any, message: Any) -> bool:
        gate = self.ack_gate
        if (
            gate is not None
            and isinstance(message, dict)
            and message.get("type") == "next_node_idx"
            and (self.held_acks or gate())
        ):
            # Behind an earlier held answer too, so that the leader reads them in order.
            if self.held_acks is None:
                self.held_acks = []
            self.held_acks.append((node, message))
            return True
        return bool(super().send(node, self.marked(message, node)))

    def release_acks(self) -> None:
        """Send the held acknowledgements (the journal has just been synced)."""
        held, self.held_acks = self.held_acks, None
        for node, message in held or ():
            super().send(node, self.marked(message, node))

    def setOnUtilityMessageCallback(self, message: str, callback: Any) -> None:  # noqa: N802
        """pysyncobj's admin commands over the Raft port: none is registered."""

    def _onTick(self) -> None:  # noqa: N802
        super()._onTick()
        self.context.sweep(time.monotonic())

    def _onNewIncomingConnection(self, conn: Any) -> None:  # noqa: N802
        if conn.state == CONNECTION_STATE.DISCONNECTED:
            return  # refused on accept (too many handshakes)
        super()._onNewIncomingConnection(conn)

    def _onIncomingMessageReceived(self, conn: Any, message: Any) -> None:  # noqa: N802
        """The first message of an authenticated incoming connection: a member's address."""
        if isinstance(message, str) and message in self._nodeAddrToNode:
            hello = getattr(conn, "peer_hello", None)
            if hello is not None:
                self.context.versions.seen(message, hello)
            super()._onIncomingMessageReceived(conn, message)
            return
        self._unknownConnections.discard(conn)
        conn.refuse(_describe(message))
