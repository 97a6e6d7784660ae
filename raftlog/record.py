"""The message record: one message as stored in the CommitLog.

Layout (big-endian, 95-byte fixed header, then three variable parts)::

    0               4               8               12              16
    +---------------+---------------+---------------+---------------+
    | total_size    | magic         | record_crc    | body_crc      |
    +---------------+---------------+---------------+---------------+
    | queue_id      | flag          | queue_offset                  |
    +---------------+---------------+-------------------------------+
    | physical_offset               | sys_flag      | born_ms ...   |
    +-------------------------------+---------------+---------------+
    | ... born_ms   | store_ms                      | reconsume     |
    +---------------+-------------------------------+---------------+
    | tags_code                     | msg_id (16 bytes) ...         |
    +-------------------------------+-------------------------------+
    | ... msg_id                    |tl | pl    | body_len      | topic (tl) | properties (pl) | body
    +-------------------------------+---+-------+---------------+

``tags_code`` is what the message's ConsumeQueue unit carries (a tags hash, or for a delayed
message the time it falls due), kept in the record so ConsumeQueues can be rebuilt from the
CommitLog alone. ``record_crc`` is the CRC32 of bytes ``[12, total_size)``: a torn or flipped record fails it.
``body_crc`` is the CRC32 of the body alone, as in RocketMQ. ``queue_offset`` and
``physical_offset`` are filled in when the record is applied; :func:`seal` writes them and the
record CRC in place. Properties are ``name\\x01value\\x02`` pairs (RocketMQ's encoding), UTF-8.

A *blank* record (magic :data:`BLANK_MAGIC`, 8 bytes of header) fills the end of a segment that
the next record does not fit in.
"""

from __future__ import annotations

import os
import random
import re
import struct
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field

from chronomq.raftlog.errors import InvalidInput, MessageTooLarge, StoreCorruption

MESSAGE_MAGIC = 0xC401_0001
BLANK_MAGIC = 0xC401_BBBB

HEADER = struct.Struct(">IIIIIIQQIQQIq16sBHI")
HEADER_SIZE = HEADER.size  # 95
BLANK = struct.Struct(">II")
BLANK_SIZE = BLANK.size

_QUEUE_OFFSET_AT = 24
_PHYSICAL_OFFSET_AT = 32
_CRC_AT = 8
_CRC_FROM = 12
_TAGS_CODE_AT = 64
_MSG_ID_AT = 72
_TAGS_CODE = struct.Struct(">q")
_OFFSETS = struct.Struct(">QQ")
_CRC = struct.Struct(">I")

MAX_TOPIC_BYTES = 127
MAX_PROPERTIES_BYTES = 32_767
DEFAULT_MAX_MESSAGE_BYTES = 4 * 1024 * 1024
_TOPIC_RE = re.compile(r"[%|a-zA-Z0-9_-]+")

PROPERTY_KEYS = "KEYS"
PROPERTY_TAGS = "TAGS"
_NAME_SEP = "\x01"
_PAIR_SEP = "\x02"


def validate_topic(topic: object, field_name: str = "topic") -> str:
    """Return ``topic`` if it is a legal topic name, else raise :class:`InvalidInput`."""
    if not isinstance(topic, str) or not topic:
        raise InvalidInput("topic must be a non-empty string", field_name)
    if len(topic.encode()) > MAX_TOPIC_BYTES:
        raise InvalidInput(f"topic is longer than {MAX_TOPIC_BYTES} bytes", field_name)
    if not _TOPIC_RE.fullmatch(topic):
        raise InvalidInput(
            "topic may contain only letters, digits and the characters % | _ -", field_name
        )
    return topic


