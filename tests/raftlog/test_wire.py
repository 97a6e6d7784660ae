"""The authenticated Raft wire: layouts (golden bytes), handshake, frames, restricted
unpickling at every point pysyncobj unpickles, and the connection over real sockets."""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import pickle
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pysyncobj.journal as pso_journal
import pysyncobj.pickle as pso_pickle
import pysyncobj.serializer as pso_serializer
import pysyncobj.syncobj as pso_syncobj
import pytest
from pysyncobj.node import TCPNode
from pysyncobj.poller import createPoller
from pysyncobj.tcp_connection import CONNECTION_STATE

from chronomq.raftlog import safepickle, transport, wireproto
from chronomq.raftlog.config import RaftConfig, RaftPeer
from chronomq.raftlog.machine import ReplicatedLog
from chronomq.raftlog.store import Store
from chronomq.raftlog.wire import (
    AuthConnection,
    HandshakeGate,
    RefusalLog,
    WireContext,
    WireSettings,
)
from chronomq.raftlog.wireproto import (
    FrameRefused,
    Handshake,
    HandshakeRefused,
    Hello,
    Role,
    Session,
    VersionMismatch,
    encode_frame,
)

from ._util import free_port

SECRET = b"correct horse battery"
NI = bytes(range(32))
NA = bytes(range(32, 64))
LIMIT = 16 << 20


