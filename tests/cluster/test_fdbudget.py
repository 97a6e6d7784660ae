"""The file-descriptor budget's arithmetic and the HTTP listener's back-off on EMFILE."""

from __future__ import annotations

import asyncio
import errno
import socket
from typing import Any

import pytest

from chronomq.cluster.httpapi.httpconn import ACCEPT_BACKOFF_MAX_S, ACCEPT_BACKOFF_MIN_S, Acceptor
from chronomq.cluster.process import fdbudget


def test_common_soft_limit_is_shared_out() -> None:
    b = fdbudget.plan(1024, max_http_connections=1024)
    assert (b.cache_files, b.http_connections, b.reserved) == (409, 409, 206)
    assert not b.cramped
    assert b.cache_files + b.http_connections + b.reserved == 1024
    assert "ConsumeQueue cache 409" in b.describe()


def test_configured_connection_cap_is_never_raised() -> None:
    b = fdbudget.plan(1_048_576, max_http_connections=1024)
    assert b.http_connections == 1024
    assert b.cache_files == fdbudget.MAX_CACHE_FILES


def test_unlimited_counts_as_a_large_finite_limit() -> None:
    b = fdbudget.plan(2**63, max_http_connections=10**6)
    assert b.limit == fdbudget.UNLIMITED_FDS


@pytest.mark.parametrize("limit", [256, 200, 128, 100])
def test_small_limits_keep_the_reserve(limit: int) -> None:
    b = fdbudget.plan(limit, max_http_connections=1024)
    assert b.reserved >= fdbudget.MIN_RESERVED_FDS
    assert b.cache_files + b.http_connections + b.reserved == limit
    assert not b.cramped


def test_a_tiny_limit_is_cramped_but_usable() -> None:
    b = fdbudget.plan(64, max_http_connections=1024)
    assert b.cramped
    assert b.cache_files >= fdbudget.MIN_CACHE_FILES
    assert b.http_connections >= fdbudget.MIN_CONNECTIONS


def test_raise_soft_limit_reaches_the_hard_limit() -> None:
    soft, hard = fdbudget.raise_soft_limit()
    assert soft == hard or soft == fdbudget.UNLIMITED_FDS


class _Clock:
    """A monotonic fake clock in seconds; never goes backwards."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _FullSocket:
    """A listening socket whose accept() always fails with EMFILE."""

    def __init__(self, real: socket.socket) -> None:
        self._real = real
        self.accepts = 0

    def fileno(self) -> int:
        return self._real.fileno()

    def getsockname(self) -> Any:
        return self._real.getsockname()

    def accept(self) -> tuple[socket.socket, Any]:
        self.accepts += 1
        raise OSError(errno.EMFILE, "Too many open files")

    def close(self) -> None:
        self._real.close()


async def test_accept_emfile_backs_off_and_logs_once_per_interval(
    caplog: pytest.LogCaptureFixture,
) -> None:
    real = socket.socket()
    real.bind(("127.0.0.1", 0))
    real.listen(8)
    real.setblocking(False)
    sock = _FullSocket(real)
    clock = _Clock()
    acceptor = Acceptor(sock, asyncio.Protocol, clock=clock)  # type: ignore[arg-type]
    try:
        with caplog.at_level("WARNING", logger="chronomq.cluster.httpapi.httpconn"):
            for _ in range(20):
                acceptor._readable()
                clock.now += 0.5
        # One accept per readiness event (no spin over the backlog), a doubling pause ...
        assert sock.accepts == 20
        assert acceptor.failures == 20
        assert ACCEPT_BACKOFF_MIN_S < acceptor.backoff_s <= ACCEPT_BACKOFF_MAX_S
        assert acceptor.backoff_s == ACCEPT_BACKOFF_MAX_S
        # ... and one line per ACCEPT_LOG_INTERVAL_S (10 s of the fake clock: 0 s and 10 s).
        lines = [r for r in caplog.records if "accept() failed" in r.getMessage()]
        assert len(lines) == 1
        clock.now += 10
        with caplog.at_level("WARNING", logger="chronomq.cluster.httpapi.httpconn"):
            acceptor._readable()
        lines = [r for r in caplog.records if "accept() failed" in r.getMessage()]
        assert len(lines) == 2
        assert "21 times" not in lines[1].getMessage()
    finally:
        acceptor.close()
