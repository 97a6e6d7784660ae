"""The catch-up side channel: CommitLog byte ranges over loopback TCP."""

from __future__ import annotations

import socket
import struct
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from raftlog import record
from raftlog.catchup import CatchupServer, fetch_from, fetch_range
from raftlog.commitlog import CommitLog

from ._util import commitlog_bytes, free_port, rec

SEG = 64 * 1024

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

    def serve(cl: CommitLog, available: Callable[[], int] | None = None) -> CatchupServer:
        srv = CatchupServer("127.0.0.1", 0, cl, available or (lambda: cl.length))
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


def test_fetch_range_copies_the_commitlog(logs: LogFactory, servers: ServerFactory) -> None:
    src, dst = logs("src"), logs("dst")
    fill(src, 400)
    assert src.length > 3 * SEG
    srv = servers(src)
    assert srv.address[0] == "127.0.0.1" and srv.address[1] > 0
    fetch_range(lambda: [srv.address], 0, src.length, dst.write_raw, lambda: dst.length)
    assert dst.length == src.length
    assert commitlog_bytes(dst.directory) == commitlog_bytes(src.directory)
    assert [at for at, _ in dst.iter_records(0)] == [at for at, _ in src.iter_records(0)]


def test_fetch_the_rest_after_a_local_prefix(logs: LogFactory, servers: ServerFactory) -> None:
    src, dst = logs("src"), logs("dst")
    fill(src, 200)
    srv = servers(src)
    half = next(at for at, _ in src.iter_records(src.length // 2))
    dst.write_raw(0, src.read(0, min(half, SEG)))
    while dst.length < half:
        dst.write_raw(
            dst.length, src.read(dst.length, min(half - dst.length, SEG - dst.length % SEG))
        )
    fetch_range(lambda: [srv.address], dst.length, src.length, dst.write_raw, lambda: dst.length)
    assert commitlog_bytes(dst.directory) == commitlog_bytes(src.directory)


def test_a_peer_with_fewer_bytes_serves_what_it_has(
    logs: LogFactory, servers: ServerFactory
) -> None:
    full, dst = logs("full"), logs("dst")
    fill(full, 300)
    behind_len = next(at for at, _ in full.iter_records(full.length // 3))
    behind = servers(full, lambda: behind_len)  # has applied only a third
    ahead = servers(full)
    got: list[tuple[int, int]] = []

    def write(at: int, data: bytes) -> None:
        got.append((at, len(data)))
        dst.write_raw(at, data)

    assert fetch_from(behind.address, 0, full.length, write) == behind_len
    assert dst.length == behind_len
    # Asked of the peer that is behind first, the client takes the rest from the other.
    asked: list[tuple[str, int]] = []

    def peers() -> list[tuple[str, int]]:
        asked.extend([behind.address, ahead.address])
        return [behind.address, ahead.address]

    fetch_range(peers, dst.length, full.length, write, lambda: dst.length)
    assert commitlog_bytes(dst.directory) == commitlog_bytes(full.directory)
    assert asked[:2] == [behind.address, ahead.address]


def test_a_peer_with_nothing_to_give(logs: LogFactory, servers: ServerFactory) -> None:
    src, dst = logs("src"), logs("dst")
    fill(src, 10)
    srv = servers(src, lambda: 0)
    assert fetch_from(srv.address, 0, src.length, dst.write_raw) == 0
    assert fetch_from(srv.address, src.length, src.length, dst.write_raw) == 0
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
    assert fetch_from(srv.address, 0, src.length, dst.write_raw) == src.length
    assert commitlog_bytes(dst.directory) == commitlog_bytes(src.directory)
    assert sum(1 for _ in dst.iter_records(0)) == 100


def test_bad_request_is_dropped(logs: LogFactory, servers: ServerFactory) -> None:
    src = logs("src")
    fill(src, 5)
    srv = servers(src)
    for request in (
        struct.pack(">8sQQ", b"BADMAGIC", 0, 10),
        struct.pack(">8sQQ", b"CMQFETCH", 10, 5),  # end before start
    ):
        with socket.create_connection(srv.address, timeout=5) as sock:
            sock.sendall(request)
            assert sock.recv(100) == b""
    # The server still serves good requests afterwards.
    dst = logs("dst")
    assert fetch_from(srv.address, 0, src.length, dst.write_raw) == src.length


def test_no_reachable_peer_times_out(logs: LogFactory) -> None:
    dst = logs("dst")
    dead = ("127.0.0.1", free_port())
    with pytest.raises(TimeoutError):
        fetch_range(lambda: [dead], 0, 100, dst.write_raw, lambda: dst.length, deadline_s=0.2)


def test_nothing_to_fetch_returns_at_once(logs: LogFactory) -> None:
    dst = logs("dst")
    fetch_range(lambda: pytest.fail("no peer needed"), 0, 0, dst.write_raw, lambda: dst.length)


def test_served_bytes_are_whole_records(logs: LogFactory, servers: ServerFactory) -> None:
    src, dst = logs("src"), logs("dst")
    fill(src, 50)
    srv = servers(src)
    fetch_from(srv.address, 0, src.length, dst.write_raw)
    assert dst.recover() == src.length
    assert all(record.decode(d).physical_offset == at for at, d in dst.iter_records(0))
