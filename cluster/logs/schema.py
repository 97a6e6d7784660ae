"""The structured logs every node writes, and that reports read: one place, one version.

Each log line is one JSON object (UTF-8, no newline inside, ``\\n`` at the end)::

    {"v": 1, "t": "<record type>", <fields of that type>...}

``v`` is :data:`SCHEMA_VERSION` of the writer, ``t`` names the record type and also the file the
line lives in (``<dir>/<node>/<t>-<seq>.jsonl``). Optional fields that are unknown are left out,
not written as ``null``. Fields unknown to this version are ignored when reading, so adding a
field is backward compatible; renaming, removing or changing the meaning of a field needs a new
version, and readers refuse lines from a version newer than theirs (:class:`NewerSchemaVersion`).

Record types (all times in milliseconds since the Unix epoch, wall clock of the writing node):

``replication``  one line per committed Raft command *per node*::

    index, term, size_bytes, msg_count, node, apply_ms        always
    propose_ms, commit_ms                                    only on the leader's line

  The report joins the lines of one ``index``: the line carrying ``propose_ms`` is the leader's;
  commit latency is ``commit_ms - propose_ms``, a follower's apply lag is its ``apply_ms`` minus
  the leader's ``commit_ms``.

``latency``  one line per message and stage (``stored``, ``delivered``, ``consumed``)::

    msg_id, topic, kind (plain | level | timer), stage, node  always
    level                                                    iff kind is level (1-based)
    store_ms                                                 required at stage stored
    due_ms                                                   required for level/timer at
                                                             stages stored and delivered
    delivered_ms                                             required at stage delivered
    consumed_ms                                              required at stage consumed

  A stage line may repeat timestamps of earlier stages when the writer knows them; the report
  merges the lines of one ``msg_id`` taking the earliest of each timestamp.

``events``  leader changes, service start/stop, config changes, drill faults, writer drops::

    ts_ms, node, type, detail (a JSON object, possibly empty)

The Python codec (:func:`encode` / :func:`decode`) is here, below the node that writes the
lines; the Spark side (:func:`chronomq.ops.schema.spark_schema`, :func:`chronomq.ops.schema.spark_valid`) applies
the same rules from the same field lists.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeAlias

import orjson

from chronomq.timer.message import REAL_TOPIC, TIMER_OUT_MS

SCHEMA_VERSION = 1
"""Version written by this code, and the newest one it reads."""

MAX_LINE_BYTES = 64 * 1024
"""Longest line a writer produces; a longer line is rejected as corrupt when read."""


class RecordType(enum.StrEnum):
    REPLICATION = "replication"
    LATENCY = "latency"
    EVENTS = "events"


class MessageKind(enum.StrEnum):
    PLAIN = "plain"
    LEVEL = "level"
    TIMER = "timer"


class Stage(enum.StrEnum):
    STORED = "stored"
    DELIVERED = "delivered"
    CONSUMED = "consumed"


class EventType(enum.StrEnum):
    LEADER_CHANGE = "leader_change"
    SERVICE_START = "service_start"
    SERVICE_STOP = "service_stop"
    CONFIG_CHANGE = "config_change"
    DRILL_FAULT = "drill_fault"
    LOG_DROP = "log_drop"


class LogSchemaError(Exception):
    """Base class of the errors of this module."""


class InvalidRecord(LogSchemaError, ValueError):
    """A record built in code breaks the schema: the caller's mistake. ``field`` names it."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class CorruptLine(LogSchemaError):
    """A line read back does not decode: torn write, truncation, bit flip or a foreign file."""

    def __init__(self, reason: str, field: str | None = None) -> None:
        super().__init__(reason if field is None else f"{reason} (field {field!r})")
        self.reason = reason
        self.field = field


