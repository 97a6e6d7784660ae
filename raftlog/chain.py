"""The CommitLog hash chain: a digest of the CommitLog's bytes that any replica can extend.

Replicas compare ``(length, chain)`` to know their CommitLogs are equal, a thin snapshot
carries both, and a node that fetches CommitLog bytes from a peer checks them against the
snapshot's chain before it accepts them (:class:`RangeCheck`). The chain is a function of the
byte stream alone, not of how it was cut into commands or network reads, so it can be
recomputed over any fetched range from the chain's state where the range starts.

The stream is cut at absolute offsets into blocks of :data:`BLOCK_BYTES`::

    block_chain(0)     = 16 zero bytes
    block_chain(k + 1) = blake2b-128(block_chain(k) || bytes[k*B, (k+1)*B))
    chain(L)           = blake2b-128(block_chain(L // B) || bytes[(L // B)*B, L) || L as u64 BE)
    chain(0)           = 16 zero bytes (an empty CommitLog)

Every byte is hashed once as it is appended (one running hash per block). A snapshot at
length ``L`` carries ``chain(L)`` and ``block_chain(L // B)``: with the last partial block,
which is on disk, that is the whole state, so a restored node can go on extending it.
Blank records that pad a segment's end are part of the stream like any other byte.

A pure core: bytes in, digests out; the caller reads and writes files.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable

BLOCK_BYTES = 1 << 20
DIGEST_BYTES = 16
ZERO = bytes(DIGEST_BYTES)
_LENGTH = struct.Struct(">Q")


class Chain:
    """The chain's state at :attr:`length`; :meth:`update` appends bytes, :meth:`value` reads it."""

    __slots__ = ("_block", "_h", "_length")

    def __init__(self, length: int = 0, block_chain: bytes = ZERO, partial: bytes = b"") -> None:
        """The state at ``length``, given ``block_chain(length // B)`` and the bytes of the
        last partial block (``length % B`` of them)."""
        if len(block_chain) != DIGEST_BYTES:
            raise ValueError(f"a block chain is {DIGEST_BYTES} bytes, got {len(block_chain)}")
        if len(partial) != length % BLOCK_BYTES:
            raise ValueError(
                f"the partial block at {length} is {length % BLOCK_BYTES} bytes, got {len(partial)}"
            )
        self._length = length
        self._block = block_chain
        self._h = hashlib.blake2b(block_chain, digest_size=DIGEST_BYTES)
        self._h.update(partial)

    @classmethod
    def over(cls, chunks: Iterable[bytes | bytearray | memoryview]) -> Chain:
        """The chain of a stream starting at offset 0."""
        chain = cls()
        for chunk in chunks:
            chain.update(chunk)
        return chain

    @property
    def length(self) -> int:
        return self._length

    @property
    def block_chain(self) -> bytes:
        """``block_chain(length // B)``: what a snapshot needs besides the partial block."""
        return self._block

    @property
    def block_start(self) -> int:
        """Where the last (partial) block starts."""
        return self._length - self._length % BLOCK_BYTES

    def update(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data)
        while view:
            room = BLOCK_BYTES - self._length % BLOCK_BYTES
            part = view[:room]
            self._h.update(part)
            self._length += len(part)
            view = view[len(part) :]
            if len(part) == room:
                self._block = self._h.digest()
                self._h = hashlib.blake2b(self._block, digest_size=DIGEST_BYTES)

    def value(self) -> bytes:
        """``chain(length)``."""
        if self._length == 0:
            return ZERO
        h = self._h.copy()
        h.update(_LENGTH.pack(self._length))
        return h.digest()

    def copy(self) -> Chain:
        other = Chain.__new__(Chain)
        other._length = self._length
        other._block = self._block
        other._h = self._h.copy()
        return other


class RangeCheck:
    """Checks bytes fetched for ``[anchor.length, end)`` against the chain expected at ``end``.

    Fed the fetched bytes in order (:meth:`update`); :meth:`verdict` says whether they are
    exactly the bytes whose chain the snapshot carries. Starts again from the anchor with
    :meth:`rewind` when fetched bytes were thrown away.
    """

    __slots__ = ("_anchor", "_chain", "end", "expected")

    def __init__(self, anchor: Chain, end: int, expected: bytes) -> None:
        if end < anchor.length:
            raise ValueError(f"range ends at {end}, before its start {anchor.length}")
        self._anchor = anchor.copy()
        self._chain = anchor.copy()
        self.end = end
        self.expected = expected

    @property
    def start(self) -> int:
        return self._anchor.length

    @property
    def position(self) -> int:
        return self._chain.length

    def update(self, data: bytes | bytearray | memoryview) -> None:
        if self._chain.length + len(data) > self.end:
            raise ValueError(f"{len(data)} bytes at {self._chain.length} run past {self.end}")
        self._chain.update(data)

    def verdict(self) -> str | None:
        """None when the range is complete and matches; else what is wrong."""
        if self._chain.length != self.end:
            return f"range incomplete: {self._chain.length} of [{self.start}, {self.end})"
        got = self._chain.value()
        if got != self.expected:
            return (
                f"bytes [{self.start}, {self.end}) fail the hash chain: "
                f"chain {got.hex()}, the snapshot has {self.expected.hex()}"
            )
        return None

    def rewind(self) -> None:
        self._chain = self._anchor.copy()

    def chain(self) -> Chain:
        """The chain's state at :attr:`position` (a copy)."""
        return self._chain.copy()
