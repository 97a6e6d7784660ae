"""A benchmark's temporary node directory goes after a good run and stays after a bad one."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from chronomq.ops.benchdir import bench_dir


def test_a_temporary_directory_is_removed_after_a_good_run() -> None:
    args = argparse.Namespace(data_dir=None)
    with bench_dir(args, "chronomq-test-") as d:
        assert Path(args.data_dir) == d.path and d.path.is_dir()
        (d.path / "node.log").write_text("x")
    assert not d.path.exists()


def test_it_is_kept_and_named_after_a_failure(capsys: pytest.CaptureFixture[str]) -> None:
    args = argparse.Namespace(data_dir=None)
    with pytest.raises(RuntimeError), bench_dir(args, "chronomq-test-") as d:
        raise RuntimeError("node 1 exited")
    assert d.path.is_dir()
    assert str(d.path) in capsys.readouterr().err
    d.path.rmdir()


def test_it_is_kept_when_asked() -> None:
    args = argparse.Namespace(data_dir=None)
    with bench_dir(args, "chronomq-test-") as d:
        d.keep()
    assert d.path.is_dir()
    d.path.rmdir()


def test_a_given_directory_is_the_operators(tmp_path: Path) -> None:
    args = argparse.Namespace(data_dir=str(tmp_path / "mine"))
    with bench_dir(args, "chronomq-test-") as d:
        d.path.mkdir()
    assert d.path.is_dir() and not d.temporary