class NewerSchemaVersion(LogSchemaError):
    """The line was written by a newer chronomq; this reader cannot know what it means."""

    def __init__(self, version: int, supported: int = SCHEMA_VERSION) -> None:
        super().__init__(
            f"log line has schema version {version}, this chronomq reads up to {supported}; "
            "upgrade chronomq to read these logs"
        )
        self.version = version
        self.supported = supported


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_ms(name: str, value: object, required: bool) -> None:
    if value is None:
        if required:
            raise InvalidRecord(f"{name} is required", name)
        return
    if not _is_int(value) or value < 0:  # type: ignore[operator]
        raise InvalidRecord(f"{name} must be an integer >= 0, got {value!r}", name)


def _check_count(name: str, value: object, minimum: int) -> None:
    if not _is_int(value) or value < minimum:  # type: ignore[operator]
        raise InvalidRecord(f"{name} must be an integer >= {minimum}, got {value!r}", name)


def _check_text(name: str, value: object) -> None:
    if not isinstance(value, str) or not value:
        raise InvalidRecord(f"{name} must be a non-empty string, got {value!r}", name)


@dataclass(frozen=True, slots=True)
class ReplicationRecord:
    """One node's view of one committed Raft command."""

    TYPE: ClassVar[RecordType] = RecordType.REPLICATION

    index: int
    term: int
    size_bytes: int
    msg_count: int
    node: str
    apply_ms: int
    propose_ms: int | None = None
    commit_ms: int | None = None

    def __post_init__(self) -> None:
        _check_count("index", self.index, 1)
        _check_count("term", self.term, 0)
        _check_count("size_bytes", self.size_bytes, 0)
        _check_count("msg_count", self.msg_count, 0)
        _check_text("node", self.node)
        _check_ms("apply_ms", self.apply_ms, True)
        _check_ms("propose_ms", self.propose_ms, False)
        _check_ms("commit_ms", self.commit_ms, False)

    @property
    def is_leader_line(self) -> bool:
        return self.propose_ms is not None


@dataclass(frozen=True, slots=True)
class LatencyRecord:
    """One stage in the life of one message."""

    TYPE: ClassVar[RecordType] = RecordType.LATENCY

    msg_id: str
    topic: str
    kind: MessageKind
    stage: Stage
    node: str
    level: int | None = None
    store_ms: int | None = None
    due_ms: int | None = None
    delivered_ms: int | None = None
    consumed_ms: int | None = None

    def __post_init__(self) -> None:
        _check_text("msg_id", self.msg_id)
        _check_text("topic", self.topic)
        _check_text("node", self.node)
        try:
            object.__setattr__(self, "kind", MessageKind(self.kind))
        except ValueError:
            raise InvalidRecord(f"unknown kind {self.kind!r}", "kind") from None
        try:
            object.__setattr__(self, "stage", Stage(self.stage))
        except ValueError:
            raise InvalidRecord(f"unknown stage {self.stage!r}", "stage") from None
        if self.kind is MessageKind.LEVEL:
            _check_count("level", self.level, 1)
        elif self.level is not None:
            raise InvalidRecord(f"level is only for kind level, not {self.kind}", "level")
        delayed = self.kind is not MessageKind.PLAIN
        _check_ms("store_ms", self.store_ms, self.stage is Stage.STORED)
        _check_ms("due_ms", self.due_ms, delayed and self.stage is not Stage.CONSUMED)
        _check_ms("delivered_ms", self.delivered_ms, self.stage is Stage.DELIVERED)
        _check_ms("consumed_ms", self.consumed_ms, self.stage is Stage.CONSUMED)


JsonValue: TypeAlias = str | int | float | bool | None | list[Any] | dict[str, Any]


@dataclass(frozen=True, slots=True)
class EventRecord:
    """Something an operator will want on the timeline: leader change, service start, fault."""

    TYPE: ClassVar[RecordType] = RecordType.EVENTS

    ts_ms: int
    node: str
    type: EventType
    detail: Mapping[str, JsonValue] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        _check_ms("ts_ms", self.ts_ms, True)
        _check_text("node", self.node)
        try:
            object.__setattr__(self, "type", EventType(self.type))
        except ValueError:
            raise InvalidRecord(f"unknown event type {self.type!r}", "type") from None
        if not isinstance(self.detail, Mapping) or not all(isinstance(k, str) for k in self.detail):
            raise InvalidRecord("detail must be a mapping with string keys", "detail")


