"""An instrumented ``os.fsync`` / ``os.fdatasync`` for durability tests without a power-cut
filesystem: which file or directory each call synced, in order, and injected failures."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable

import pytest


class FsyncSpy:
    """os.fsync / os.fdatasync, recording what each synced (path of the descriptor)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[str, str]] = []
        self.fail: Callable[[str], bool] = lambda path: False
        real_fsync, real_fdatasync = os.fsync, os.fdatasync

        def spy(kind: str, real: Callable[[int], None]) -> Callable[[int], None]:
            def call(fd: int) -> None:
                path = os.readlink(f"/proc/self/fd/{fd}")
                if self.fail(path):
                    raise OSError(errno.EIO, "Input/output error")
                self.calls.append((kind, path))
                real(fd)

            return call

        monkeypatch.setattr(os, "fsync", spy("fsync", real_fsync))
        monkeypatch.setattr(os, "fdatasync", spy("fdatasync", real_fdatasync))

    def paths(self) -> list[str]:
        return [p for _, p in self.calls]


class Faults:
    def __init__(self) -> None:
        self.messages: list[str] = []

    def __call__(self, message: str) -> None:
        self.messages.append(message)
