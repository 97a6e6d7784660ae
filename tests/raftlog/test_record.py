"""The message record: golden bytes both ways, round trips, corruption and bad input."""

from __future__ import annotations

import struct
import zlib

import pytest

from chronomq.raftlog import record
from chronomq.raftlog.errors import InvalidInput, MessageTooLarge, StoreCorruption

GOLDEN_FIELDS = {
    "topic": "orders",
    "queue_id": 3,
    "msg_id": bytes(range(16)),
    "body": b"hello",
    "properties": {"KEYS": "k1 k2", "TAGS": "tagA"},
    "flag": 7,
    "sys_flag": 1,
    "born_ms": 1_700_000_000_000,
    "store_ms": 1_700_000_000_123,
    "reconsume_times": 2,
    "tags_code": 42,
    "queue_offset": 5,
    "physical_offset": 4096,
}

# Laid out field by field as in the module docstring (big-endian).
GOLDEN_HEX = (
    "0000007f"  # total_size 127
    "c4010001"  # magic
    "a8a3d7ba"  # record_crc over [12, 127)
    "3610a686"  # body_crc = crc32(b"hello")
    "00000003"  # queue_id
    "00000007"  # flag
    "0000000000000005"  # queue_offset
    "0000000000001000"  # physical_offset 4096
    "00000001"  # sys_flag
    "0000018bcfe56800"  # born_ms
    "0000018bcfe5687b"  # store_ms
    "00000002"  # reconsume_times
    "000000000000002a"  # tags_code 42
    "000102030405060708090a0b0c0d0e0f"  # msg_id
    "06"  # topic length
    "0015"  # properties length 21
    "00000005"  # body length
    "6f7264657273"  # "orders"
    "4b455953016b31206b3202"  # KEYS \x01 k1 k2 \x02
    "54414753017461674102"  # TAGS \x01 tagA \x02
    "68656c6c6f"  # "hello"
)
GOLDEN = bytes.fromhex(GOLDEN_HEX)


def _sample(**over: object) -> bytearray:
    fields = dict(GOLDEN_FIELDS)
    fields.update(over)
    return record.encode(**fields)  # type: ignore[arg-type]


# ---------------------------------------------------------------------- golden bytes


def test_encode_gives_the_golden_bytes() -> None:
    assert bytes(_sample()) == GOLDEN
    assert len(GOLDEN) == record.HEADER_SIZE + 6 + 21 + 5
    assert record.HEADER_SIZE == 95


def test_golden_crcs_are_what_the_layout_says() -> None:
    assert struct.unpack_from(">I", GOLDEN, 8)[0] == zlib.crc32(GOLDEN[12:])
    assert struct.unpack_from(">I", GOLDEN, 12)[0] == zlib.crc32(b"hello")


def test_decode_of_the_golden_bytes_gives_every_field() -> None:
    msg = record.decode(GOLDEN)
    for name, value in GOLDEN_FIELDS.items():
        assert getattr(msg, name) == value, name
    assert msg.size == len(GOLDEN)
    assert msg.tags == "tagA"
    assert msg.keys == ["k1", "k2"]
    assert msg.msg_id_hex == "000102030405060708090A0B0C0D0E0F"


def test_decode_at_an_offset_inside_a_buffer() -> None:
    buf = b"\xee" * 13 + GOLDEN + b"\xee" * 7
    msg = record.decode(buf, 13)
    assert msg.body == b"hello"
    assert record.check(buf, 13) == len(GOLDEN)
    assert record.tags_code_at(buf, 13) == 42
    assert record.msg_id_at(buf, 13) == bytes(range(16))


# ---------------------------------------------------------------------- round trips


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"queue_id": 0, "flag": 0, "sys_flag": 0, "reconsume_times": 0, "tags_code": 0},
        {"queue_id": 2**32 - 1, "flag": 2**32 - 1, "sys_flag": 2**32 - 1},
        {"queue_offset": 2**64 - 1, "physical_offset": 2**64 - 1},
        {"born_ms": 2**64 - 1, "store_ms": 0, "reconsume_times": 2**32 - 1},
        {"tags_code": -(2**63)},
        {"tags_code": 2**63 - 1},
        {"body": b""},
        {"body": bytes(range(256)) * 40},
        {"topic": "%RETRY%group|x_y-z", "properties": {}},
        {"topic": "t" * record.MAX_TOPIC_BYTES},
        {"properties": {"ünï": "cödé ✓", "EMPTY": ""}},
    ],
)
def test_every_field_round_trips(fields: dict[str, object]) -> None:
    expect = dict(GOLDEN_FIELDS)
    expect.update(fields)
    data = _sample(**fields)
    msg = record.decode(bytes(data))
    for name, value in expect.items():
        assert getattr(msg, name) == value, name
    assert msg.size == len(data)