Record: TypeAlias = ReplicationRecord | LatencyRecord | EventRecord

RECORD_CLASSES: Mapping[RecordType, type[Record]] = {
    RecordType.REPLICATION: ReplicationRecord,
    RecordType.LATENCY: LatencyRecord,
    RecordType.EVENTS: EventRecord,
}

# Field order on disk (after "v" and "t"). Optional fields are left out when None.
_FIELDS: Mapping[RecordType, tuple[str, ...]] = {
    RecordType.REPLICATION: (
        "index",
        "term",
        "size_bytes",
        "msg_count",
        "node",
        "apply_ms",
        "propose_ms",
        "commit_ms",
    ),
    RecordType.LATENCY: (
        "msg_id",
        "topic",
        "kind",
        "level",
        "stage",
        "node",
        "store_ms",
        "due_ms",
        "delivered_ms",
        "consumed_ms",
    ),
    RecordType.EVENTS: ("ts_ms", "node", "type", "detail"),
}


def field_names(record_type: RecordType) -> tuple[str, ...]:
    """The fields of a record type, in the order they are written (after ``v`` and ``t``)."""
    return _FIELDS[record_type]


def to_dict(record: Record) -> dict[str, JsonValue]:
    """The JSON object of one line, ``v`` and ``t`` first, absent optionals left out."""
    out: dict[str, JsonValue] = {"v": SCHEMA_VERSION, "t": str(record.TYPE)}
    for name in _FIELDS[record.TYPE]:
        value = getattr(record, name)
        if value is None:
            continue
        if isinstance(value, enum.Enum):
            value = value.value
        elif isinstance(value, Mapping):
            value = dict(value)
        out[name] = value
    return out


def encode(record: Record) -> bytes:
    """One log line, with its trailing newline."""
    return orjson.dumps(to_dict(record), option=orjson.OPT_APPEND_NEWLINE)


_LATENCY_HEAD: dict[str, JsonValue] = {"v": SCHEMA_VERSION, "t": RecordType.LATENCY.value}


def latency_line(
    msg_id: str,
    topic: str,
    kind: str,
    stage: str,
    node: str,
    *,
    level: int | None = None,
    store_ms: int | None = None,
    due_ms: int | None = None,
    delivered_ms: int | None = None,
    consumed_ms: int | None = None,
) -> bytes:
    """``encode(LatencyRecord(...))`` without building or checking the record: the same bytes.

    For the nodes' writers, which log every message and whose values come from the broker
    itself; it is a fifth of the cost of the checked path. Give valid values (the rules of
    :class:`LatencyRecord`): nothing is checked here, the tests hold the two paths together.
    """
    out: dict[str, JsonValue] = {
        **_LATENCY_HEAD,
        "msg_id": msg_id,
        "topic": topic,
        "kind": kind,
    }
    if level is not None:
        out["level"] = level
    out["stage"] = stage
    out["node"] = node
    if store_ms is not None:
        out["store_ms"] = store_ms
    if due_ms is not None:
        out["due_ms"] = due_ms
    if delivered_ms is not None:
        out["delivered_ms"] = delivered_ms
    if consumed_ms is not None:
        out["consumed_ms"] = consumed_ms
    return orjson.dumps(out, option=orjson.OPT_APPEND_NEWLINE)


