"""The delay level table: parsing ``message_delay_level``, clamping, deliver times, queue ids."""

from __future__ import annotations

import pytest

from chronomq.schedule.errors import CallerError, ConfigError, InvalidDelayLevel
from chronomq.schedule.levels import (
    CONFIG_KEY,
    DEFAULT_MESSAGE_DELAY_LEVEL,
    MAX_LEVELS,
    SCHEDULE_TOPIC,
    DelayLevelTable,
    format_delay,
    is_schedule_topic,
)

SECOND_MS = 1_000
MINUTE_MS = 60 * SECOND_MS
HOUR_MS = 60 * MINUTE_MS
DAY_MS = 24 * HOUR_MS


def test_default_table_is_rocketmq_18_levels() -> None:
    """Seed 001: ``messageDelayLevel=1s 5s 10s 30s 1m 2m ... 1h 2h``."""
    table = DelayLevelTable.default()
    assert table.max_level == 18
    assert table.delays_ms[:4] == (1 * SECOND_MS, 5 * SECOND_MS, 10 * SECOND_MS, 30 * SECOND_MS)
    assert table.delays_ms[4:14] == tuple(n * MINUTE_MS for n in range(1, 11))
    assert table.delays_ms[14:] == (20 * MINUTE_MS, 30 * MINUTE_MS, HOUR_MS, 2 * HOUR_MS)
    assert table.text() == DEFAULT_MESSAGE_DELAY_LEVEL
    assert list(table.levels()) == list(range(1, 19))


@pytest.mark.parametrize(
    ("text", "delay_ms"),
    [
        ("7s", 7 * SECOND_MS),
        ("3m", 3 * MINUTE_MS),
        ("2h", 2 * HOUR_MS),
        ("1d", DAY_MS),
        ("90s", 90 * SECOND_MS),
    ],
)
def test_every_unit(text: str, delay_ms: int) -> None:
    assert DelayLevelTable.parse(text).delays_ms == (delay_ms,)


def test_whitespace_is_flexible() -> None:
    table = DelayLevelTable.parse("  1s\t2s\n 3s   5s ")
    assert table.delays_ms == (1_000, 2_000, 3_000, 5_000)