def test_seal_rewrites_offsets_and_crc() -> None:
    data = _sample(queue_offset=0, physical_offset=0)
    record.seal(data, 0, 77, 123_456)
    msg = record.decode(data)
    assert (msg.queue_offset, msg.physical_offset) == (77, 123_456)
    # A sealed record inside a larger buffer.
    buf = bytearray(b"\x00" * 5) + _sample()
    record.seal(buf, 5, 9, 10)
    assert record.decode(buf, 5).queue_offset == 9


def test_properties_encoding() -> None:
    assert record.encode_properties({}) == b""
    assert record.encode_properties({"a": "1", "b": ""}) == b"a\x011\x02b\x01\x02"
    assert record.decode_properties(b"a\x011\x02b\x01\x02") == {"a": "1", "b": ""}
    assert record.decode_properties(b"") == {}
    props = {"REAL_TOPIC": "orders", "DELAY": "3", "ключ": "значение"}
    assert record.decode_properties(record.encode_properties(props)) == props
    # Bytes are passed through as already encoded.
    data = record.encode(
        topic="t", queue_id=0, msg_id=bytes(16), body=b"", properties=b"x\x01y\x02"
    )
    assert record.decode(data).properties == {"x": "y"}


def test_message_without_keys_or_tags() -> None:
    msg = record.decode(_sample(properties={}))
    assert msg.tags is None
    assert msg.keys == []


# ---------------------------------------------------------------------- blanks


def test_blank_records() -> None:
    blank = record.blank(8)
    assert blank == bytes.fromhex("00000008c401bbbb")
    assert record.check(blank) == 8
    big = record.blank(1000)
    assert len(big) == 1000
    assert record.peek(big) == (1000, record.BLANK_MAGIC)
    assert record.check(big) == 1000
    with pytest.raises(ValueError):
        record.blank(record.BLANK_SIZE - 1)
    with pytest.raises(StoreCorruption, match="blank"):
        record.decode(big)


def test_blank_with_bad_size_is_corrupt() -> None:
    with pytest.raises(StoreCorruption):
        record.check(record.blank(100)[:50])
    with pytest.raises(StoreCorruption):
        record.check(struct.pack(">II", 4, record.BLANK_MAGIC))


# ---------------------------------------------------------------------- corruption


@pytest.mark.parametrize("at", range(len(GOLDEN)))
def test_any_flipped_byte_is_found(at: int) -> None:
    data = bytearray(GOLDEN)
    data[at] ^= 0x40
    with pytest.raises(StoreCorruption):
        record.decode(bytes(data))


@pytest.mark.parametrize("keep", [0, 3, 7, 8, 50, 94, 95, 100, len(GOLDEN) - 1])
def test_truncated_record_is_corrupt(keep: int) -> None:
    with pytest.raises(StoreCorruption):
        record.decode(GOLDEN[:keep])


def test_flipped_body_with_a_recomputed_record_crc_fails_the_body_crc() -> None:
    data = bytearray(GOLDEN)
    data[-1] ^= 1
    record.seal(data, 0, 5, 4096)  # record CRC made valid again
    assert record.check(data) == len(data)
    with pytest.raises(StoreCorruption, match="body CRC"):
        record.decode(data)


def test_inconsistent_lengths_are_corrupt() -> None:
    data = bytearray(GOLDEN)
    data[88] = 7  # topic length one more than written
    record.seal(data, 0, 5, 4096)
    with pytest.raises(StoreCorruption, match="inconsistent"):
        record.decode(data)


def test_zeros_are_not_a_record() -> None:
    with pytest.raises(StoreCorruption, match="magic"):
        record.check(bytes(200))


# ---------------------------------------------------------------------- bad input


def test_body_over_max_message_bytes() -> None:
    record.encode(topic="t", queue_id=0, msg_id=bytes(16), body=b"x" * 100, max_message_bytes=100)
    with pytest.raises(MessageTooLarge) as err:
        record.encode(
            topic="t", queue_id=0, msg_id=bytes(16), body=b"x" * 101, max_message_bytes=100
        )
    assert err.value.field == "body"
    assert err.value.code == "message_too_large"
    assert isinstance(err.value, InvalidInput)


def test_default_max_message_is_4_mib() -> None:
    body = b"x" * (4 * 1024 * 1024 + 1)
    with pytest.raises(MessageTooLarge):
        record.encode(topic="t", queue_id=0, msg_id=bytes(16), body=body)


