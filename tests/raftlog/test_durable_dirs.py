"""Directories a node creates are made durable in their parents: a power cut cannot take the
CommitLog's, the journal's or the timer's folder away with everything in it."""

from __future__ import annotations

from pathlib import Path

import pytest

from chronomq.raftlog import durable


def test_make_dirs_syncs_each_new_directory_in_its_parent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    synced: list[Path] = []
    monkeypatch.setattr(durable, "fsync_dir", lambda p, **kw: synced.append(Path(p)))
    (tmp_path / "data").mkdir()
    durable.make_dirs(tmp_path / "data" / "raft" / "x")
    assert (tmp_path / "data" / "raft" / "x").is_dir()
    # Only what was created, top down, each in its parent.
    assert synced == [tmp_path / "data", tmp_path / "data" / "raft"]
    synced.clear()
    durable.make_dirs(tmp_path / "data" / "raft")
    assert synced == []


def test_the_stores_create_their_folders_durably(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from chronomq.raftlog.commitlog import CommitLog
    from chronomq.raftlog.consumequeue import ConsumeQueueStore

    synced: list[Path] = []
    real = durable.fsync_dir
    monkeypatch.setattr(durable, "fsync_dir", lambda p, **kw: (synced.append(Path(p)), real(p)))
    log = CommitLog(tmp_path / "data" / "commitlog")
    try:
        assert tmp_path / "data" in synced and tmp_path in synced
    finally:
        log.close()
    synced.clear()
    cq = ConsumeQueueStore(tmp_path / "data" / "consumequeue")
    try:
        assert synced == [tmp_path / "data"]  # consumequeue/ made durable in data/
    finally:
        cq.close()