def encode_properties(properties: Mapping[str, str]) -> bytes:
    parts = []
    for name, value in properties.items():
        if not isinstance(name, str) or not isinstance(value, str) or not name:
            raise InvalidInput("property names and values must be strings", "properties")
        if _NAME_SEP in name or _PAIR_SEP in name or _NAME_SEP in value or _PAIR_SEP in value:
            raise InvalidInput(
                f"property {name!r} contains a reserved control character", "properties"
            )
        parts.append(f"{name}{_NAME_SEP}{value}{_PAIR_SEP}")
    data = "".join(parts).encode()
    if len(data) > MAX_PROPERTIES_BYTES:
        raise InvalidInput(
            f"properties take {len(data)} bytes, more than the limit of {MAX_PROPERTIES_BYTES}",
            "properties",
        )
    return data


def decode_properties(data: bytes) -> dict[str, str]:
    if not data:
        return {}
    out: dict[str, str] = {}
    for pair in data.decode().split(_PAIR_SEP):
        if pair:
            name, _, value = pair.partition(_NAME_SEP)
            out[name] = value
    return out


class MessageIdSource:
    """Unique 16-byte message ids: 6 bytes of store time in ms, then 10 random bytes.

    Ids are decided by the leader before proposing and carried in the command, so every
    replica stores the same id. Ids sort roughly by store time. The random part comes from
    the operating system's CSPRNG (``os.urandom``, about half a microsecond an id): a
    generator seeded once could be predicted from the ids a client sees, and an id names a
    message to look up or a timer to cancel. ``seed`` makes a repeatable source for tests.
    """

    __slots__ = ("_rng",)

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed) if seed is not None else None

    def next_id(self, store_ms: int) -> bytes:
        tail = os.urandom(10) if self._rng is None else self._rng.getrandbits(80).to_bytes(10)
        return (store_ms & 0xFFFF_FFFF_FFFF).to_bytes(6, "big") + tail


def msg_id_hex(msg_id: bytes) -> str:
    return msg_id.hex().upper()


def parse_msg_id(text: object, field_name: str = "msg_id") -> bytes:
    if not isinstance(text, str) or len(text) != 32:
        raise InvalidInput("msg_id must be 32 hexadecimal characters", field_name)
    try:
        msg_id = bytes.fromhex(text)
    except ValueError:
        raise InvalidInput("msg_id must be 32 hexadecimal characters", field_name) from None
    if len(msg_id) != 16:  # fromhex skips whitespace
        raise InvalidInput("msg_id must be 32 hexadecimal characters", field_name)
    return msg_id


@dataclass(frozen=True, slots=True)
class Message:
    """A decoded message record."""

    topic: str
    queue_id: int
    queue_offset: int
    physical_offset: int
    msg_id: bytes
    body: bytes
    properties: dict[str, str] = field(default_factory=dict)
    flag: int = 0
    sys_flag: int = 0
    born_ms: int = 0
    store_ms: int = 0
    reconsume_times: int = 0
    tags_code: int = 0
    size: int = 0

    @property
    def msg_id_hex(self) -> str:
        return msg_id_hex(self.msg_id)

    @property
    def tags(self) -> str | None:
        return self.properties.get(PROPERTY_TAGS)

    @property
    def keys(self) -> list[str]:
        keys = self.properties.get(PROPERTY_KEYS)
        return keys.split(" ") if keys else []


def encode(
    *,
    topic: str,
    queue_id: int,
    msg_id: bytes,
    body: bytes,
    properties: bytes | Mapping[str, str] = b"",
    flag: int = 0,
    sys_flag: int = 0,
    born_ms: int = 0,
    store_ms: int = 0,
    reconsume_times: int = 0,
    tags_code: int = 0,
    queue_offset: int = 0,
    physical_offset: int = 0,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
) -> bytearray:
    """Encode a record. Offsets default to 0 and are normally set later by :func:`seal`."""
    topic_bytes = topic.encode()
    props = properties if isinstance(properties, bytes) else encode_properties(properties)
    if len(body) > max_message_bytes:
        raise MessageTooLarge(
            f"body is {len(body)} bytes, more than max_message_bytes {max_message_bytes}", "body"
        )
    if len(msg_id) != 16:
        raise InvalidInput("msg_id must be 16 bytes", "msg_id")
    total = HEADER_SIZE + len(topic_bytes) + len(props) + len(body)
    buf = bytearray(total)
    HEADER.pack_into(
        buf,
        0,
        total,
        MESSAGE_MAGIC,
        0,
        zlib.crc32(body),
        queue_id,
        flag,
        queue_offset,
        physical_offset,
        sys_flag,
        born_ms,
        store_ms,
        reconsume_times,
        tags_code,
        msg_id,
        len(topic_bytes),
        len(props),
        len(body),
    )
    at = HEADER_SIZE
    buf[at : at + len(topic_bytes)] = topic_bytes
    at += len(topic_bytes)
    buf[at : at + len(props)] = props
    at += len(props)
    buf[at:] = body
    seal(buf, 0, queue_offset, physical_offset)
    return buf


