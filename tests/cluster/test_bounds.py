"""Bounded pulls and HTTP connections, in process: pages in bytes, waiters per queue, reads off
the event loop, and the connection guard's cap and deadlines against a real listening socket."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web

from chronomq.cluster.httpapi.httpconn import ConnectionGuard, GuardedSite, HttpLimits
from chronomq.cluster.node.pull import PullPage, QueueWaiters, plan_units, read_page
from chronomq.raftlog import record
from chronomq.raftlog.consumequeue import CqUnit


class FakeReader:
    """Messages of given body sizes at commitlog offsets 0, 1, 2, ..."""

    def __init__(self, sizes: list[int]) -> None:
        self.sizes = sizes
        self.reads = 0

    def read_message(self, at: int, size: int | None = None) -> record.Message:
        self.reads += 1
        data = record.encode(
            topic="t",
            queue_id=0,
            msg_id=at.to_bytes(16, "big"),
            body=b"x" * self.sizes[at],
            properties={},
            born_ms=1,
            store_ms=1,
            queue_offset=at,
        )
        return record.decode(bytes(data))

    def units(self) -> list[CqUnit]:
        return [CqUnit(i, i, size + 120, 0) for i, size in enumerate(self.sizes)]


def test_a_page_stops_before_max_bytes_and_holds_at_least_one() -> None:
    reader = FakeReader([300_000] * 10)
    limit = 1_000_000
    page = read_page(reader, plan_units(reader.units(), limit), 0, limit)
    assert len(page.messages) == 3
    answer = page.answer(10)
    assert len(answer) <= limit
    decoded = orjson.loads(answer)
    assert [m["offset"] for m in decoded["messages"]] == [0, 1, 2]
    assert decoded["next_offset"] == 3 and decoded["max_offset"] == 10
    # Only what the page can hold (plus one) is read from disk.
    assert reader.reads <= 4

    huge = FakeReader([2_000_000, 10])
    page = read_page(huge, plan_units(huge.units(), limit), 0, limit)
    assert len(page.messages) == 1 and page.next_offset == 1
    assert orjson.loads(page.answer(2))["messages"][0]["offset"] == 0


def test_an_empty_page_keeps_the_offset() -> None:
    assert PullPage((), 7).answer(7) == b'{"messages":[],"next_offset":7,"max_offset":7}\n'
    assert read_page(FakeReader([]), [], 5, 1024).next_offset == 5


async def test_waiters_are_woken_per_queue() -> None:
    ends = {("t", 0): 0, ("t", 1): 0}
    waiters = QueueWaiters(lambda t, q: ends[(t, q)])
    waiters.bind(asyncio.get_running_loop())
    a = waiters.register("t", 0, 0)
    b = waiters.register("t", 1, 0)
    assert waiters.waiting == 2 and waiters.queues == 2
    # From another thread, as the Raft thread does: only queue 1 was written.
    threading.Thread(target=waiters.applied, args=([("t", 1), ("t", 1)],)).start()
    await asyncio.wait_for(b, 5)
    assert not a.done()
    # An extension's deliveries do not name their queues: the queue whose end moved wakes.
    ends[("t", 0)] = 1
    threading.Thread(target=waiters.grown).start()
    await asyncio.wait_for(a, 5)
    waiters.release("t", 0)
    waiters.release("t", 1)
    assert waiters.waiting == 0 and waiters.queues == 0
    # Nobody waits: nothing crosses to the loop.
    waiters.applied([("t", 0)])
    assert waiters.wakes == 2


# ---------------------------------------------------------------------- the connection guard


@contextlib.asynccontextmanager
async def _serve(
    limits: HttpLimits, handler: Callable[[web.Request], Any]
) -> AsyncIterator[tuple[int, ConnectionGuard]]:
    guard = ConnectionGuard(limits)
    app = web.Application(
        middlewares=[guard.arrival, guard.body], handler_args=limits.handler_args()
    )
    app.router.add_route("*", "/{tail:.*}", handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = GuardedSite(runner, "127.0.0.1", 0, guard)
    await site.start()
    assert site._server is not None
    port = site._server.sockets[0].getsockname()[1]
    try:
        yield port, guard
    finally:
        await runner.cleanup()


LIMITS = HttpLimits(
    max_connections=8, header_timeout_s=0.5, body_timeout_s=0.5, keepalive_timeout_s=5
)


async def _ok(request: web.Request) -> web.Response:
    body = await request.read()
    return web.Response(text=f"ok {len(body)}")


async def _get(port: int, extra: bytes = b"") -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n" + extra)
    data = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    return data


async def _closed(reader: asyncio.StreamReader, timeout_s: float) -> bool:
    try:
        return await asyncio.wait_for(reader.read(), timeout_s) == b""
    except ConnectionResetError:
        return True


async def test_slow_headers_are_cut_and_the_cap_admits_new_clients() -> None:
    async with _serve(LIMITS, _ok) as (port, guard):
        # Twice the cap of clients that never finish their headers.
        slow = []
        for _ in range(2 * LIMITS.max_connections):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
            slow.append((reader, writer))
        # A real request is still served: it displaces the oldest half-sent one.
        assert (await _get(port)).startswith(b"HTTP/1.1 200")
        assert guard.open_connections <= LIMITS.max_connections
        assert guard.displaced >= LIMITS.max_connections
        # Every slow sender is disconnected by the header deadline (or was displaced).
        for reader, writer in slow:
            assert await _closed(reader, 10)
            writer.close()
        assert guard.header_timeouts >= 1


async def test_past_the_cap_with_every_connection_busy_a_client_gets_503() -> None:
    release = asyncio.Event()

    async def busy(request: web.Request) -> web.Response:
        if request.path == "/block":
            await release.wait()
        return web.Response(text="ok")

    limits = HttpLimits(
        max_connections=2, header_timeout_s=5, body_timeout_s=5, keepalive_timeout_s=5
    )
    async with _serve(limits, busy) as (port, guard):
        held = []
        for _ in range(2):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /block HTTP/1.1\r\nHost: x\r\n\r\n")
            held.append((reader, writer))
        while guard.stats()["waiting_first_request"] or guard.open_connections < 2:
            await asyncio.sleep(0.01)
        answer = await _get(port)
        assert answer.startswith(b"HTTP/1.1 503") and b"too_many_connections" in answer
        assert guard.refused == 1
        release.set()
        for reader, writer in held:
            assert (await asyncio.wait_for(reader.readline(), 10)).startswith(b"HTTP/1.1 200")
            writer.close()
        assert (await _get(port)).startswith(b"HTTP/1.1 200")


async def test_a_body_that_does_not_arrive_in_time_is_answered_408() -> None:
    async with _serve(LIMITS, _ok) as (port, guard):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\nabc")
        answer = await asyncio.wait_for(reader.read(), 10)
        assert answer.startswith(b"HTTP/1.1 408"), answer
        assert b"request_timeout" in answer
        assert guard.body_timeouts == 1
        writer.close()
        # A body that does arrive is read once and handed to the handler.
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(
            b"POST /x HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: 3\r\n\r\nabc"
        )
        assert (await asyncio.wait_for(reader.read(), 10)).endswith(b"ok 3")
        writer.close()


async def test_gone_resolves_when_the_client_disconnects() -> None:
    entered = asyncio.Event()
    seen: list[bool] = []

    async def poll(request: web.Request) -> web.Response:
        gone = guard_ref[0].gone(request)
        assert gone is not None
        entered.set()
        await asyncio.wait_for(gone, 10)
        seen.append(True)
        return web.Response(text="never read")

    guard_ref: list[ConnectionGuard] = []
    async with _serve(LIMITS, poll) as (port, guard):
        guard_ref.append(guard)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /poll HTTP/1.1\r\nHost: x\r\n\r\n")
        await asyncio.wait_for(entered.wait(), 10)
        writer.close()
        while not seen:
            await asyncio.sleep(0.01)
        assert guard.open_connections == 0 or seen


def test_limits_come_from_the_config(tmp_path: Path) -> None:
    from chronomq.cluster.config.nodeconfig import load

    cfg = load(
        overrides={
            "data_dir": str(tmp_path),
            "max_http_connections": 10,
            "http_header_timeout_ms": 1500,
        }
    )
    limits = HttpLimits.from_config(cfg)
    assert limits.max_connections == 10 and limits.header_timeout_s == 1.5
    assert limits.handler_args()["keepalive_timeout"] == cfg.http_keepalive_timeout_ms / 1000
    assert cfg.max_pull_bytes == 4 * 1024 * 1024


# ---------------------------------------------------------------------- the pull route


class BlockingStore:
    """A store whose CommitLog reads block until the test lets them go."""

    def __init__(self, sizes: list[int]) -> None:
        self.reader = FakeReader(sizes)
        self.gate = threading.Event()
        self.commitlog = self
        self.kv: dict[str, Any] = {}
        self.applied_length = 0

    def read_message(self, at: int, size: int | None = None) -> record.Message:
        assert self.gate.wait(30), "the test never opened the gate"
        return self.reader.read_message(at, size)

    def queue_count(self, topic: str) -> int | None:
        return 1 if topic == "t" else None

    def max_offset(self, topic: str, queue: int) -> int:
        return len(self.reader.sizes)

    def min_offset(self, topic: str, queue: int) -> int:
        return 0  # retention deleted nothing

    def read_units(self, topic: str, queue: int, offset: int, max_units: int) -> list[CqUnit]:
        return self.reader.units()[offset : offset + max_units]


def _app(tmp_path: Path, store: BlockingStore) -> web.Application:
    from types import SimpleNamespace

    from chronomq.cluster.config.nodeconfig import load
    from chronomq.cluster.httpapi.api import create_app
    from chronomq.cluster.node.broker import Broker

    raftlog = SimpleNamespace(
        store=store,
        add_apply_listener=lambda fn: None,
        leader_address=lambda: None,
        removal=None,
        is_leader=True,  # reads its own store: no read index to ask a leader for
    )
    config = load(overrides={"data_dir": str(tmp_path), "max_pull_bytes": 1_000_000})
    return create_app(Broker(config, raftlog))  # type: ignore[arg-type]


async def test_a_large_pull_is_read_off_the_loop(tmp_path: Path, aiohttp_client: Any) -> None:
    store = BlockingStore([300_000] * 10)
    client = await aiohttp_client(_app(tmp_path, store))
    pull = asyncio.create_task(client.get("/v1/topics/t/queues/0/messages?max=1000"))
    # While the pull's disk reads are stuck, the loop still answers.
    for _ in range(3):
        r = await asyncio.wait_for(client.get("/healthz"), 10)
        assert r.status == 200
    assert not pull.done()
    store.gate.set()
    r = await asyncio.wait_for(pull, 30)
    raw = await r.read()
    assert r.status == 200 and len(raw) <= 1_000_000
    assert [m["offset"] for m in orjson.loads(raw)["messages"]] == [0, 1, 2]


async def test_a_long_poll_ends_when_its_client_goes_away(
    tmp_path: Path, aiohttp_client: Any
) -> None:
    store = BlockingStore([])
    store.gate.set()
    app = _app(tmp_path, store)
    client = await aiohttp_client(app)
    from chronomq.cluster.httpapi.base import BROKER

    broker = app[BROKER]
    poll = asyncio.create_task(client.get("/v1/topics/t/queues/0/messages?wait_ms=30000"))
    deadline = time.monotonic() + 10
    while broker.waiters.waiting == 0:
        assert not poll.done(), "the long-poll ended before it waited"
        assert time.monotonic() < deadline, "the long-poll never registered a waiter"
        await asyncio.sleep(0.01)
    poll.cancel()
    # The waiter goes (the test server has no connection guard: the transport is watched).
    deadline = time.monotonic() + 10
    while broker.waiters.waiting:
        assert time.monotonic() < deadline, "the waiter outlived its client"
        await asyncio.sleep(0.05)
    assert broker.waiters.queues == 0


async def test_headers_that_came_in_time_are_served_when_the_loop_was_busy_past_the_deadline() -> (
    None
):
    """A node busy past a connection's header deadline (a loaded leader) finds the headers and
    the deadline due together: the headers came in time, so the request is served. The
    deadline used to end only when the request's handler started, after the deadline's own
    callback, and the connection was cut with its request read (a reset at the client)."""
    async with _serve(LIMITS, _ok) as (port, guard):
        answer: list[bytes] = []
        admit = guard.admit

        def admit_then_stall(conn: Any) -> bool:
            # Right after the connection is taken, the loop is busy past its header deadline
            # (the client's whole request is in the socket meanwhile).
            asyncio.get_running_loop().call_soon(time.sleep, LIMITS.header_timeout_s + 0.3)
            return admit(conn)

        guard.admit = admit_then_stall  # type: ignore[method-assign]

        def client() -> None:
            with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
                s.sendall(
                    b"POST /x HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                    b"Content-Length: 5\r\n\r\nhello"
                )
                data = b""
                with contextlib.suppress(ConnectionResetError):
                    while chunk := s.recv(65536):
                        data += chunk
                answer.append(data)

        thread = threading.Thread(target=client)
        thread.start()
        await asyncio.to_thread(thread.join, 10)
        assert answer and answer[0].startswith(b"HTTP/1.1 200"), answer
        assert answer[0].endswith(b"ok 5")
        assert guard.header_timeouts == 0
