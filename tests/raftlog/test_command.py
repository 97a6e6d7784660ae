"""The binary command codec."""

from __future__ import annotations

import struct

import orjson
import pytest

from chronomq.raftlog import command as cmdcodec
from chronomq.raftlog.command import Batch, Command, Kind
from chronomq.raftlog.errors import StoreCorruption

from ._util import command, rec


def _full() -> Command:
    blob = rec("orders", 1, b"one", 1) + rec("%RETRY%g", 0, b"two", 2)
    return Command(
        kind=Kind.APPEND,
        propose_ms=1_700_000_000_123,
        batches=(
            Batch("k1", 1, expect={"offset/a": 3, "gone": None}, updates={"x": "y", "n": None}),
            Batch("k2", 1, creates={"%RETRY%g": 1}),
            Batch("k3", 0, updates={"only": 1}),
        ),
        topics=("orders", "%RETRY%g"),
        messages=(
            (0, 1, len(rec("orders", 1, b"one", 1))),
            (1, 0, len(rec("%RETRY%g", 0, b"two", 2))),
        ),
        blob=blob,
        extra={"level": 3, "cursor": [1, 2]},
    )


def test_round_trip() -> None:
    cmd = _full()
    data = cmdcodec.encode(cmd)
    assert cmdcodec.decode(data) == cmd
    assert cmdcodec.encode(cmdcodec.decode(data)) == data


def test_round_trip_of_a_barrier_and_an_empty_append() -> None:
    for cmd in (Command(Kind.BARRIER, 5), Command(Kind.APPEND, 0)):
        back = cmdcodec.decode(cmdcodec.encode(cmd))
        assert back == cmd
        assert back.kind is cmd.kind


def test_header_layout() -> None:
    data = cmdcodec.encode(Command(Kind.BARRIER, 7))
    magic, version, kind, meta_len = struct.unpack_from(">HBBI", data)
    assert (magic, version, kind) == (0xC0DE, 1, 2)
    assert meta_len == len(data) - 8
    assert orjson.loads(data[8:])["t"] == 7


def test_blob_is_carried_byte_for_byte() -> None:
    data = command([])
    assert cmdcodec.decode(data).blob == b""
    cmd = _full()
    assert cmdcodec.decode(cmdcodec.encode(cmd)).blob == cmd.blob
    assert cmdcodec.encode(cmd).endswith(cmd.blob)


def _with_header(magic: int = cmdcodec.MAGIC, version: int = cmdcodec.VERSION) -> bytes:
    data = bytearray(cmdcodec.encode(_full()))
    struct.pack_into(">HB", data, 0, magic, version)
    return bytes(data)


def test_bad_magic() -> None:
    with pytest.raises(StoreCorruption, match="magic"):
        cmdcodec.decode(_with_header(magic=0xBEEF))


@pytest.mark.parametrize("version", [0, 2, 255])
def test_unknown_version(version: int) -> None:
    with pytest.raises(StoreCorruption, match="version"):
        cmdcodec.decode(_with_header(version=version))


@pytest.mark.parametrize("keep", [0, 1, 7])
def test_shorter_than_the_header(keep: int) -> None:
    with pytest.raises(StoreCorruption):
        cmdcodec.decode(cmdcodec.encode(_full())[:keep])


def test_meta_cut_short() -> None:
    data = cmdcodec.encode(_full())
    meta_len = struct.unpack_from(">I", data, 4)[0]
    for keep in (9, 8 + meta_len // 2, 8 + meta_len - 1):
        with pytest.raises(StoreCorruption):
            cmdcodec.decode(data[:keep])


def _with_meta(meta: object, kind: int = 1) -> bytes:
    raw = meta if isinstance(meta, bytes) else orjson.dumps(meta)
    return struct.pack(">HBBI", cmdcodec.MAGIC, cmdcodec.VERSION, kind, len(raw)) + raw


@pytest.mark.parametrize(
    "meta",
    [
        b"{not json",
        b"\xff\xfe",
        [],
        {},
        {"t": 1, "b": [], "tp": []},  # no message table
        {"t": 1, "b": [["k", 1]], "tp": [], "m": []},  # batch of two fields
        {"t": 1, "b": [], "tp": [], "m": [0, 1]},  # not triples
        {"t": 1, "b": 3, "tp": [], "m": []},
    ],
)
def test_corrupt_meta(meta: object) -> None:
    with pytest.raises(StoreCorruption):
        cmdcodec.decode(_with_meta(meta))


def test_unknown_kind() -> None:
    with pytest.raises(StoreCorruption):
        cmdcodec.decode(_with_meta({"t": 1, "b": [], "tp": [], "m": []}, kind=9))
