"""Into the schedule topic on produce and back out when due (seed 001, seed 002 section 3)."""

from __future__ import annotations

import pytest

from chronomq.schedule import properties as props
from chronomq.schedule.errors import CorruptScheduleMessage, InvalidDelayLevel
from chronomq.schedule.levels import SCHEDULE_TOPIC, DelayLevelTable
from chronomq.schedule.rewrite import place, restore

TABLE = DelayLevelTable.parse("1s 2s 3s 5s")


def test_level_zero_stays_put() -> None:
    placement = place("orders", 2, 0, {"a": "b"}, TABLE)
    assert (placement.topic, placement.queue_id) == ("orders", 2)
    assert dict(placement.properties) == {"a": "b"}
    assert placement.deliver_ms(1_000) == 1_000


def test_delayed_message_moves_to_schedule_topic() -> None:
    placement = place("orders", 2, 3, {"a": "b"}, TABLE)
    assert placement.topic == SCHEDULE_TOPIC
    assert placement.queue_id == 2
    assert dict(placement.properties) == {
        "a": "b",
        props.REAL_TOPIC: "orders",
        props.REAL_QID: "2",
        props.DELAY: "3",
    }
    assert placement.deliver_ms(1_000) == 4_000
    assert not placement.level.clamped


def test_level_above_max_is_clamped_in_placement() -> None:
    placement = place("orders", 0, 9, {}, TABLE)
    assert placement.queue_id == 3
    assert placement.properties[props.DELAY] == "4"
    assert placement.level.clamped
    assert placement.deliver_ms(0) == 5_000


def test_bad_levels_and_topics_are_refused() -> None:
    with pytest.raises(InvalidDelayLevel):
        place("orders", 0, -1, {}, TABLE)
    with pytest.raises(InvalidDelayLevel) as caught:
        place(SCHEDULE_TOPIC, 0, 1, {}, TABLE)
    assert caught.value.field == "topic"


def test_restore_round_trip() -> None:
    placement = place("orders", 5, 2, {"a": "b"}, TABLE)
    restored = restore(placement.queue_id, placement.properties)
    assert (restored.topic, restored.queue_id, restored.level) == ("orders", 5, 2)
    assert props.DELAY not in restored.properties
    assert restored.properties[props.REAL_TOPIC] == "orders"
    assert restored.properties["a"] == "b"


@pytest.mark.parametrize(
    "properties",
    [
        {props.REAL_QID: "0"},
        {props.REAL_TOPIC: "", props.REAL_QID: "0"},
        {props.REAL_TOPIC: SCHEDULE_TOPIC, props.REAL_QID: "0"},
        {props.REAL_TOPIC: "orders"},
        {props.REAL_TOPIC: "orders", props.REAL_QID: "-1"},
        {props.REAL_TOPIC: "orders", props.REAL_QID: "x"},
    ],
)
def test_restore_refuses_corrupt_messages(properties: dict[str, str]) -> None:
    with pytest.raises(CorruptScheduleMessage):
        restore(0, properties)
