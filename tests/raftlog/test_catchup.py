"""The catch-up side channel: authenticated, bounded CommitLog byte ranges over loopback TCP."""

from __future__ import annotations

import hashlib
import hmac
import logging
import pickle
import socket
import struct
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from chronomq.raftlog import catchup_proto as proto
from chronomq.raftlog import record
from chronomq.raftlog.catchup import (
    DEFAULT_LIMITS,
    Backoff,
    CatchupServer,
    FetchFailed,
    Limits,
    _RefusalLog,
    fetch_bytes,
    fetch_from,
    fetch_range,
)
from chronomq.raftlog.chain import Chain, RangeCheck
from chronomq.raftlog.commitlog import CommitLog
from chronomq.raftlog.snapshot import FetchTarget

from ._util import commitlog_bytes, free_port, rec, wait_until

SEG = 64 * 1024
SECRET = b"correct horse battery staple"
WRONG = b"incorrect horse battery staple"

LogFactory = Callable[..., CommitLog]
ServerFactory = Callable[..., CatchupServer]


@pytest.fixture
def logs(tmp_path: Path) -> Iterator[LogFactory]:
    opened: list[CommitLog] = []

    def make(name: str, segment_bytes: int = SEG) -> CommitLog:
        cl = CommitLog(tmp_path / name, segment_bytes=segment_bytes, flush="async")
        opened.append(cl)
        return cl

    yield make
    for cl in opened:
        cl.close()


@pytest.fixture
def servers() -> Iterator[ServerFactory]:
    started: list[CatchupServer] = []

    def serve(
        cl: CommitLog,
        available: Callable[[], int] | None = None,
        *,
        secret: bytes = SECRET,
        limits: Limits = DEFAULT_LIMITS,
    ) -> CatchupServer:
        srv = CatchupServer(
            "127.0.0.1", 0, cl, available or (lambda: cl.length), secret=secret, limits=limits
        )
        srv.start()
        started.append(srv)
        return srv

    yield serve
    for srv in started:
        srv.close()


def fill(cl: CommitLog, count: int, body_bytes: int = 700) -> None:
    for i in range(count):
        data = bytearray(rec("t", i % 3, bytes([i % 251]) * body_bytes, i))
        cl.append_records(data, [len(data)], [i])


def target_for(dst: CommitLog, src: CommitLog, end: int | None = None) -> FetchTarget:
    """Where ``dst`` fetches the rest of ``src`` (up to ``end``), checked against its chain."""
    end = src.length if end is None else end
    anchor = Chain.over([dst.read_range(0, dst.length)])
    expected = Chain.over([src.read_range(0, end)]).value()
    return FetchTarget(dst, RangeCheck(anchor, end, expected))


def no_sleep(_s: float) -> None:
    pytest.fail("no back-off expected")


# ---------------------------------------------------------------------- the messages


def test_golden_bytes_both_ways() -> None:
    key = proto.derive_key(SECRET)
    cn, sn = bytes(range(16)), bytes(range(16, 32))
    session = proto.Session(key, cn, sn)
    req = proto.FetchRequest(4096, 1 << 20)
    hello = bytes.fromhex("434d5148454c4f31000102030405060708090a0b0c0d0e0f")
    challenge = bytes.fromhex("434d514348414c31101112131415161718191a1b1c1d1e1f")
    request = bytes.fromhex(
        "434d514654434831" "0000000000001000" "0000000000100000"
        "2d15d5b613c5a0cf5bb83b39a79e687fd7d94705642c747cb3f7b5d9324e1e50"
    )  # fmt: skip
    response = bytes.fromhex(
        "434d514259544531" "00" "00000000000003e8"
        "f32720a0caad4ebb1a504e46121e4dc0b592174d0850588bcf87df3c3bff13a9"
    )  # fmt: skip
    assert proto.encode_hello(cn) == hello and proto.decode_hello(hello) == cn
    assert proto.encode_challenge(sn) == challenge and proto.decode_challenge(challenge) == sn
    assert session.encode_request(req) == request
    assert session.decode_request(request) == req
    answer = proto.Answer(proto.Status.OK, 1000)
    assert session.encode_response(req, answer) == response
    assert session.decode_response(response, req) == answer
    # The MACs are what the module's docstring says.
    k = hmac.new(SECRET, b"chronomq catch-up v1", hashlib.sha256).digest()
    mac = hmac.new(
        k, b"CMQ catch-up request\x00" + cn + sn + struct.pack(">QQ", 4096, 1 << 20), "sha256"
    ).digest()
    assert request[24:] == mac
    mac = hmac.new(
        k,
        b"CMQ catch-up response\x00" + cn + sn + struct.pack(">QQBQ", 4096, 1 << 20, 0, 1000),
        "sha256",
    ).digest()
    assert response[17:] == mac
    assert len(request) == proto.REQUEST_SIZE == 56
    assert len(response) == proto.RESPONSE_SIZE == 49


