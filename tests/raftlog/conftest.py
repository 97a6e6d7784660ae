"""Fixtures shared by the raftlog tests."""

from __future__ import annotations

import pytest

from ._fsync import FsyncSpy


@pytest.fixture
def spy(monkeypatch: pytest.MonkeyPatch) -> FsyncSpy:
    """Every fsync and fdatasync of the test recorded (see ``_fsync.FsyncSpy``)."""
    return FsyncSpy(monkeypatch)
