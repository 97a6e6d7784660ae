"""Commands: what the leader proposes to the Raft group and every node applies.

A command is binary, never pickled by us::

    0       2       3       4               8
    +-------+-------+-------+---------------+----------------+-----------------------------+
    | magic | ver   | kind  | meta_len      | meta (orjson)  | blob: records back to back  |
    +-------+-------+-------+---------------+----------------+-----------------------------+

``meta`` holds the leader's propose time, the batches (one per client request: idempotency
key, message count, conditions, state updates, topic creations and, for a client's key, the
fingerprint of its request) and, per message, the topic index, queue id and record size; and
the idempotency limits the leader applies (client window in ms, client keys kept, internal
batches kept), so that every replica forgets the same keys whatever its own config says. An ``EXTENSION`` command carries no batches: its ``extra`` is
``{"e": extension name, "p": JSON payload}`` for a registered apply extension
(:mod:`chronomq.raftlog.extension`). Everything that depends on time, randomness or the node was
decided by the leader and is inside the command, so applying it is deterministic.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field

import orjson

from chronomq.raftlog.errors import StoreCorruption

_HEAD = struct.Struct(">HBBI")
MAGIC = 0xC0DE
VERSION = 1

Scalar = int | str | None


class Kind(enum.IntEnum):
    APPEND = 1
    BARRIER = 2
    EXTENSION = 3


@dataclass(frozen=True, slots=True)
class Batch:
    """One client request inside a command; applied atomically."""

    key: str
    count: int
    expect: Mapping[str, Scalar] | None = None
    updates: Mapping[str, Scalar] | None = None
    creates: Mapping[str, int] | None = None
    #: Set for a client's idempotency key: a hash of the request the key was sent with
    #: (hex). Such keys are remembered for a time window, others (internal batches) by count.
    fingerprint: str | None = None


@dataclass(frozen=True, slots=True)
class IdemLimits:
    """How long and how many idempotency keys apply remembers (decided by the leader)."""

    client_window_ms: int
    client_max_keys: int
    internal_keys: int


@dataclass(frozen=True, slots=True)
class Command:
    kind: Kind
    propose_ms: int
    batches: tuple[Batch, ...] = ()
    topics: tuple[str, ...] = ()
    # Per message: (topic index, queue id, record size).
    messages: tuple[tuple[int, int, int], ...] = ()
    blob: bytes = b""
    extra: Mapping[str, object] = field(default_factory=dict)
    idem: IdemLimits | None = None


def _batch_row(b: Batch) -> list[object]:
    row: list[object] = [b.key, b.count, b.expect, b.updates, b.creates]
    if b.fingerprint is not None:
        row.append(b.fingerprint)
    return row


def _batch(row: list[object]) -> Batch:
    if len(row) == 5:
        k, n, e, u, c = row
        f = None
    else:
        k, n, e, u, c, f = row
    return Batch(k, n, e, u, c, f)  # type: ignore[arg-type]


def encode(cmd: Command) -> bytes:
    meta = {
        "t": cmd.propose_ms,
        "b": [_batch_row(b) for b in cmd.batches],
        "tp": list(cmd.topics),
        "m": [x for m in cmd.messages for x in m],
        "x": cmd.extra or None,
    }
    if cmd.idem is not None:
        i = cmd.idem
        meta["i"] = [i.client_window_ms, i.client_max_keys, i.internal_keys]
    meta_bytes = orjson.dumps(meta)
    return _HEAD.pack(MAGIC, VERSION, int(cmd.kind), len(meta_bytes)) + meta_bytes + cmd.blob


def decode(data: bytes) -> Command:
    if len(data) < _HEAD.size:
        raise StoreCorruption("command shorter than its header")
    magic, version, kind, meta_len = _HEAD.unpack_from(data, 0)
    if magic != MAGIC:
        raise StoreCorruption(f"command has a bad magic {magic:#x}")
    if version != VERSION:
        raise StoreCorruption(
            f"command version {version} is not supported (this node knows {VERSION})"
        )
    start = _HEAD.size
    if len(data) < start + meta_len:
        raise StoreCorruption(f"command meta is cut short: {len(data) - start} of {meta_len} bytes")
    try:
        meta = orjson.loads(data[start : start + meta_len])
        flat = meta["m"]
        if len(flat) % 3:
            raise ValueError("message table is not made of triples")
        messages = tuple((flat[i], flat[i + 1], flat[i + 2]) for i in range(0, len(flat), 3))
        limits = meta.get("i")
        idem = None if limits is None else IdemLimits(*(int(x) for x in limits))
        return Command(
            kind=Kind(kind),
            propose_ms=meta["t"],
            batches=tuple(_batch(row) for row in meta["b"]),
            topics=tuple(meta["tp"]),
            messages=messages,
            blob=data[start + meta_len :],
            extra=meta.get("x") or {},
            idem=idem,
        )
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise StoreCorruption(f"command does not decode: {exc}") from None