def test_msg_id_must_be_16_bytes() -> None:
    with pytest.raises(InvalidInput) as err:
        record.encode(topic="t", queue_id=0, msg_id=bytes(15), body=b"")
    assert err.value.field == "msg_id"


@pytest.mark.parametrize("topic", ["a", "Orders_2024-x", "%RETRY%g", "%DLQ%g", "a|b", "t" * 127])
def test_legal_topics(topic: str) -> None:
    assert record.validate_topic(topic) == topic


@pytest.mark.parametrize(
    ("topic", "message"),
    [
        ("", "non-empty"),
        (None, "non-empty"),
        (12, "non-empty"),
        ("t" * 128, "longer than 127"),
        ("é" * 64, "longer than 127"),  # 128 bytes in UTF-8
        ("has space", "only letters"),
        ("a/b", "only letters"),
        ("a.b", "only letters"),
        ("dé", "only letters"),
        ("tab\t", "only letters"),
        ("trailing\n", "only letters"),
        ("nul\x00", "only letters"),
    ],
)
def test_illegal_topics(topic: object, message: str) -> None:
    with pytest.raises(InvalidInput, match=message) as err:
        record.validate_topic(topic, "messages[0].topic")
    assert err.value.field == "messages[0].topic"


def test_properties_over_the_limit() -> None:
    # name + \x01 + value + \x02 = exactly the limit: accepted.
    value = "v" * (record.MAX_PROPERTIES_BYTES - 3)
    assert len(record.encode_properties({"n": value})) == record.MAX_PROPERTIES_BYTES
    with pytest.raises(InvalidInput, match="properties take") as err:
        record.encode_properties({"n": value + "v"})
    assert err.value.field == "properties"
    with pytest.raises(InvalidInput):
        record.encode(
            topic="t",
            queue_id=0,
            msg_id=bytes(16),
            body=b"",
            properties={f"k{i}": "x" * 100 for i in range(400)},
        )


@pytest.mark.parametrize(
    "props",
    [
        {"a\x01b": "v"},
        {"a\x02b": "v"},
        {"n": "v\x01"},
        {"n": "v\x02w"},
        {"": "v"},
        {"n": 3},
        {5: "v"},
    ],
)
def test_bad_properties(props: dict[object, object]) -> None:
    with pytest.raises(InvalidInput) as err:
        record.encode_properties(props)  # type: ignore[arg-type]
    assert err.value.field == "properties"


# ---------------------------------------------------------------------- message ids


def test_msg_ids_are_unique_and_well_formed() -> None:
    source = record.MessageIdSource()
    ids = [source.next_id(1_700_000_000_000 + i % 3) for i in range(20_000)]
    assert len(set(ids)) == len(ids)
    assert all(len(i) == 16 for i in ids)
    text = record.msg_id_hex(ids[0])
    assert len(text) == 32
    assert text == text.upper()
    assert int(text, 16) >= 0
    assert record.parse_msg_id(text) == ids[0]
    assert record.parse_msg_id(text.lower()) == ids[0]


def test_msg_id_starts_with_store_time() -> None:
    msg_id = record.MessageIdSource(seed=1).next_id(0x0102_0304_0506)
    assert msg_id[:6] == bytes.fromhex("010203040506")


def test_seeded_msg_id_source_repeats() -> None:
    a = record.MessageIdSource(seed=7)
    b = record.MessageIdSource(seed=7)
    assert [a.next_id(5) for _ in range(10)] == [b.next_id(5) for _ in range(10)]


def test_two_unseeded_sources_differ() -> None:
    assert record.MessageIdSource().next_id(1) != record.MessageIdSource().next_id(1)


@pytest.mark.parametrize(
    "text",
    [
        None,
        123,
        b"00" * 16,
        "",
        "0" * 31,
        "0" * 33,
        "g" * 32,
        "0" * 30 + "zz",
        " " * 32,  # fromhex would skip the spaces
        "00 11 22 33 44 55 66 77 88 99 aa",
        "0" * 30 + "\n\n",
    ],
)
def test_parse_msg_id_rejects(text: object) -> None:
    with pytest.raises(InvalidInput) as err:
        record.parse_msg_id(text, "id")
    assert err.value.field == "id"


def test_the_random_part_of_an_id_comes_from_the_os_csprng(monkeypatch: pytest.MonkeyPatch) -> None:
    """Not from a generator seeded once, whose state the ids a client sees would give away."""
    monkeypatch.setattr(record.os, "urandom", lambda n: bytes(range(1, n + 1)))
    assert record.MessageIdSource().next_id(0)[6:] == bytes(range(1, 11))