class Evil:
    """A pickle that runs a shell command when loaded by an unrestricted unpickler."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture
def evil(tmp_path: Path) -> Iterator[tuple[bytes, Path]]:
    """A protocol-2 pickle (as pysyncobj writes them) that would create ``marker``."""
    marker = tmp_path / "pwned"
    yield pickle.dumps(Evil(marker), 2), marker
    assert not marker.exists(), "the payload ran"


# ------------------------------------------------------------------ golden bytes


def test_hello_golden_bytes_both_ways() -> None:
    golden = bytes.fromhex(
        "434d5152020100050001020304050607"
        "08090a0b0c0d0e0f1011121314151617"
        "18191a1b1c1d1e1f" + b"0.2.0".hex()
    )
    hello = Hello(Role.INITIATOR, NI, about="0.2.0")
    assert hello.encode() == golden
    assert Hello.decode(golden) == hello
    assert Hello.length(golden[:40]) == len(golden) == wireproto.HELLO_BYTES + 5
    assert Hello.length(golden[:39]) is None


def test_a_version_1_hello_decodes_with_no_about() -> None:
    """What builds before the version exchange send: 40 bytes, version 1, zero length."""
    v1 = bytes.fromhex("434d515201010000") + NI
    assert Hello.length(v1) == 40
    assert Hello.decode(v1) == Hello(Role.INITIATOR, NI, 1, "")


@pytest.mark.parametrize(
    ("mutate", "why"),
    [
        (lambda b: b"XMQR" + b[4:], "not a chronomq Raft hello"),
        (lambda b: b[:5] + b"\x07" + b[6:], "malformed hello"),
        (lambda b: b[:6] + b"\x00\x01" + b[8:], "malformed hello"),
        (lambda b: b[:-1] + b"\x07", "not printable ASCII"),
        (lambda b: b[:39], "hello must be 40 bytes"),
    ],
)
def test_a_corrupted_hello_is_refused(mutate: Callable[[bytes], bytes], why: str) -> None:
    with pytest.raises(HandshakeRefused, match=why):
        Hello.decode(mutate(Hello(Role.INITIATOR, NI, about="0.2.0").encode()))


def test_a_peer_of_another_wire_version_is_refused_naming_both_versions() -> None:
    new = Handshake(SECRET, Role.ACCEPTOR, NA, LIMIT, about="0.3.0", version=3)
    with pytest.raises(VersionMismatch) as err:
        new.on_hello(Hello(Role.INITIATOR, NI, 2, "0.2.0").encode())
    text = str(err.value)
    assert "chronomq 0.2.0 with Raft wire version 2" in text
    assert "chronomq 0.3.0 with wire version 3" in text
    v1 = bytes.fromhex("434d515201010000") + NI
    with pytest.raises(
        VersionMismatch, match="before the version exchange with Raft wire version 1"
    ):
        Handshake(SECRET, Role.ACCEPTOR, NA, LIMIT, about="0.2.0").on_hello(v1)


def test_proof_and_keys_golden_bytes_follow_the_documented_layout() -> None:
    p = wireproto.proof(SECRET, Role.INITIATOR, NI, NA, b"0.2.0")
    assert p.hex() == "8f71e21ac52179fc5fea9887ea0654b7939444237c7172879ccc9302b3000743"
    assert p == hmac.digest(
        SECRET, b"chronomq-raft-proof-v2\x01" + NI + NA + b"0.2.0", hashlib.sha256
    )
    ki = wireproto.session_key(SECRET, Role.INITIATOR, NI, NA)
    ka = wireproto.session_key(SECRET, Role.ACCEPTOR, NI, NA)
    assert ki.hex() == "d7f4b424fb30ff39620a756e4be1d1e0dd6540413255fb7823faa0fdbf316c7e"
    assert ka.hex() == "01a64bcd568ed66c5b20cf01a85a3595b60c890b7f24f2059e6c2aa726c9f0b1"
    assert ka == hmac.digest(SECRET, b"chronomq-raft-key-v1\x02" + NI + NA, hashlib.sha256)


def test_a_proof_binds_the_about_a_peer_sent() -> None:
    """A hello whose about was changed on the way fails the proof."""
    ini = Handshake(SECRET, Role.INITIATOR, NI, LIMIT, about="0.2.0")
    acc = Handshake(SECRET, Role.ACCEPTOR, NA, LIMIT, about="0.2.0")
    forged = Hello(Role.INITIATOR, NI, about="9.9.9").encode()
    acc.on_hello(forged)
    proof_i = ini.on_hello(acc.hello())
    with pytest.raises(HandshakeRefused, match="cluster secret"):
        acc.on_proof(proof_i)


def test_frame_golden_bytes_both_ways() -> None:
    ki = wireproto.session_key(SECRET, Role.INITIATOR, NI, NA)
    ka = wireproto.session_key(SECRET, Role.ACCEPTOR, NI, NA)
    sender, receiver = Session(ki, ka, LIMIT), Session(ka, ki, LIMIT)
    frame0 = encode_frame(sender, b"hello")
    frame1 = encode_frame(sender, b"hello")
    assert frame0.hex() == (
        "00000005"
        "00"
        "a1d234df535df5fd8fd8e0b71e8685542f40c4764623c0e3516d8d0ae72e483f" + b"hello".hex()
    )
    assert frame1.hex() == (
        "00000005"
        "00"
        "db191880c7734340b31807a5d62802356200d365657b4f541f13740c35afa120" + b"hello".hex()
    )
    mac0 = hmac.digest(ki, (0).to_bytes(8, "big") + b"\x00" + b"hello", hashlib.sha256)
    assert frame0[5:37] == mac0
    buf = bytearray(frame0 + frame1)
    assert receiver.open(buf) == (0, b"hello")
    assert receiver.open(buf) == (0, b"hello")
    assert buf == b""


# ------------------------------------------------------------------ handshake core


def _handshake(secret_i: bytes, secret_a: bytes) -> tuple[Session | Exception, Session | Exception]:
    """Run the two sides' handshakes against each other: each side's Session or error."""
    ini = Handshake(secret_i, Role.INITIATOR, os.urandom(32), LIMIT)
    acc = Handshake(secret_a, Role.ACCEPTOR, os.urandom(32), LIMIT)
    proof_i = ini.on_hello(acc.hello())
    proof_a = acc.on_hello(ini.hello())
    results: list[Session | Exception] = []
    for side, peer_proof in ((ini, proof_a), (acc, proof_i)):
        try:
            results.append(side.on_proof(peer_proof))
        except HandshakeRefused as exc:
            results.append(exc)
    return results[0], results[1]


def test_handshake_with_the_same_secret_gives_matching_sessions() -> None:
    si, sa = _handshake(SECRET, SECRET)
    assert isinstance(si, Session) and isinstance(sa, Session)
    buf = bytearray(encode_frame(si, b"to acceptor"))
    assert sa.open(buf) == (0, b"to acceptor")
    buf = bytearray(encode_frame(sa, b"to initiator"))
    assert si.open(buf) == (0, b"to initiator")


def test_a_wrong_secret_is_refused_by_both_sides() -> None:
    si, sa = _handshake(SECRET, b"another secret entirely")
    assert isinstance(si, HandshakeRefused) and "cluster secret" in str(si)
    assert isinstance(sa, HandshakeRefused) and "cluster secret" in str(sa)


def test_a_reflected_hello_or_proof_is_refused() -> None:
    side = Handshake(SECRET, Role.ACCEPTOR, NA, LIMIT)
    with pytest.raises(HandshakeRefused, match="acceptor too"):
        side.on_hello(side.hello())
    side = Handshake(SECRET, Role.ACCEPTOR, NA, LIMIT)
    own_proof = side.on_hello(Hello(Role.INITIATOR, NI).encode())
    with pytest.raises(HandshakeRefused, match="cluster secret"):
        side.on_proof(own_proof)


def test_a_recorded_proof_does_not_pass_a_fresh_handshake() -> None:
    old = Handshake(SECRET, Role.INITIATOR, NI, LIMIT)
    recorded = old.on_hello(Hello(Role.ACCEPTOR, NA).encode())
    fresh = Handshake(SECRET, Role.ACCEPTOR, os.urandom(32), LIMIT)
    fresh.on_hello(Hello(Role.INITIATOR, NI).encode())  # the attacker replays NI too
    with pytest.raises(HandshakeRefused):
        fresh.on_proof(recorded)


# ------------------------------------------------------------------ frames


def _sessions() -> tuple[Session, Session]:
    si, sa = _handshake(SECRET, SECRET)
    assert isinstance(si, Session) and isinstance(sa, Session)
    return si, sa


def test_a_tampered_frame_is_refused() -> None:
    si, sa = _sessions()
    frame = bytearray(encode_frame(si, b"append entries"))
    frame[-1] ^= 0x01
    with pytest.raises(FrameRefused, match="bad MAC"):
        sa.open(frame)
    frame = bytearray(encode_frame(si, b"x"))
    frame[4] = wireproto.FLAG_ZLIB  # flags are under the MAC too
    with pytest.raises(FrameRefused, match="bad MAC"):
        sa.open(frame)


def test_replayed_reordered_and_foreign_frames_are_refused() -> None:
    si, sa = _sessions()
    f0, f1 = encode_frame(si, b"zero"), encode_frame(si, b"one")
    assert sa.open(bytearray(f0)) == (0, b"zero")
    with pytest.raises(FrameRefused):
        sa.open(bytearray(f0))  # replayed
    si, sa = _sessions()
    f0, f1 = encode_frame(si, b"zero"), encode_frame(si, b"one")
    with pytest.raises(FrameRefused):
        sa.open(bytearray(f1))  # before frame 0
    other_i, _ = _sessions()
    _, sa = _sessions()
    with pytest.raises(FrameRefused):
        sa.open(bytearray(encode_frame(other_i, b"zero")))  # from another connection
    si, _ = _sessions()
    with pytest.raises(FrameRefused):
        si.open(bytearray(encode_frame(si, b"zero")))  # reflected to its sender


def test_a_frame_above_the_limit_is_refused_from_its_header() -> None:
    si, sa = _sessions()
    sa.max_payload_bytes = 1000
    frame = encode_frame(si, b"x" * 1001)
    with pytest.raises(FrameRefused, match="above the limit of 1000"):
        sa.open(bytearray(frame[: wireproto.FRAME_HEADER_BYTES]))
    with pytest.raises(ValueError, match="exceeds the limit"):
        sa.seal(b"x" * 1001)


def test_a_large_frame_in_small_reads_is_assembled_in_place_and_checked_once() -> None:
    si, sa = _sessions()
    payload = os.urandom(12 << 20)
    frame = encode_frame(si, payload) + encode_frame(si, b"next")
    buf = bytearray()
    buffer_id = id(buf)
    got: list[tuple[int, bytes]] = []
    for pos in range(0, len(frame), 64 * 1024):
        buf += frame[pos : pos + 64 * 1024]
        while (item := sa.open(buf)) is not None:
            got.append(item)
    assert [p for _, p in got] == [payload, b"next"]
    assert id(buf) == buffer_id and buf == b""
    assert sa.macs_checked == 2  # not once per read


def test_payloads_round_trip_and_compressed_payloads_are_bounded() -> None:
    message = {"type": "append_entries", "entries": [(b"\x00\xff" * 10, 7, 3)], "term": 3}
    for level in (0, 6):
        flags, payload = wireproto.encode_payload(message, level)
        assert wireproto.decode_payload(flags, payload, LIMIT) == message
    flags, bomb = wireproto.encode_payload(b"\0" * (1 << 20), 9)
    with pytest.raises(FrameRefused, match="inflates beyond"):
        wireproto.decode_payload(flags, bomb, 1000)


# ------------------------------------------------------------------ restricted unpickling


def test_the_wire_unpickler_admits_no_global(evil: tuple[bytes, Path]) -> None:
    payload, _ = evil
    with pytest.raises(safepickle.ForbiddenGlobal, match="posix.system|os.system"):
        safepickle.loads(payload)
    with pytest.raises(FrameRefused, match="refused to unpickle"):
        wireproto.decode_payload(0, payload, LIMIT)
    with pytest.raises(FrameRefused):
        wireproto.decode_payload(0, pickle.dumps(TCPNode("127.0.0.1:1"), 5), LIMIT)


def test_the_log_unpickler_admits_what_pysyncobj_writes_and_no_more(
    evil: tuple[bytes, Path],
) -> None:
    node = TCPNode("127.0.0.1:9001")
    membership = safepickle.loads_log(pso_pickle.dumps(["add", node.id, node]))
    assert membership[:2] == ["add", "127.0.0.1:9001"]
    assert membership[2] == node and membership[2].port == 9001
    assert safepickle.loads_log(pso_pickle.dumps((3, (b"", b"\x00\xff")))) == (
        3,
        (b"", b"\x00\xff"),
    )
    with pytest.raises(safepickle.ForbiddenGlobal):
        safepickle.loads_log(evil[0])
    encode_other = (
        b"\x80\x02c_codecs\nencode\nq\x00X\x01\x00\x00\x00aX\x03\x00\x00\x00hexq\x01\x86R."
    )
    with pytest.raises(safepickle.ForbiddenGlobal, match="latin1"):
        safepickle.loads_log(encode_other)
    huge_bytes = b"\x80\x02c__builtin__\nbytes\nJ\x00\x00\x00\x40\x85R."  # bytes(2**30)
    with pytest.raises(TypeError):
        safepickle.loads_log(huge_bytes)


def test_pysyncobj_unpickles_through_the_allowlist_after_install(
    tmp_path: Path, evil: tuple[bytes, Path]
) -> None:
    transport.install()
    payload, _ = evil
    with pytest.raises(safepickle.ForbiddenGlobal):
        pso_syncobj.pickle.loads(payload)
    (tmp_path / "dump").write_bytes(payload)
    with (tmp_path / "dump").open("rb") as f, pytest.raises(safepickle.ForbiddenGlobal):
        pso_serializer.pickle.load(f)
    meta = tmp_path / "journal.meta"
    meta.write_bytes(payload)
    # The journal's meta reader swallows errors: an empty meta, and nothing ran.
    assert pso_journal.MetaStorer(str(meta)).getMeta() == {}


@pytest.fixture
def machine(tmp_path: Path) -> Iterator[ReplicatedLog]:
    """A follower of a group whose peers do not run, ticked by nobody."""
    peers = tuple(
        RaftPeer(f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}") for _ in range(2)
    )
    cfg = RaftConfig(
        data_dir=str(tmp_path / "node"),
        raft_address=f"127.0.0.1:{free_port()}",
        fetch_address=f"127.0.0.1:{free_port()}",
        peers=peers,
        cluster_secret=SECRET,
    )
    store = Store(tmp_path / "node" / "store", segment_bytes=1 << 20)
    m = ReplicatedLog(cfg, store, auto_tick=False)
    yield m
    m.destroy()
    store.close()


@pytest.mark.parametrize("command_type", [0, 2, 3])  # regular, membership, version
def test_a_command_from_the_log_cannot_run_code(
    machine: ReplicatedLog, command_type: int, evil: tuple[bytes, Path]
) -> None:
    with pytest.raises(safepickle.ForbiddenGlobal):
        machine._SyncObj__doApplyCommand(bytes([command_type]) + evil[0])  # type: ignore[attr-defined]


def test_a_large_entry_sent_as_a_transmission_cannot_run_code(
    machine: ReplicatedLog, evil: tuple[bytes, Path]
) -> None:
    payload, _ = evil
    leader = next(iter(machine.otherNodes))
    base = {
        "type": "append_entries",
        "term": 1,
        "commit_index": 0,
        "prevLogIdx": 1,
        "prevLogTerm": 0,
    }
    on_message = machine._SyncObj__onMessageReceived  # type: ignore[attr-defined]
    on_message(leader, {**base, "transmission": "start", "data": payload[:10]})
    with pytest.raises(safepickle.ForbiddenGlobal):
        on_message(leader, {**base, "transmission": "finish", "data": payload[10:]})


def test_the_transport_registers_no_admin_command_and_binds_raft_host(
    machine: ReplicatedLog,
) -> None:
    tr = machine._SyncObj__transport  # type: ignore[attr-defined]
    assert isinstance(tr, transport.GuardedTransport)
    assert tr._onUtilityMessageCallbacks == {}
    assert tr._server._TcpServer__host == "127.0.0.1"


class _FakeConn:
    def __init__(self) -> None:
        self.refused: list[str] = []
        self.state = CONNECTION_STATE.CONNECTED

    def refuse(self, reason: str) -> None:
        self.refused.append(reason)


@pytest.mark.parametrize(
    ("first", "why"),
    [
        (["remove", "127.0.0.1:1"], "admin command 'remove'"),
        (["status"], "admin command 'status'"),
        ("readonly", "read-only client"),
        ("127.0.0.1:1", "names no member"),
        ({"type": "request_vote"}, "names no member"),
    ],
)
def test_an_authenticated_peer_that_is_no_member_is_refused(
    machine: ReplicatedLog, first: Any, why: str
) -> None:
    tr = machine._SyncObj__transport  # type: ignore[attr-defined]
    conn = _FakeConn()
    tr._unknownConnections.add(conn)
    tr._onIncomingMessageReceived(conn, first)
    assert len(conn.refused) == 1 and why in conn.refused[0]
    assert conn not in tr._unknownConnections
    assert not tr._readonlyNodes and len(machine.otherNodes) == 2


# ------------------------------------------------------------------ gate and refusal log


def test_the_gate_expires_handshakes_and_caps_accepted_ones() -> None:
    gate: HandshakeGate[str] = HandshakeGate(timeout_s=5.0, max_accepted=2)
    assert gate.admit("a", now=100.0) and gate.admit("b", now=101.0)
    assert not gate.admit("c", now=101.0)
    gate.track("out", now=102.0)  # outgoing ones are not capped
    assert gate.expired(104.9) == []
    assert gate.expired(105.0) == ["a"]
    gate.done("a")
    assert gate.admit("c", now=105.0)
    assert sorted(gate.expired(200.0)) == ["b", "c", "out"]


def test_refusals_are_logged_at_most_burst_per_window(caplog: pytest.LogCaptureFixture) -> None:
    refusals = RefusalLog(logging.getLogger("test.refusals"), burst=3, window_s=60.0)
    with caplog.at_level(logging.WARNING, "test.refusals"):
        logged = [
            refusals.refuse(f"from 10.0.0.{i}:1", "bad proof", now=10.0 + i) for i in range(10)
        ]
        assert logged == [True] * 3 + [False] * 7
        refusals.flush(now=30.0)
        assert len(caplog.records) == 3
        refusals.flush(now=71.0)
    lines = [r.getMessage() for r in caplog.records]
    assert "from 10.0.0.0:1: bad proof" in lines[0]
    assert "refused 7 more Raft connections" in lines[-1]
    assert refusals.total == 10


# ------------------------------------------------------------------ the connection on sockets


class Harness:
    """Connections on one poller over loopback, driven by the test."""

    def __init__(self, **settings: Any) -> None:
        self.poller = createPoller("auto")
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.settings = settings
        self.messages: dict[str, list[Any]] = {"client": [], "server": []}
        self.events: list[str] = []

    def context(self, secret: bytes, **overrides: Any) -> WireContext:
        settings = {"max_payload_bytes": LIMIT, **self.settings, **overrides}
        return WireContext(WireSettings(secret, **settings))

    def client(self, ctx: WireContext) -> AuthConnection:
        conn = AuthConnection(
            self.poller,
            onConnected=lambda: self.events.append("client connected"),
            onMessageReceived=self.messages["client"].append,
            onDisconnected=lambda: self.events.append("client disconnected"),
            sendBufferSize=2**16,  # pysyncobj's default (at 8 KiB loopback crawls on ACKs)
            recvBufferSize=2**16,
            context=ctx,
        )
        assert conn.connect("127.0.0.1", self.port)
        return conn

    def accept(self, ctx: WireContext) -> AuthConnection:
        sock, _ = self.listener.accept()
        sock.setblocking(False)
        conn = AuthConnection(self.poller, socket=sock, context=ctx)
        conn.setOnMessageReceivedCallback(self.messages["server"].append)
        conn.setOnDisconnectedCallback(lambda: self.events.append("server disconnected"))
        return conn

    def run_until(self, done: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not done():
            assert time.monotonic() < deadline, f"no {what} within {timeout_s} s"
            self.poller.poll(0.01)

    def close(self) -> None:
        self.listener.close()


@pytest.fixture
def harness() -> Iterator[Harness]:
    h = Harness()
    yield h
    h.close()


def test_connections_handshake_then_exchange_messages_queued_before(harness: Harness) -> None:
    client_ctx, server_ctx = harness.context(SECRET), harness.context(SECRET)
    client = harness.client(client_ctx)
    server = harness.accept(server_ctx)
    client.send("127.0.0.1:9001")  # before the handshake: queued
    server.send({"type": "early"})
    assert client.state == CONNECTION_STATE.CONNECTING and server.session is None
    harness.run_until(lambda: "client connected" in harness.events, "handshake")
    assert client.state == CONNECTION_STATE.CONNECTED
    client.send({"type": "append_entries", "entries": [(b"\x00cmd", 2, 1)]})
    harness.run_until(lambda: len(harness.messages["server"]) == 2, "client's messages")
    harness.run_until(lambda: len(harness.messages["client"]) == 1, "server's message")
    assert harness.messages["server"] == [
        "127.0.0.1:9001",
        {"type": "append_entries", "entries": [(b"\x00cmd", 2, 1)]},
    ]
    assert harness.messages["client"] == [{"type": "early"}]
    assert len(client_ctx.gate) == len(server_ctx.gate) == 0


def test_a_large_message_arrives_whole_in_one_buffer(harness: Harness) -> None:
    client = harness.client(harness.context(SECRET))
    server = harness.accept(harness.context(SECRET))
    harness.run_until(lambda: "client connected" in harness.events, "handshake")
    entry = os.urandom(8 << 20)
    buffer_id = id(server._in)
    client.send({"type": "append_entries", "entries": [(entry, 5, 1)]})
    client.send({"type": "after"})
    harness.run_until(lambda: len(harness.messages["server"]) == 2, "the large message")
    assert harness.messages["server"][0]["entries"][0][0] == entry
    assert id(server._in) == buffer_id
    assert server.session is not None and server.session.macs_checked == 2


@pytest.mark.parametrize("wrong", ["client", "server"])
def test_a_wrong_secret_closes_the_connection_and_is_logged(
    harness: Harness, wrong: str, caplog: pytest.LogCaptureFixture
) -> None:
    other = b"not the cluster secret"
    client = harness.client(harness.context(other if wrong == "client" else SECRET))
    server = harness.accept(harness.context(other if wrong == "server" else SECRET))
    client.send("127.0.0.1:9001")
    with caplog.at_level(logging.WARNING, "chronomq.raftlog.wire"):
        harness.run_until(
            lambda: client.state == server.state == CONNECTION_STATE.DISCONNECTED, "refusal"
        )
    assert "client connected" not in harness.events
    assert harness.messages == {"client": [], "server": []}
    refusals = [r.getMessage() for r in caplog.records]
    # Each side sends its proof before judging the other's: both see why.
    assert any("from 127.0.0.1:" in m and "cluster secret" in m for m in refusals), refusals
    assert any("to 127.0.0.1:" in m and "cluster secret" in m for m in refusals), refusals


def test_peers_of_another_wire_version_say_so_at_error_with_both_versions(
    harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    client_ctx = harness.context(SECRET, about="0.2.0")
    server_ctx = harness.context(SECRET, about="0.3.0", wire_version=wireproto.VERSION + 1)
    client = harness.client(client_ctx)
    server = harness.accept(server_ctx)
    with caplog.at_level(logging.WARNING, "chronomq.raftlog.wire"):
        harness.run_until(
            lambda: client.state == server.state == CONNECTION_STATE.DISCONNECTED, "refusal"
        )
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 2, errors  # each side, once
    for line in errors:
        assert "chronomq 0.2.0 with" in line and f"wire version {wireproto.VERSION}" in line
        assert "chronomq 0.3.0 with" in line and f"wire version {wireproto.VERSION + 1}" in line
    address = f"127.0.0.1:{harness.port}"
    assert client_ctx.versions.peers[address].as_json() == {
        "version": "0.3.0",
        "wire_version": wireproto.VERSION + 1,
        "compatible": False,
    }
    # A reconnect says it again only after the window.
    caplog.clear()
    again = harness.client(client_ctx)
    harness.accept(server_ctx)
    with caplog.at_level(logging.WARNING, "chronomq.raftlog.wire"):
        harness.run_until(lambda: again.state == CONNECTION_STATE.DISCONNECTED, "refusal")
    assert not [r for r in caplog.records if "to 127.0.0.1" in r.getMessage()]


def test_a_compatible_peer_is_recorded_with_its_version(harness: Harness) -> None:
    client_ctx = harness.context(SECRET, about="0.2.0")
    client = harness.client(client_ctx)
    harness.accept(harness.context(SECRET, about="0.2.1"))
    harness.run_until(lambda: "client connected" in harness.events, "handshake")
    assert client.peer_hello is not None and client.peer_hello.about == "0.2.1"
    peer = client_ctx.versions.peers[f"127.0.0.1:{harness.port}"]
    assert peer.compatible and peer.version == "0.2.1"


def test_pysyncobj_wire_bytes_are_refused_before_unpickling(
    harness: Harness, evil: tuple[bytes, Path], caplog: pytest.LogCaptureFixture
) -> None:
    import struct
    import zlib

    ctx = harness.context(SECRET)
    raw = socket.create_connection(("127.0.0.1", harness.port))
    server = harness.accept(ctx)
    data = zlib.compress(evil[0])
    raw.sendall(struct.pack("i", len(data)) + data)
    with caplog.at_level(logging.WARNING, "chronomq.raftlog.wire"):
        harness.run_until(lambda: server.state == CONNECTION_STATE.DISCONNECTED, "refusal")
    raw.close()
    assert any("not a chronomq Raft hello" in r.getMessage() for r in caplog.records)


def test_a_silent_connection_is_closed_at_its_deadline_and_accepts_are_capped(
    harness: Harness,
) -> None:
    ctx = harness.context(SECRET, handshake_timeout_s=3.0, max_handshakes=2)
    raws = [socket.create_connection(("127.0.0.1", harness.port)) for _ in range(3)]
    first, second = harness.accept(ctx), harness.accept(ctx)
    third = harness.accept(ctx)  # over the cap: closed at once
    assert third.state == CONNECTION_STATE.DISCONNECTED
    assert first.state == second.state == CONNECTION_STATE.CONNECTED
    ctx.sweep(time.monotonic() + 2.0)
    assert first.state == CONNECTION_STATE.CONNECTED
    ctx.sweep(time.monotonic() + 3.1)  # what the tick does once the deadline passed
    assert first.state == second.state == CONNECTION_STATE.DISCONNECTED
    assert len(ctx.gate) == 0 and ctx.refusals.total == 3
    for raw in raws:
        raw.close()