def test_a_changed_byte_or_another_key_fails_the_mac() -> None:
    cn, sn = bytes(16), bytes(range(16))
    ours = proto.Session(proto.derive_key(SECRET), cn, sn)
    theirs = proto.Session(proto.derive_key(WRONG), cn, sn)
    req = proto.FetchRequest(0, 100)
    request = ours.encode_request(req)
    with pytest.raises(proto.AuthFailed):
        theirs.decode_request(request)
    for at in (8, 15, 23, 24, 55):  # start, end and MAC bytes
        bad = bytearray(request)
        bad[at] ^= 1
        with pytest.raises(proto.AuthFailed):
            ours.decode_request(bytes(bad))
    # Other nonces (a replayed request on a new connection) fail too.
    with pytest.raises(proto.AuthFailed):
        proto.Session(ours.key, cn, bytes(16)).decode_request(request)
    response = ours.encode_response(req, proto.Answer(proto.Status.OK, 100))
    for at in (8, 16, 17, 48):
        bad = bytearray(response)
        bad[at] ^= 1
        with pytest.raises(proto.CatchupError):
            ours.decode_response(bytes(bad), req)
    # The answer is bound to the request it answers.
    with pytest.raises(proto.AuthFailed):
        ours.decode_response(response, proto.FetchRequest(0, 101))


def test_no_reflection_a_request_mac_is_not_a_response_mac() -> None:
    """The roles sign under different labels: what a client sent never passes as a server's
    answer, whatever the fields line up to."""
    s = proto.Session(proto.derive_key(SECRET), bytes(16), bytes(16))
    req = proto.FetchRequest(0, 0)
    mac = s.encode_request(req)[24:]
    forged = struct.pack(">8sBQ32s", proto.RESPONSE_MAGIC, 0, 0, mac)
    with pytest.raises(proto.AuthFailed):
        s.decode_response(forged, req)


def test_malformed_messages_are_protocol_errors() -> None:
    s = proto.Session(proto.derive_key(SECRET), bytes(16), bytes(16))
    with pytest.raises(proto.ProtocolError):
        proto.decode_hello(b"CMQFETCH" + bytes(16))
    with pytest.raises(proto.Refused):
        proto.decode_challenge(proto.DENIED + bytes(16))
    with pytest.raises(proto.ProtocolError):
        s.decode_request(struct.pack(">8sQQ32s", b"CMQFETCH", 0, 1, bytes(32)))
    req = proto.FetchRequest(0, 10)
    overlong = s.encode_response(req, proto.Answer(proto.Status.OK, 11))
    with pytest.raises(proto.ProtocolError, match="offers 11 bytes"):
        s.decode_response(overlong, req)


# ---------------------------------------------------------------------- serving


def test_fetch_range_copies_the_commitlog(logs: LogFactory, servers: ServerFactory) -> None:
    src, dst = logs("src"), logs("dst")
    fill(src, 400)
    assert src.length > 3 * SEG
    srv = servers(src)
    assert srv.address[0] == "127.0.0.1" and srv.address[1] > 0
    target = target_for(dst, src)
    fetch_range(lambda: [srv.address], target, secret=SECRET, sleep=no_sleep)
    assert target.verdict() is None
    assert commitlog_bytes(dst.directory) == commitlog_bytes(src.directory)
    assert [at for at, _ in dst.iter_records(0)] == [at for at, _ in src.iter_records(0)]


