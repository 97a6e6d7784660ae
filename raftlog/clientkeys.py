"""Client idempotency keys as a store holds them: in memory, in apply order, and in the snapshot.

A client's key is held as a 16-byte digest (:func:`key_digest`) with the fingerprint of its
request, the propose time and the placement of its batch (:data:`CLIENT_ENTRY`). The rules
that use them (a repeat within the window answers the first placement, another fingerprint
is refused) are :class:`chronomq.raftlog.store.Store`'s.
"""

from __future__ import annotations

import base64
import hashlib
import struct
from collections import OrderedDict
from dataclasses import dataclass

from chronomq.raftlog.errors import StoreCorruption

#: One remembered client key, as kept in memory and in the snapshot::
#:
#:     0            16            32            40             48        52       53
#:     +------------+-------------+-------------+--------------+---------+--------+
#:     | key digest | fingerprint | propose_ms  | first phys   | count   | status |
#:     | blake2b-16 | 16 bytes    | int64       | uint64       | uint32  | uint8  |
#:     +------------+-------------+-------------+--------------+---------+--------+
CLIENT_ENTRY = struct.Struct(">16s16sqQIB")
_PROPOSE_MS = struct.Struct(">q")


def key_digest(key: str) -> bytes:
    """How a client idempotency key is held: 16 bytes, whatever its length."""
    return hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=16).digest()


def fingerprint_bytes(fingerprint: str) -> bytes:
    """A command's fingerprint (hex) as held; total for any string a command may carry."""
    if len(fingerprint) == 32:
        try:
            return bytes.fromhex(fingerprint)
        except ValueError:
            pass
    return hashlib.blake2b(fingerprint.encode("utf-8", "surrogatepass"), digest_size=16).digest()


@dataclass(frozen=True, slots=True)
class ClientKey:
    """What is remembered of a client's idempotency key."""

    fingerprint: bytes
    propose_ms: int
    physical_offset: int
    count: int
    status: int

    @classmethod
    def unpack(cls, entry: bytes) -> ClientKey:
        _, fp, t, phys, n, status = CLIENT_ENTRY.unpack(entry)
        return cls(fp, t, phys, n, status)


def expire(clients: OrderedDict[bytes, bytes], cutoff_ms: int) -> None:
    """Forget client keys proposed at or before ``cutoff_ms``, oldest first.

    Entries are in apply order; propose times from different leaders may step back a
    little, so an entry behind a younger one waits, and lookups check each entry's time.
    """
    while clients:
        first = next(iter(clients.values()))
        if _PROPOSE_MS.unpack_from(first, 32)[0] > cutoff_ms:
            return
        clients.popitem(last=False)


def clients_from(text: str) -> OrderedDict[bytes, bytes]:
    """Client keys from a snapshot's ``clients`` field (absent in version 1)."""
    data = base64.b64decode(text)
    size = CLIENT_ENTRY.size
    if len(data) % size:
        raise StoreCorruption(
            f"snapshot's client keys are {len(data)} bytes, not a multiple of {size}"
        )
    return OrderedDict((data[i : i + 16], data[i : i + size]) for i in range(0, len(data), size))