def test_delays_need_not_increase() -> None:
    """RocketMQ does not require increasing delays; the last level is the maximum level."""
    table = DelayLevelTable.parse("10s 1s")
    assert table.max_level == 2
    assert table.resolve(9).delay_ms == 1_000


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("", "is empty"),
        ("   ", "is empty"),
        ("1s 5x", "unknown unit 'x'"),
        ("1S", "unknown unit 'S'"),
        ("10", "has no unit"),
        ("0s", "non-positive"),
        ("1s 0m", "level 2 has a non-positive delay"),
        ("-1s", "whole number"),
        ("1.5s", "whole number"),
        ("s", "whole number"),
        ("1ms", "whole number"),
        ("1s 5s 1s", "level 3 repeats the delay of level 1"),
        ("60s 1m", "level 2 repeats the delay of level 1"),
        ("366d", "longer than 365d"),
    ],
)
def test_bad_tables_name_the_key(text: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as caught:
        DelayLevelTable.parse(text)
    assert caught.value.key == CONFIG_KEY
    assert str(caught.value).startswith("message_delay_level: ")
    assert fragment in str(caught.value)


def test_too_many_levels() -> None:
    text = " ".join(f"{n}s" for n in range(1, MAX_LEVELS + 2))
    with pytest.raises(ConfigError, match="at most 256"):
        DelayLevelTable.parse(text)


def test_direct_construction_is_validated() -> None:
    with pytest.raises(ConfigError, match="whole seconds"):
        DelayLevelTable((1_500,))
    with pytest.raises(ConfigError, match="is empty"):
        DelayLevelTable(())


def test_level_zero_means_no_delay() -> None:
    resolved = DelayLevelTable.default().resolve(0)
    assert (resolved.level, resolved.delay_ms, resolved.clamped) == (0, 0, False)
    assert not resolved.is_delayed


def test_levels_in_range_are_not_clamped() -> None:
    table = DelayLevelTable.default()
    resolved = table.resolve(3)
    assert (resolved.requested, resolved.level, resolved.delay_ms) == (3, 3, 10 * SECOND_MS)
    assert not resolved.clamped
    assert table.resolve(18).delay_ms == 2 * HOUR_MS


@pytest.mark.parametrize("requested", [19, 100, 2**40])
def test_level_above_max_is_clamped_and_says_so(requested: int) -> None:
    """Seed 001: "如果设置的延迟级别超过最大值,则会自动设置成最大值"."""
    resolved = DelayLevelTable.default().resolve(requested)
    assert resolved.requested == requested
    assert resolved.level == 18
    assert resolved.delay_ms == 2 * HOUR_MS
    assert resolved.clamped


@pytest.mark.parametrize("bad", [-1, -100])
def test_negative_level_is_a_caller_error(bad: int) -> None:
    with pytest.raises(InvalidDelayLevel) as caught:
        DelayLevelTable.default().resolve(bad)
    assert caught.value.field == "delay_level"
    assert caught.value.as_error_body() == {
        "error": "invalid_delay_level",
        "message": caught.value.message,
        "field": "delay_level",
    }


@pytest.mark.parametrize("bad", [1.5, 2.0, "3", None, True])
def test_non_integer_level_is_a_caller_error(bad: object) -> None:
    with pytest.raises(CallerError, match="must be an integer"):
        DelayLevelTable.default().resolve(bad)


def test_deliver_time_is_store_time_plus_delay() -> None:
    """Seed 001: "投递时间 = 存储消息的时间 + 延迟时间"."""
    table = DelayLevelTable.parse("1s 2s 3s 5s")
    store_ms = 1_700_000_000_123
    assert table.deliver_ms(store_ms, 0) == store_ms
    assert table.deliver_ms(store_ms, 1) == store_ms + 1_000
    assert table.deliver_ms(store_ms, 4) == store_ms + 5_000
    assert table.deliver_ms(store_ms, 9) == store_ms + 5_000  # clamped to level 4


def test_delay_of_existing_levels() -> None:
    table = DelayLevelTable.parse("1s 2s")
    assert table.delay_ms(0) == 0
    assert table.delay_ms(2) == 2_000
    with pytest.raises(InvalidDelayLevel):
        table.delay_ms(3)


def test_queue_id_maps_both_ways() -> None:
    """Seed 001/002: queueId = delayLevel - 1."""
    table = DelayLevelTable.default()
    for level in table.levels():
        assert table.queue_id(level) == level - 1
        assert table.level_of_queue(level - 1) == level
    for bad_level in (0, 19, -1):
        with pytest.raises(InvalidDelayLevel):
            table.queue_id(bad_level)
    for bad_queue in (-1, 18):
        with pytest.raises(InvalidDelayLevel):
            table.level_of_queue(bad_queue)


def test_schedule_topic_name() -> None:
    assert SCHEDULE_TOPIC == "SCHEDULE_TOPIC_XXXX"
    assert is_schedule_topic("SCHEDULE_TOPIC_XXXX")
    assert not is_schedule_topic("orders")


def test_format_delay_picks_largest_exact_unit() -> None:
    assert format_delay(2 * DAY_MS) == "2d"
    assert format_delay(25 * HOUR_MS) == "25h"
    assert format_delay(90 * MINUTE_MS) == "90m"
    assert format_delay(61 * SECOND_MS) == "61s"
    with pytest.raises(ValueError):
        format_delay(1_500)


def test_text_round_trips() -> None:
    text = "1s 2s 3s 5s 1m 1h 1d"
    assert DelayLevelTable.parse(DelayLevelTable.parse(text).text()).text() == text
