"""The removal notice: signed, for this node, past what it applied; and its file."""

from __future__ import annotations

from pathlib import Path

import pytest

from chronomq.raftlog import durable
from chronomq.raftlog.removal import NoticeRefused, RemovalFile, RemovalNotice, sign, verify

from ._fsync import Faults, FsyncSpy

SECRET = b"s" * 32
NOTICE = RemovalNotice(3, "127.0.0.1:26303", 120, 7, 1_790_000_000_000, 0)


def _verify(body: bytes, signature: str, **kw: object) -> RemovalNotice:
    args: dict[str, object] = {"node_id": 3, "raft": "127.0.0.1:26303", "applied_index": 100}
    args.update(kw)
    return verify(SECRET, body, signature, **args)  # type: ignore[arg-type]


def test_a_signed_notice_for_this_node_holds() -> None:
    body = NOTICE.encode()
    assert _verify(body, sign(SECRET, body)) == NOTICE


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"signature": "00" * 32}, "not signed"),
        ({"node_id": 4}, "not this node"),
        ({"raft": "127.0.0.1:26304"}, "not this node"),
        ({"applied_index": 120}, "added back"),
    ],
)
def test_a_notice_that_does_not_hold_is_refused(change: dict[str, object], why: str) -> None:
    body = NOTICE.encode()
    signature = str(change.pop("signature", sign(SECRET, body)))
    with pytest.raises(NoticeRefused, match=why):
        _verify(body, signature, **change)


@pytest.mark.parametrize(
    "body", [b"", b"[]", b"{}", b'{"node_id": true}', b"x" * 5000, b'{"node_id": 3, "raft": 1}']
)
def test_a_malformed_notice_is_refused(body: bytes) -> None:
    with pytest.raises(NoticeRefused):
        _verify(body, sign(SECRET, body))


def test_a_notice_carries_its_version_and_one_without_it_is_version_1() -> None:
    body = NOTICE.encode()
    assert body.startswith(b'{"at_ms":1790000000000,"by":0,"index":120,') and body.endswith(
        b',"v":1}'
    )
    older = body.replace(b',"v":1}', b"}")
    assert _verify(older, sign(SECRET, older)) == NOTICE
    newer = body.replace(b',"v":1}', b',"v":2}')
    with pytest.raises(NoticeRefused, match="version 2"):
        _verify(newer, sign(SECRET, newer))


def test_the_file_survives_and_a_damaged_one_still_means_removed(tmp_path: Path) -> None:
    f = RemovalFile(tmp_path)
    assert f.load() is None
    f.save(NOTICE)
    assert RemovalFile(tmp_path).load() == NOTICE
    f.path.write_bytes(b"{torn")
    assert f.load() is not None
    f.clear()
    assert f.load() is None
    f.clear()  # twice is fine


def test_a_failed_sync_of_the_notice_stops_the_node(
    tmp_path: Path, spy: FsyncSpy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Saving and clearing the notice sync its directory; a failure stops the node (a failed
    directory sync on clearing used to be ignored)."""
    faults = Faults()
    monkeypatch.setattr(durable, "fail_stop", faults)
    f = RemovalFile(tmp_path)
    f.save(NOTICE)
    assert spy.paths() == [str(tmp_path / "removed.tmp"), str(tmp_path)]
    spy.fail = lambda path: path == str(tmp_path)
    with pytest.raises(durable.StorageFault):
        f.clear()
    with pytest.raises(durable.StorageFault):
        f.save(NOTICE)
    assert [m.split(" failed")[0] for m in faults.messages] == [f"fsync of {tmp_path}"] * 2
