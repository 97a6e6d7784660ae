"""Slot chains: linking a TimerLog record into its wheel slot, and reading a slot's chains.

Each slot heads two backward chains in the TimerLog: the main chain (messages to deliver and
rolled messages to re-put) and the cancel chain (tombstones aimed at messages of this slot).
Both are walked newest first by following ``prev_pos``.

A walk stops before ``floor``, the replicated TimerLog reclaim position (kv ``timer/rc``): the
records before it belong to slots already read and may be gone from a node's disk, so every
replica reads a chain as ending there, whether or not it still holds those records.

The planners read through the two small protocols below, so they can be driven by the real
files or by in-memory fakes.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Protocol

from chronomq.timer.errors import ChainBroken, TimerStateError
from chronomq.timer.timerlog import NO_POS, TimerLog, TimerRecord
from chronomq.timer.wheel import Slot, TimerWheel


class SlotReader(Protocol):
    def get(self, time_ms: int) -> Slot: ...


class RecordReader(Protocol):
    @property
    def end_pos(self) -> int: ...

    def read(self, pos: int) -> TimerRecord: ...

    def iter_chain(
        self, last_pos: int, *, stop_pos: int = NO_POS
    ) -> Iterator[tuple[int, TimerRecord]]: ...


def append_linked(log: TimerLog, wheel: TimerWheel, record: TimerRecord) -> int:
    """Append ``record`` to the TimerLog as the newest of its slot's chain; return its position.

    ``record.prev_pos`` is replaced by the chain's current head (main or cancel chain, as the
    record's flags say). The TimerLog is written first, then the wheel, so a crash between
    the two leaves a record the recovery scan links again (see :mod:`chronomq.timer.checkpoint`).
    """
    if record.slot_ms != wheel.geometry.slot_ms(record.slot_ms):
        raise TimerStateError(f"slot_ms {record.slot_ms} is not a slot time")
    slot = wheel.get(record.slot_ms)
    prev = slot.tomb_last_pos if record.in_tombstone_chain else slot.last_pos
    if record.prev_pos != prev:
        record = replace(record, prev_pos=prev)
    pos = log.append(record)
    wheel.put(record.slot_ms, pos, tombstone=record.in_tombstone_chain)
    return pos


def walk(log: RecordReader, last_pos: int, floor: int = 0) -> Iterator[tuple[int, TimerRecord]]:
    """A chain from ``last_pos`` backwards, down to its start or to ``floor`` (exclusive)."""
    pos = last_pos
    while pos != NO_POS and pos >= floor:
        if pos >= log.end_pos:
            raise ChainBroken("chain points outside the TimerLog", pos=pos)
        record = log.read(pos)
        yield pos, record
        if record.prev_pos >= pos:
            raise ChainBroken("chain does not go backwards", pos=pos)
        pos = record.prev_pos


def tombstone_keys(log: RecordReader, slot: Slot, floor: int = 0) -> frozenset[int]:
    """Key hashes of the messages cancelled in ``slot`` (its cancel chain, down to ``floor``)."""
    keys: set[int] = set()
    for pos, record in walk(log, slot.tomb_last_pos, floor):
        if not record.in_tombstone_chain or record.slot_ms != slot.slot_ms:
            raise ChainBroken(
                f"cancel chain of slot {slot.slot_ms} holds a record of slot {record.slot_ms}",
                pos=pos,
            )
        keys.add(record.key_hash)
    return frozenset(keys)


def find_message(log: RecordReader, slot: Slot, key_hash: int, floor: int = 0) -> int | None:
    """Position of the newest message (not a rolled copy) with ``key_hash`` in ``slot`` (its
    main chain down to ``floor``)."""
    for pos, record in walk(log, slot.last_pos, floor):
        if record.slot_ms != slot.slot_ms:
            raise ChainBroken(
                f"main chain of slot {slot.slot_ms} holds a record of slot {record.slot_ms}",
                pos=pos,
            )
        if record.key_hash == key_hash and not record.is_rolled and not record.is_tombstone:
            return pos
    return None
