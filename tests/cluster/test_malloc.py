"""The node pins glibc's mmap threshold unless the operator chose one."""

from __future__ import annotations

import platform

import pytest

from chronomq.cluster.process import malloc


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_threshold_is_pinned_on_glibc(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    assert malloc.fix_mmap_threshold()


@pytest.mark.parametrize(
    "name,value",
    [("MALLOC_MMAP_THRESHOLD_", "65536"), ("GLIBC_TUNABLES", "glibc.malloc.mmap_threshold=65536")],
)
def test_an_operator_setting_is_left_alone(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str
) -> None:
    monkeypatch.setenv(name, value)
    assert not malloc.fix_mmap_threshold()