def test_fetch_the_rest_after_a_local_prefix(logs: LogFactory, servers: ServerFactory) -> None:
    src, dst = logs("src"), logs("dst")
    fill(src, 200)
    srv = servers(src)
    half = next(at for at, _ in src.iter_records(src.length // 2))
    dst.write_raw(0, src.read_range(0, half))
    fetch_range(lambda: [srv.address], target_for(dst, src), secret=SECRET, sleep=no_sleep)
    assert commitlog_bytes(dst.directory) == commitlog_bytes(src.directory)


def test_a_peer_with_fewer_bytes_serves_what_it_has(
    logs: LogFactory, servers: ServerFactory
) -> None:
    full, dst = logs("full"), logs("dst")
    fill(full, 300)
    behind_len = next(at for at, _ in full.iter_records(full.length // 3))
    behind = servers(full, lambda: behind_len)  # has applied only a third
    ahead = servers(full)
    got = fetch_bytes(behind.address, 0, full.length, secret=SECRET)
    assert got == full.read_range(0, behind_len)
    # Asked of the peer that is behind first, the client takes the rest from the other.
    target = target_for(dst, full)
    fetch_range(lambda: [behind.address, ahead.address], target, secret=SECRET, sleep=no_sleep)
    assert commitlog_bytes(dst.directory) == commitlog_bytes(full.directory)
    wait_until(lambda: (behind.served, ahead.served) == (2, 1), 10, "both transfers to end")


def test_a_peer_with_nothing_to_give(logs: LogFactory, servers: ServerFactory) -> None:
    src, dst = logs("src"), logs("dst")
    fill(src, 10)
    srv = servers(src, lambda: 0)
    assert fetch_from(srv.address, 0, src.length, dst.write_raw, secret=SECRET) == 0
    assert fetch_from(srv.address, src.length, src.length, dst.write_raw, secret=SECRET) == 0
    assert dst.length == 0


@pytest.mark.timeout(60)
def test_a_large_transfer_across_segments(logs: LogFactory, servers: ServerFactory) -> None:
    seg = 4 * 1024 * 1024
    src, dst = logs("src", seg), logs("dst", seg)
    body = b"L" * (256 * 1024)
    for i in range(100):
        data = bytearray(rec("t", 0, body, i))
        src.append_records(data, [len(data)], [i])
    assert src.length > 5 * seg
    srv = servers(src)
    assert fetch_from(srv.address, 0, src.length, dst.write_raw, secret=SECRET) == src.length
    assert commitlog_bytes(dst.directory) == commitlog_bytes(src.directory)
    assert sum(1 for _ in dst.iter_records(0)) == 100


def test_served_bytes_are_whole_records(logs: LogFactory, servers: ServerFactory) -> None:
    src, dst = logs("src"), logs("dst")
    fill(src, 50)
    srv = servers(src)
    fetch_from(srv.address, 0, src.length, dst.write_raw, secret=SECRET)
    assert dst.recover() == src.length
    assert all(record.decode(d).physical_offset == at for at, d in dst.iter_records(0))


def test_a_range_that_ends_before_it_starts_is_answered_bad_range(
    logs: LogFactory, servers: ServerFactory
) -> None:
    src = logs("src")
    fill(src, 5)
    srv = servers(src)
    with pytest.raises(proto.ProtocolError, match="BAD_RANGE"):
        fetch_from(srv.address, 10, 5, lambda at, data: pytest.fail("no bytes"), secret=SECRET)


# ---------------------------------------------------------------------- authentication


def _raw_exchange(address: tuple[str, int], payload: bytes) -> bytes:
    """Send ``payload`` and read everything the server sends until it closes."""
    with socket.create_connection(address, timeout=10) as sock:
        try:
            sock.sendall(payload)
            sock.shutdown(socket.SHUT_WR)
        except OSError:  # the server refused and closed first (ENOTCONN, EPIPE, ECONNRESET)
            pass
        out = b""
        try:
            while chunk := sock.recv(65536):
                out += chunk
        except ConnectionResetError:  # it closed with our bytes unread
            pass
        return out


class _Marker:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return (open, (self.path, "w"))


def test_unauthenticated_requests_get_no_commitlog_byte(
    logs: LogFactory, servers: ServerFactory, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    src = logs("src")
    fill(src, 20)
    srv = servers(src)
    marker = tmp_path / "pwned"
    blob = zlib.compress(pickle.dumps(_Marker(str(marker))))
    payloads = {
        "old request": struct.pack(">8sQQ", b"CMQFETCH", 0, src.length),
        "pickle": struct.pack(">I", len(blob)) + blob,
        "garbage": b"GET / HTTP/1.0\r\n\r\n" + bytes(64),
        "empty": b"",
    }
    with caplog.at_level(logging.WARNING, logger="chronomq.raftlog.catchup"):
        for name, payload in payloads.items():
            answer = _raw_exchange(srv.address, payload)
            assert answer in (proto.DENIED, b""), name
    # A hello followed by a request without a valid MAC: the challenge, then a refusal.
    hello = proto.encode_hello(bytes(16))
    forged = struct.pack(">8sQQ32s", proto.REQUEST_MAGIC, 0, src.length, bytes(32))
    answer = _raw_exchange(srv.address, hello + forged)
    assert answer[:8] == proto.CHALLENGE_MAGIC and answer[24:] == proto.DENIED
    assert not marker.exists()
    assert srv.served == 0 and srv.refused == len(payloads) + 1
    assert "refused catch-up connection from 127.0.0.1:" in caplog.text
    # Still serving peers.
    assert fetch_bytes(srv.address, 0, src.length, secret=SECRET) == src.read_range(0, src.length)


def test_a_client_with_the_wrong_secret_is_refused(
    logs: LogFactory, servers: ServerFactory, caplog: pytest.LogCaptureFixture
) -> None:
    src = logs("src")
    fill(src, 20)
    srv = servers(src)
    with (
        caplog.at_level(logging.WARNING, logger="chronomq.raftlog.catchup"),
        pytest.raises(proto.Refused),
    ):
        fetch_from(
            srv.address, 0, src.length, lambda at, data: pytest.fail("no bytes"), secret=WRONG
        )
    assert srv.refused == 1 and srv.served == 0
    assert "MAC does not verify" in caplog.text and "127.0.0.1" in caplog.text


def test_a_server_with_the_wrong_secret_is_not_believed(
    logs: LogFactory, servers: ServerFactory
) -> None:
    """Mutual: a rogue server (here, one that does not hold our secret) feeds no byte."""
    src = logs("src")
    fill(src, 20)
    rogue = servers(src, secret=WRONG)
    with pytest.raises(proto.CatchupError):
        fetch_from(
            rogue.address, 0, src.length, lambda at, data: pytest.fail("no bytes"), secret=SECRET
        )
    assert rogue.served == 0


def test_refusals_are_logged_at_most_once_per_interval_per_host() -> None:
    refusals = _RefusalLog(interval_s=10, max_hosts=2)
    assert refusals.note("10.0.0.1", 100.0) == 0
    assert refusals.note("10.0.0.1", 101.0) is None
    assert refusals.note("10.0.0.1", 105.0) is None
    assert refusals.note("10.0.0.2", 105.0) == 0
    assert refusals.note("10.0.0.1", 110.0) == 2  # two went unlogged
    assert refusals.note("10.0.0.3", 111.0) == 0
    assert refusals.note("10.0.0.2", 112.0) == 0  # forgotten: bounded table


# ---------------------------------------------------------------------- time and slots


class _SlowPeer:
    """A client that holds the secret, asks for everything and then reads nothing."""

    def __init__(self, address: tuple[str, int], end: int) -> None:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        self.sock.settimeout(10)
        self.sock.connect(address)
        cn = bytes(range(16))
        self.sock.sendall(proto.encode_hello(cn))
        sn = proto.decode_challenge(self._recv(proto.CHALLENGE_SIZE))
        self.session = proto.Session(proto.derive_key(SECRET), cn, sn)
        self.request = proto.FetchRequest(0, end)
        self.sock.sendall(self.session.encode_request(self.request))

    def _recv(self, n: int) -> bytes:
        out = b""
        while len(out) < n:
            chunk = self.sock.recv(n - len(out))
            assert chunk
            out += chunk
        return out

    def answer(self) -> proto.Answer:
        return self.session.decode_response(self._recv(proto.RESPONSE_SIZE), self.request)

    def cut_off(self) -> bool:
        """Whether the server closed the connection (reading what is left)."""
        self.sock.settimeout(10)
        try:
            while self.sock.recv(1 << 20):
                pass
        except ConnectionResetError:
            pass
        return True

    def close(self) -> None:
        self.sock.close()


def _big(logs: LogFactory) -> CommitLog:
    """More bytes than loopback socket buffers hold, so that a peer that stops reading blocks
    the server."""
    seg = 4 * 1024 * 1024
    src = logs("big", seg)
    body = b"B" * (256 * 1024)
    for i in range(64):
        data = bytearray(rec("t", 0, body, i))
        src.append_records(data, [len(data)], [i])
    return src


@pytest.mark.parametrize(
    "limits",
    [
        Limits(idle_s=0.3, transfer_slots=1),
        Limits(idle_s=60, total_floor_s=0.3, min_rate_bytes_per_s=1 << 40, transfer_slots=1),
    ],
    ids=["idle", "total"],
)
def test_a_peer_that_stops_reading_is_cut_off_and_frees_its_slot(
    logs: LogFactory, servers: ServerFactory, limits: Limits
) -> None:
    src = _big(logs)
    srv = servers(src, limits=limits)
    slow = _SlowPeer(srv.address, src.length)
    try:
        assert slow.answer() == proto.Answer(proto.Status.OK, src.length)
        wait_until(lambda: srv.transferring == 0, 20, "the stalled transfer to be cut off")
        assert slow.cut_off()
        got = fetch_bytes(srv.address, 0, 4096, secret=SECRET)
        assert got == src.read_range(0, 4096)
    finally:
        slow.close()


def test_a_slow_reader_does_not_block_another_client(
    logs: LogFactory, servers: ServerFactory
) -> None:
    src = _big(logs)
    srv = servers(src, limits=Limits(transfer_slots=2))
    slow = _SlowPeer(srv.address, src.length)
    try:
        assert slow.answer().count == src.length
        wait_until(lambda: srv.transferring == 1, 10, "the slow transfer to start")
        dst = logs("dst", 4 * 1024 * 1024)
        fetch_range(lambda: [srv.address], target_for(dst, src), secret=SECRET, sleep=no_sleep)
        assert dst.length == src.length
        assert srv.transferring == 1  # the slow one is still there, and did not matter
    finally:
        slow.close()


def test_with_every_transfer_slot_taken_the_answer_is_busy(
    logs: LogFactory, servers: ServerFactory
) -> None:
    src = _big(logs)
    srv = servers(src, limits=Limits(transfer_slots=1))
    slow = _SlowPeer(srv.address, src.length)
    try:
        slow.answer()
        wait_until(lambda: srv.transferring == 1, 10, "the slow transfer to start")
        with pytest.raises(proto.Busy):
            fetch_bytes(srv.address, 0, 100, secret=SECRET)
    finally:
        slow.close()


def test_a_silent_connection_is_dropped_at_the_handshake_deadline(
    logs: LogFactory, servers: ServerFactory
) -> None:
    src = logs("src")
    fill(src, 5)
    srv = servers(src, limits=Limits(handshake_s=0.3))
    with socket.create_connection(srv.address, timeout=10) as silent:
        wait_until(lambda: srv.refused == 1, 10, "the silent connection to be refused")
        assert silent.recv(100) == proto.DENIED
        assert srv.handshaking == 0


def test_unauthenticated_connections_cannot_starve_a_peer(
    logs: LogFactory, servers: ServerFactory
) -> None:
    """Every handshake slot held by connections that never speak: a peer still gets in (the
    oldest handshake makes room), and the silent ones hold no transfer slot."""
    src = logs("src")
    fill(src, 50)
    srv = servers(src, limits=Limits(handshake_s=60, handshake_slots=4, transfer_slots=1))
    silent = [socket.create_connection(srv.address, timeout=10) for _ in range(4)]
    try:
        wait_until(lambda: srv.handshaking == 4, 10, "the silent connections to be accepted")
        assert fetch_bytes(srv.address, 0, src.length, secret=SECRET) == src.read_range(
            0, src.length
        )
        assert silent[0].recv(100) in (proto.DENIED, b"")  # the oldest made room
        assert srv.handshaking <= 4
    finally:
        for s in silent:
            s.close()


# ---------------------------------------------------------------------- fetch_range


def _tampered(logs: LogFactory, src: CommitLog, name: str) -> CommitLog:
    """A copy of ``src`` with one byte of one record changed."""
    bad = logs(name)
    data = bytearray(src.read_range(0, src.length))
    data[len(data) // 2] ^= 0xFF
    bad.write_raw(0, bytes(data))
    return bad


def test_bytes_that_fail_the_chain_are_rejected_and_the_next_peer_used(
    logs: LogFactory, servers: ServerFactory, caplog: pytest.LogCaptureFixture
) -> None:
    src, dst = logs("src"), logs("dst")
    fill(src, 200)
    liar = servers(_tampered(logs, src, "liar"))
    honest = servers(src)
    target = target_for(dst, src)
    asked: list[list[tuple[str, int]]] = []

    def peers() -> list[tuple[str, int]]:
        asked.append([liar.address, honest.address])
        return asked[-1]

    with caplog.at_level(logging.WARNING, logger="chronomq.raftlog.catchup"):
        fetch_range(peers, target, secret=SECRET, sleep=no_sleep)
    assert target.verdict() is None
    assert commitlog_bytes(dst.directory) == commitlog_bytes(src.directory)
    wait_until(lambda: liar.served == honest.served == 1, 10, "both transfers to end")
    assert "rejected" in caplog.text and "fail the hash chain" in caplog.text


def test_a_liar_is_asked_last_in_the_next_round(logs: LogFactory, servers: ServerFactory) -> None:
    src, dst = logs("src"), logs("dst")
    fill(src, 100)
    liar = servers(_tampered(logs, src, "liar"))
    behind = servers(src, lambda: 0)  # has nothing yet, then everything
    rounds: list[int] = []

    def peers() -> list[tuple[str, int]]:
        rounds.append(1)
        return [liar.address, behind.address]

    sleeps: list[float] = []
    target = target_for(dst, src)

    def sleep(s: float) -> None:
        sleeps.append(s)
        behind._available = lambda: src.length  # caught up meanwhile

    fetch_range(peers, target, secret=SECRET, sleep=sleep)
    assert target.verdict() is None and len(rounds) == 2 and len(sleeps) == 1
    wait_until(lambda: behind.served == 2, 10, "both answers to end")  # nothing, then all
    assert liar.served == 1  # not asked again: the honest peer came first in round two


def test_back_off_between_rounds_then_success(logs: LogFactory, servers: ServerFactory) -> None:
    src, dst = logs("src"), logs("dst")
    fill(src, 30)
    srv = servers(src)
    dead = ("127.0.0.1", free_port())
    now = [0.0]
    sleeps: list[float] = []

    def sleep(s: float) -> None:
        sleeps.append(s)
        now[0] += s

    def peers() -> list[tuple[str, int]]:
        return [dead] if len(sleeps) < 4 else [dead, srv.address]

    target = target_for(dst, src)
    fetch_range(
        peers,
        target,
        secret=SECRET,
        deadline_s=60,
        backoff=Backoff(0.2, 1.0, rng=lambda: 1.0),
        clock=lambda: now[0],
        sleep=sleep,
    )
    assert target.verdict() is None
    assert sleeps == [0.2, 0.4, 0.8, 1.0]  # doubling, bounded


def test_back_off_has_jitter_and_a_bound() -> None:
    draws = iter([0.0, 0.5, 0.999, 0.0, 0.0, 0.0, 0.0])
    b = Backoff(1.0, 4.0, rng=lambda: next(draws))
    assert [b.next_delay() for _ in range(6)] == [0.5, 1.5, pytest.approx(3.998), 2.0, 2.0, 2.0]
    b.reset()
    assert b.next_delay() == pytest.approx(0.5)


def test_giving_up_names_the_range_and_every_peer(
    logs: LogFactory, servers: ServerFactory, caplog: pytest.LogCaptureFixture
) -> None:
    src, dst = logs("src"), logs("dst")
    fill(src, 30)
    wrong = servers(src, secret=WRONG)
    dead = ("127.0.0.1", free_port())
    now = [0.0]

    def sleep(s: float) -> None:
        now[0] += s

    target = target_for(dst, src)
    with (
        caplog.at_level(logging.ERROR, logger="chronomq.raftlog.catchup"),
        pytest.raises(FetchFailed) as failed,
    ):
        fetch_range(
            lambda: [dead, wrong.address],
            target,
            secret=SECRET,
            deadline_s=10,
            clock=lambda: now[0],
            sleep=sleep,
        )
    text = str(failed.value)
    assert f"[0, {src.length})" in text
    assert f"127.0.0.1:{dead[1]}" in text and f"127.0.0.1:{wrong.address[1]}" in text
    assert "Refused" in text and "ConnectionRefusedError" in text
    assert text in caplog.text
    assert dst.length == 0
    assert now[0] == pytest.approx(10)  # the last back-off stops at the deadline


def test_nothing_to_fetch_returns_at_once(logs: LogFactory) -> None:
    dst = logs("dst")
    target = FetchTarget(dst, RangeCheck(Chain(), 0, bytes(16)))
    fetch_range(lambda: pytest.fail("no peer needed"), target, secret=SECRET, sleep=no_sleep)
    assert target.verdict() is None
