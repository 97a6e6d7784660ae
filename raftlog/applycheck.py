"""The rules a committed ``APPEND`` command must keep before apply touches anything.

Apply is total (DESIGN.md): whatever bytes were committed, every replica reaches the same
outcome without raising. The leader's edge validates, but a committed command may also come
from an older node, another edge or a bug, so apply checks again, here, with pure functions of
the command and the store's replicated tables (never a clock, never a local file):

* :func:`check_command`: the command's tables agree with one another and with its blob
  (counts, indexes, sizes, topic names, queue ids, kv values). A command that fails is rejected
  whole: none of its batches is applied.
* :func:`check_batch`: each record of one batch is a well-formed message record for the topic
  and queue the table names (so a ConsumeQueue rebuilt from the CommitLog matches), fits a
  segment, and keeps the rules registered for its topic (:data:`RecordRule`, e.g. the timer's
  and the delay levels' properties). A batch that fails is rejected alone, its outcome naming
  the field (``messages[i].properties.REAL_TOPIC``).

Topic names are the only names that become paths (ConsumeQueue directories), and every one
that reaches the store passes :func:`chronomq.raftlog.record.validate_topic` here first.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from chronomq.raftlog import command as cmdcodec
from chronomq.raftlog import record
from chronomq.raftlog.errors import InvalidInput

#: Most queues a topic may have (as :meth:`chronomq.raftlog.node.RaftLog.create_topic` allows).
MAX_QUEUES = 1024
#: Longest batch key and kv key.
MAX_KEY_CHARS = 1024
#: Longest kv string value.
MAX_VALUE_CHARS = 4096
_I64 = (-(1 << 63), (1 << 63) - 1)

Problem = tuple[str, str]
"""(what is wrong, the field it is in)."""


@dataclass(frozen=True, slots=True)
class RecordFacts:
    """What a :data:`RecordRule` sees of one record being applied."""

    topic: str
    queue_id: int
    tags_code: int
    store_ms: int
    properties: Mapping[str, str]
    #: The command's propose time (the leader's clock): the only "now" a rule may use.
    propose_ms: int


QueueCount = Callable[[str], "int | None"]
RecordRule = Callable[[RecordFacts, QueueCount], "Problem | None"]
"""A check for records of one topic: ``(problem, field)`` or None. ``field`` is relative to
the message (``properties.REAL_TOPIC``). Must be a pure function of its arguments: it runs in
apply on every replica."""


def _scalar_ok(value: object) -> bool:
    if value is None:
        return True
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return _I64[0] <= value <= _I64[1]
    return isinstance(value, str) and len(value) <= MAX_VALUE_CHARS


def _table_ok(table: object, name: str) -> str | None:
    if table is None:
        return None
    if not isinstance(table, Mapping):
        return f"{name} is not an object"
    for k, v in table.items():
        if not isinstance(k, str) or not 0 < len(k) <= MAX_KEY_CHARS:
            return f"{name} has a key that is not a string of 1..{MAX_KEY_CHARS} characters"
        if not _scalar_ok(v):
            return f"{name}[{k!r}] is not an integer, a string or null"
    return None


def _topic_ok(topic: object) -> bool:
    try:
        record.validate_topic(topic)
    except InvalidInput:
        return False
    return True


def check_command(cmd: cmdcodec.Command, max_record_bytes: int) -> str | None:
    """Why the tables of an ``APPEND`` command do not hold together, or None."""
    if isinstance(cmd.propose_ms, bool) or not isinstance(cmd.propose_ms, int):
        return "propose time is not an integer"
    if not _I64[0] <= cmd.propose_ms <= _I64[1]:
        return "propose time is out of range"
    for i, t in enumerate(cmd.topics):
        if not _topic_ok(t):
            return f"topic {i} ({str(t)[:40]!r}) is not a legal topic name"
    total = 0
    for b in cmd.batches:
        if not isinstance(b.key, str) or not 0 < len(b.key) <= MAX_KEY_CHARS:
            return f"a batch key is not a string of 1..{MAX_KEY_CHARS} characters"
        if isinstance(b.count, bool) or not isinstance(b.count, int) or b.count < 0:
            return f"batch {b.key[:40]!r} has a bad message count"
        total += b.count
        problem = _table_ok(b.expect, "expect") or _table_ok(b.updates, "updates")
        if problem is not None:
            return f"batch {b.key[:40]!r}: {problem}"
        if b.creates is not None:
            if not isinstance(b.creates, Mapping):
                return f"batch {b.key[:40]!r}: creates is not an object"
            for topic, n in b.creates.items():
                if not _topic_ok(topic):
                    return (
                        f"batch {b.key[:40]!r} creates {str(topic)[:40]!r}, not a legal topic name"
                    )
                if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_QUEUES:
                    return f"batch {b.key[:40]!r} creates {topic} with {n!r} queues, not 1..{MAX_QUEUES}"
    if total != len(cmd.messages):
        return f"batches count {total} messages, the table has {len(cmd.messages)}"
    size_sum = 0
    for j, m in enumerate(cmd.messages):
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in m):
            return f"message {j} has a non-integer entry"
        tidx, qid, size = m
        if not 0 <= tidx < len(cmd.topics):
            return f"message {j} names topic index {tidx} of {len(cmd.topics)}"
        if not 0 <= qid < MAX_QUEUES:
            return f"message {j} names queue {qid}, not 0..{MAX_QUEUES - 1}"
        if not record.HEADER_SIZE <= size <= max_record_bytes:
            return f"message {j} is {size} bytes, not {record.HEADER_SIZE}..{max_record_bytes}"
        size_sum += size
    if size_sum != len(cmd.blob):
        return f"message sizes add up to {size_sum} bytes, the blob has {len(cmd.blob)}"
    return None


def check_record(blob: bytes, at: int, size: int, topic: str, queue_id: int) -> Problem | None:
    """Whether ``blob[at:at+size]`` is a message record for ``topic``/``queue_id``."""
    (total, magic, _crc, body_crc, qid, _flag, _qoff, _phys, _sys, _born, _store, _re,
     _tags, _id, tlen, plen, blen) = record.HEADER.unpack_from(blob, at)  # fmt: skip
    if magic != record.MESSAGE_MAGIC:
        return f"record has magic {magic:#x}, not a message's", ""
    if total != size or record.HEADER_SIZE + tlen + plen + blen != size:
        return "record lengths do not add up to its size", ""
    p = at + record.HEADER_SIZE
    if blob[p : p + tlen] != topic.encode():
        return f"record is for another topic than {topic}", "topic"
    if qid != queue_id:
        return f"record is for queue {qid}, the command says {queue_id}", "queue"
    props_at = p + tlen
    try:
        blob[props_at : props_at + plen].decode()
    except UnicodeDecodeError:
        return "properties are not UTF-8", "properties"
    body_at = props_at + plen
    if zlib.crc32(blob[body_at : body_at + blen]) != body_crc:
        return "body does not match its CRC", "body"
    return None


def check_batch(
    blob: bytes,
    start_byte: int,
    span: tuple[tuple[int, int, int], ...],
    topics: tuple[str, ...],
    queue_count: QueueCount,
    rules: Mapping[str, RecordRule],
    propose_ms: int,
) -> Problem | None:
    """The first record of one batch that breaks a rule, as ``(problem, field)``; the field
    is ``messages[i]...`` with ``i`` the record's place in the batch."""
    at = start_byte
    for i, (tidx, qid, size) in enumerate(span):
        topic = topics[tidx]
        f = f"messages[{i}]"
        queues = queue_count(topic)
        if queues is None:
            return f"topic {topic} does not exist", f"{f}.topic"
        if qid >= queues:
            return f"topic {topic} has no queue {qid}", f"{f}.queue"
        problem = check_record(blob, at, size, topic, qid)
        if problem is None:
            rule = rules.get(topic)
            if rule is not None:
                problem = _apply_rule(rule, blob, at, topic, qid, propose_ms, queue_count)
        if problem is not None:
            what, where = problem
            return f"{what}", f"{f}.{where}" if where else f
        at += size
    return None


def _apply_rule(
    rule: RecordRule,
    blob: bytes,
    at: int,
    topic: str,
    queue_id: int,
    propose_ms: int,
    queue_count: QueueCount,
) -> Problem | None:
    fields = record.HEADER.unpack_from(blob, at)
    tlen, plen = fields[14], fields[15]
    p = at + record.HEADER_SIZE + tlen
    props = record.decode_properties(blob[p : p + plen])
    facts = RecordFacts(topic, queue_id, fields[12], fields[10], props, propose_ms)
    return rule(facts, queue_count)