def seal(buf: bytearray, at: int, queue_offset: int, physical_offset: int) -> None:
    """Write the two offsets of the record starting at ``buf[at]`` and recompute its CRC."""
    _OFFSETS.pack_into(buf, at + _QUEUE_OFFSET_AT, queue_offset, physical_offset)
    total = int.from_bytes(buf[at : at + 4], "big")
    _CRC.pack_into(buf, at + _CRC_AT, zlib.crc32(memoryview(buf)[at + _CRC_FROM : at + total]))


def tags_code_at(buf: bytes | bytearray, at: int) -> int:
    """The tags_code of the record starting at ``buf[at]``."""
    return int(_TAGS_CODE.unpack_from(buf, at + _TAGS_CODE_AT)[0])


def msg_id_at(buf: bytes | bytearray, at: int) -> bytes:
    """The 16-byte message id of the record starting at ``buf[at]``."""
    return bytes(buf[at + _MSG_ID_AT : at + _MSG_ID_AT + 16])


def blank(size: int) -> bytes:
    """A filler record of exactly ``size`` bytes (at least :data:`BLANK_SIZE`)."""
    if size < BLANK_SIZE:
        raise ValueError(f"a blank record needs {BLANK_SIZE} bytes, got {size}")
    return BLANK.pack(size, BLANK_MAGIC) + bytes(size - BLANK_SIZE)


def peek(data: bytes | bytearray | memoryview, at: int = 0) -> tuple[int, int]:
    """Return ``(total_size, magic)`` of the record at ``at`` without checking it."""
    size, magic = BLANK.unpack_from(data, at)
    return size, magic


def check(data: bytes | bytearray | memoryview, at: int = 0) -> int:
    """Validate the record at ``at``; return its size. Raise :class:`StoreCorruption`."""
    if len(data) - at < BLANK_SIZE:
        raise StoreCorruption(f"record at {at} is cut short: {len(data) - at} bytes left")
    size, magic = BLANK.unpack_from(data, at)
    if magic == BLANK_MAGIC:
        if size < BLANK_SIZE or at + size > len(data):
            raise StoreCorruption(f"blank record at {at} has a bad size {size}")
        return size
    if magic != MESSAGE_MAGIC:
        raise StoreCorruption(f"record at {at} has a bad magic {magic:#x}")
    if size < HEADER_SIZE or at + size > len(data):
        raise StoreCorruption(f"record at {at} has a bad size {size}")
    (crc,) = _CRC.unpack_from(data, at + _CRC_AT)
    if zlib.crc32(memoryview(data)[at + _CRC_FROM : at + size]) != crc:
        raise StoreCorruption(f"record at {at} fails its CRC")
    return size


