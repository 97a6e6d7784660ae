"""Reads of this node's wheel for the admin API: where one timer message stands, and what
falls due when. Any thread; each read of the wheel is made under the machine's lock."""

from __future__ import annotations

from typing import Any

from chronomq.raftlog import record
from chronomq.timer import message as tm
from chronomq.timer.chains import find_message, tombstone_keys
from chronomq.timer.histogram import due_histogram
from chronomq.timer.machine import TimerMachine
from chronomq.timer.slots import SlotGeometry
from chronomq.timer.timerlog import uniq_key_hash
from chronomq.timer.wheel import Slot


def locate(machine: TimerMachine, msg_id: bytes) -> dict[str, Any] | None:
    """Where the timer message ``msg_id`` stands in this node's wheel (any thread, under
    the machine's lock): ``waiting``, ``delivered`` (its slot has been read past it),
    ``cancelled`` or ``unknown`` (not in its slot: rolling, a lap old, or not enqueued
    yet), with its deliver time and, when found, where its stored record is.
    ``None`` when ``msg_id`` is not a timer message id."""
    deliver_ms = tm.timer_id_deliver_ms(msg_id)
    if deliver_ms is None:
        return None
    key_hash = uniq_key_hash(record.msg_id_hex(msg_id))
    with machine.lock:
        committed = machine.committed()
        cursor, floor = committed.cursor, committed.reclaim_pos
        wheel, log_ = machine.files.wheel, machine.files.log
        slot = wheel.get(deliver_ms)
        # Chains are read down to the reclaim position: a message of a slot read long ago
        # whose records were reclaimed is no longer found ("unknown").
        pos = find_message(log_, slot, key_hash, floor) if slot.count else None
        found = None if pos is None else log_.read(pos)
        cancelled = bool(slot.tomb_count) and key_hash in tombstone_keys(log_, slot, floor)
    answer: dict[str, Any] = {"deliver_ms": deliver_ms, "slot_ms": slot.slot_ms}
    if found is not None:
        answer["stored_at"] = [found.cl_offset, found.cl_size]
    if cancelled:
        status = "cancelled"
    elif pos is None:
        status = "unknown"
    elif (
        cursor is None
        or slot.slot_ms > cursor.slot_ms
        or (slot.slot_ms == cursor.slot_ms and not cursor.has_read(pos))
    ):
        status = "waiting"
    else:
        status = "delivered"
    answer["status"] = status
    return answer


def due_view(
    machine: TimerMachine, geometry: SlotGeometry, now_ms: int, span_ms: int, buckets: int
) -> dict[str, Any]:
    """What falls due in the next ``span_ms`` by bucket, from this node's wheel (any
    thread: each slot is read under the machine's lock, so apply waits at most one read).
    See :mod:`chronomq.timer.histogram`."""

    class _Locked:
        def get(self, time_ms: int) -> Slot:
            with machine.lock:
                return machine.files.wheel.get(time_ms)

    cursor = machine.committed().cursor
    hist = due_histogram(
        _Locked(),
        geometry,
        now_ms=now_ms,
        span_ms=span_ms,
        buckets=buckets,
        cursor_slot_ms=None if cursor is None else cursor.slot_ms,
    )
    return {**hist.as_json(), "precision_ms": geometry.precision_ms}
