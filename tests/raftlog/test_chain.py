"""The CommitLog hash chain: a function of the byte stream alone, resumable from a snapshot."""

from __future__ import annotations

import hashlib
import random
import struct

import pytest

from chronomq.raftlog.chain import BLOCK_BYTES, ZERO, Chain, RangeCheck


def _stream(n: int, seed: int = 1) -> bytes:
    return random.Random(seed).randbytes(n)


def test_golden_values() -> None:
    assert Chain().value() == ZERO
    one = hashlib.blake2b(ZERO + b"abc" + struct.pack(">Q", 3), digest_size=16).digest()
    assert Chain.over([b"abc"]).value() == one
    data = _stream(BLOCK_BYTES + 5)
    block = hashlib.blake2b(ZERO + data[:BLOCK_BYTES], digest_size=16).digest()
    tail = hashlib.blake2b(
        block + data[BLOCK_BYTES:] + struct.pack(">Q", len(data)), digest_size=16
    ).digest()
    chain = Chain.over([data])
    assert chain.block_chain == block and chain.block_start == BLOCK_BYTES
    assert chain.value() == tail


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_how_the_stream_is_cut_does_not_matter(seed: int) -> None:
    rng = random.Random(seed)
    data = _stream(3 * BLOCK_BYTES + 777, seed)
    whole = Chain.over([data])
    cuts = sorted(rng.sample(range(1, len(data)), 40) + [BLOCK_BYTES, 2 * BLOCK_BYTES])
    pieces = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]
    assert Chain.over(pieces).value() == whole.value()
    assert Chain.over(pieces).block_chain == whole.block_chain


@pytest.mark.parametrize("at", [0, 1, BLOCK_BYTES - 1, BLOCK_BYTES, BLOCK_BYTES + 10])
def test_resuming_from_a_snapshot_state_equals_going_on(at: int) -> None:
    data = _stream(2 * BLOCK_BYTES + 99)
    head = Chain.over([data[:at]])
    resumed = Chain(at, head.block_chain, data[head.block_start : at])
    assert resumed.value() == head.value()
    resumed.update(data[at:])
    assert resumed.value() == Chain.over([data]).value()


def test_a_changed_byte_or_length_changes_the_chain() -> None:
    data = bytearray(_stream(BLOCK_BYTES + 100))
    good = Chain.over([data]).value()
    data[10] ^= 1
    assert Chain.over([data]).value() != good
    assert Chain.over([b"\x00"]).value() != Chain.over([b"\x00\x00"]).value()


def test_a_range_check_accepts_exactly_the_right_bytes() -> None:
    data = _stream(BLOCK_BYTES + 5000)
    anchor = Chain.over([data[:1000]])
    expected = Chain.over([data]).value()
    check = RangeCheck(anchor, len(data), expected)
    check.update(data[1000:5000])
    assert check.verdict() is not None and "incomplete" in str(check.verdict())
    check.update(data[5000:])
    assert check.verdict() is None and check.chain().value() == expected
    check.rewind()
    assert check.position == 1000
    bad = bytearray(data[1000:])
    bad[-1] ^= 1
    check.update(bad)
    assert "fail the hash chain" in str(check.verdict())
    with pytest.raises(ValueError):
        check.update(b"x")  # past the end


def test_bad_resume_arguments_are_refused() -> None:
    with pytest.raises(ValueError):
        Chain(10, ZERO, b"short")
    with pytest.raises(ValueError):
        Chain(0, b"short")