def decode(data: bytes | bytearray | memoryview, at: int = 0) -> Message:
    """Decode and validate the message record at ``at``."""
    size = check(data, at)
    (
        total,
        magic,
        _crc,
        body_crc,
        queue_id,
        flag,
        queue_offset,
        physical_offset,
        sys_flag,
        born_ms,
        store_ms,
        reconsume_times,
        tags_code,
        msg_id,
        topic_len,
        props_len,
        body_len,
    ) = HEADER.unpack_from(data, at)
    if magic != MESSAGE_MAGIC:
        raise StoreCorruption(f"record at {at} is a blank, not a message")
    if HEADER_SIZE + topic_len + props_len + body_len != total:
        raise StoreCorruption(f"record at {at} has inconsistent lengths")
    view = memoryview(data)
    p = at + HEADER_SIZE
    topic = bytes(view[p : p + topic_len]).decode()
    p += topic_len
    props = decode_properties(bytes(view[p : p + props_len]))
    p += props_len
    body = bytes(view[p : p + body_len])
    if zlib.crc32(body) != body_crc:
        raise StoreCorruption(f"record at {at} fails its body CRC")
    return Message(
        topic=topic,
        queue_id=queue_id,
        queue_offset=queue_offset,
        physical_offset=physical_offset,
        msg_id=bytes(msg_id),
        body=body,
        properties=props,
        flag=flag,
        sys_flag=sys_flag,
        born_ms=born_ms,
        store_ms=store_ms,
        reconsume_times=reconsume_times,
        tags_code=tags_code,
        size=size,
    )


def head(data: bytes | bytearray | memoryview, at: int = 0) -> tuple[bytes, int, dict[str, str]]:
    """``(msg_id, store_ms, properties)`` of the checked record at ``at``, without copying or
    checking its body separately (the record CRC covers it): what a service reading many
    records for their properties needs, at a fraction of :func:`decode`'s cost."""
    size = check(data, at)
    fields = HEADER.unpack_from(data, at)
    if fields[1] != MESSAGE_MAGIC:
        raise StoreCorruption(f"record at {at} is a blank, not a message")
    topic_len, props_len = fields[14], fields[15]
    if HEADER_SIZE + topic_len + props_len + fields[16] != size:
        raise StoreCorruption(f"record at {at} has inconsistent lengths")
    p = at + HEADER_SIZE + topic_len
    return bytes(fields[13]), fields[10], decode_properties(bytes(data[p : p + props_len]))


def retarget(
    data: bytes | bytearray | memoryview,
    at: int = 0,
    *,
    topic: str,
    queue_id: int,
    store_ms: int,
    tags_code: int,
) -> bytearray:
    """A copy of the record at ``at`` for another topic and queue, as when a delayed message
    is delivered: same id, properties, body, flags, born time and reconsume count; a new store
    time and tagsCode. Its offsets are zero until it is placed (:func:`seal`). Copies the
    properties and body as bytes instead of decoding and encoding them."""
    size = check(data, at)
    (_total, magic, _crc, body_crc, _qid, flag, _qoff, _phys, sys_flag, born_ms, _store,
     reconsume, _tags, msg_id, topic_len, props_len, body_len) = HEADER.unpack_from(data, at)  # fmt: skip
    if magic != MESSAGE_MAGIC:
        raise StoreCorruption(f"record at {at} is a blank, not a message")
    topic_bytes = topic.encode()
    if not 0 < len(topic_bytes) <= MAX_TOPIC_BYTES:
        raise InvalidInput(f"topic must be 1..{MAX_TOPIC_BYTES} bytes", "topic")
    tail = memoryview(data)[at + HEADER_SIZE + topic_len : at + size]
    total = HEADER_SIZE + len(topic_bytes) + len(tail)
    buf = bytearray(total)
    HEADER.pack_into(
        buf,
        0,
        total,
        MESSAGE_MAGIC,
        0,
        body_crc,
        queue_id,
        flag,
        0,
        0,
        sys_flag,
        born_ms,
        store_ms,
        reconsume,
        tags_code,
        msg_id,
        len(topic_bytes),
        props_len,
        body_len,
    )
    buf[HEADER_SIZE : HEADER_SIZE + len(topic_bytes)] = topic_bytes
    buf[HEADER_SIZE + len(topic_bytes) :] = tail
    seal(buf, 0, 0, 0)
    return buf