def consumed_line(message: Mapping[str, Any], topic: str, consumed_ms: int, node: str) -> bytes:
    """The ``latency`` line (stage ``consumed``) of one message as a pull answers it.

    A consumer knows less than the broker: a timer message says when it was due
    (``TIMER_OUT_MS``), so it is logged as kind ``timer`` with that ``due_ms``; anything else as
    ``plain``, since a delivered delay-level message no longer says its level. The report takes
    the kind, level, store and due times of each message from the broker's ``stored`` line
    (joining by ``msg_id``, keeping the most specific kind and the earliest times); ``store_ms``
    is only given for a message that never waited, as a delivered one was stored again.
    """
    props = message.get("properties") or {}
    due = props.get(TIMER_OUT_MS)
    if isinstance(due, str) and due.isascii() and due.isdigit():
        kind, due_ms, store_ms = MessageKind.TIMER.value, int(due), None
    else:
        kind, due_ms = MessageKind.PLAIN.value, None
        waited = REAL_TOPIC in props or due is not None
        store_ms = None if waited else message.get("store_ms")
    return latency_line(
        str(message["msg_id"]),
        topic,
        kind,
        Stage.CONSUMED.value,
        node,
        store_ms=store_ms,
        due_ms=due_ms,
        consumed_ms=consumed_ms,
    )


_ID_SLOT = "~msg_id~"


class LatencyLines:
    """Lines of messages alike but for their ``msg_id`` (one produce request): encode once.

    The record is built, and so checked, once with a stand-in id; :meth:`line` splices each id
    into the encoded bytes, the same bytes as ``encode`` gives. Ids of ASCII letters and digits
    (what the broker assigns) are spliced; any other id goes through :func:`encode`.
    """

    __slots__ = ("_record", "_head", "_tail")

    def __init__(
        self,
        topic: str,
        kind: MessageKind | str,
        stage: Stage | str,
        node: str,
        *,
        level: int | None = None,
        store_ms: int | None = None,
        due_ms: int | None = None,
        delivered_ms: int | None = None,
        consumed_ms: int | None = None,
    ) -> None:
        self._record = LatencyRecord(
            _ID_SLOT,
            topic,
            kind,  # type: ignore[arg-type]
            stage,  # type: ignore[arg-type]
            node,
            level=level,
            store_ms=store_ms,
            due_ms=due_ms,
            delivered_ms=delivered_ms,
            consumed_ms=consumed_ms,
        )
        # msg_id is the first field after v and t: its slot is the first match.
        self._head, self._tail = encode(self._record).split(_ID_SLOT.encode(), 1)

    def line(self, msg_id: str) -> bytes:
        if msg_id.isascii() and msg_id.isalnum():
            return b"".join((self._head, msg_id.encode(), self._tail))
        return encode(dataclasses.replace(self._record, msg_id=msg_id))


def decode(line: bytes | str, expect: RecordType | None = None) -> Record:
    """Parse one line (with or without its newline) into a record.

    Raises :class:`NewerSchemaVersion` for a line of a newer version and :class:`CorruptLine`
    for anything else that is wrong, including a line of type other than ``expect``.
    """
    if len(line) > MAX_LINE_BYTES:
        raise CorruptLine(f"line longer than {MAX_LINE_BYTES} bytes")
    try:
        obj = orjson.loads(line)
    except orjson.JSONDecodeError:
        raise CorruptLine("not valid JSON (truncated or damaged line)") from None
    if not isinstance(obj, dict):
        raise CorruptLine("not a JSON object")
    version: Any = obj.get("v")
    if not _is_int(version) or version < 1:
        raise CorruptLine("missing or invalid schema version", "v")
    if version > SCHEMA_VERSION:
        raise NewerSchemaVersion(version)
    type_name: Any = obj.get("t")
    try:
        record_type = RecordType(type_name)
    except ValueError:
        raise CorruptLine(f"unknown record type {obj.get('t')!r}", "t") from None
    if expect is not None and record_type is not expect:
        raise CorruptLine(f"record type {record_type} where {expect} was expected", "t")
    cls = RECORD_CLASSES[record_type]
    kwargs: dict[str, Any] = {name: obj.get(name) for name in _FIELDS[record_type] if name in obj}
    if record_type is RecordType.EVENTS and kwargs.get("detail") is None:
        kwargs["detail"] = {}
    try:
        return cls(**kwargs)
    except InvalidRecord as exc:
        raise CorruptLine(str(exc), exc.field) from None
    except TypeError as exc:  # a required field is missing altogether
        raise CorruptLine(f"missing field: {exc}") from None
