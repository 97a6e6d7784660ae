"""Consumer retry through delay levels (seed 001, "延迟消息与消息重试机制的关系")."""

from __future__ import annotations

import pytest

from chronomq.schedule import properties as props
from chronomq.schedule.errors import ConfigError, InvalidRetryRequest
from chronomq.schedule.levels import DelayLevelTable
from chronomq.schedule.retry import (
    MAX_RECONSUME_TIMES_KEY,
    RetryConfig,
    RetryDecision,
    RetryTarget,
    dlq_topic,
    is_dlq_topic,
    is_retry_topic,
    plan_retry,
    retry_topic,
)

DEFAULT = RetryConfig()
SECOND_MS = 1_000
MINUTE_MS = 60 * SECOND_MS


def send_back(
    reconsume_times: int,
    *,
    topic: str = "orders",
    properties: dict[str, str] | None = None,
    config: RetryConfig = DEFAULT,
    requested_level: int = 0,
) -> RetryDecision:
    return plan_retry(
        topic=topic,
        msg_id="MSG-1",
        reconsume_times=reconsume_times,
        properties=properties if properties is not None else {"k": "v"},
        group="billing",
        config=config,
        requested_level=requested_level,
    )


def test_topic_names() -> None:
    assert retry_topic("billing") == "%RETRY%billing"
    assert dlq_topic("billing") == "%DLQ%billing"
    assert is_retry_topic("%RETRY%billing")
    assert is_dlq_topic("%DLQ%billing")
    assert not is_retry_topic("billing")


def test_first_send_back_goes_to_retry_topic_at_level_3() -> None:
    decision = send_back(0)
    assert decision.target is RetryTarget.RETRY
    assert decision.topic == "%RETRY%billing"
    assert decision.queue_id == 0
    assert decision.delay_level == 3
    assert not decision.level_clamped
    assert decision.reconsume_times == 1
    assert dict(decision.properties) == {
        "k": "v",
        props.RETRY_TOPIC: "orders",
        props.ORIGIN_MESSAGE_ID: "MSG-1",
        props.RECONSUME_TIME: "1",
        props.MAX_RECONSUME_TIMES: "16",
    }


def test_sixteen_retries_follow_the_seed_table() -> None:
    """Seed 001's table: retry 1 waits 10s, ..., retry 15 waits 1h, retry 16 waits 2h."""
    expected_minutes = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 20, 30, 60, 120]
    expected_ms = [10 * SECOND_MS, 30 * SECOND_MS] + [m * MINUTE_MS for m in expected_minutes]
    levels = DEFAULT.levels
    for reconsume_times in range(16):
        decision = send_back(reconsume_times)
        assert decision.target is RetryTarget.RETRY
        assert decision.delay_level == 3 + reconsume_times
        assert decision.delay_level is not None
        assert levels.delay_ms(decision.delay_level) == expected_ms[reconsume_times]
        assert decision.reconsume_times == reconsume_times + 1


def test_after_sixteen_retries_the_message_goes_to_the_dlq() -> None:
    decision = send_back(16)
    assert decision.target is RetryTarget.DLQ
    assert decision.topic == "%DLQ%billing"
    assert decision.queue_id == 0
    assert decision.delay_level is None
    assert decision.reconsume_times == 17
    assert decision.properties[props.RECONSUME_TIME] == "17"
    assert send_back(40).target is RetryTarget.DLQ


def test_a_message_sent_back_until_dead_keeps_its_origin() -> None:
    """Follow one message through every send-back, as a consumer would see it."""
    topic, properties, reconsume_times = "orders", {"k": "v"}, 0
    history: list[RetryDecision] = []
    while True:
        decision = plan_retry(
            topic=topic,
            msg_id=f"COPY-{reconsume_times}",
            reconsume_times=reconsume_times,
            properties=properties,
            group="billing",
            config=DEFAULT,
        )
        history.append(decision)
        if decision.target is RetryTarget.DLQ:
            break
        # delivered through the schedule topic, which adds these; then consumed and failed
        topic = decision.topic
        properties = {**decision.properties, props.REAL_TOPIC: topic, props.REAL_QID: "0"}
        reconsume_times = decision.reconsume_times
    assert len(history) == 17
    assert [d.target for d in history].count(RetryTarget.RETRY) == 16
    dead = history[-1]
    assert dead.reconsume_times == 17
    assert dead.properties[props.RETRY_TOPIC] == "orders"
    assert dead.properties[props.ORIGIN_MESSAGE_ID] == "COPY-0"
    assert props.REAL_TOPIC not in dead.properties
    assert props.REAL_QID not in dead.properties


def test_level_is_clamped_to_a_short_table() -> None:
    config = RetryConfig(levels=DelayLevelTable.parse("1s 2s 3s 5s"))
    assert send_back(0, config=config).delay_level == 3
    clamped = send_back(5, config=config)
    assert clamped.delay_level == 4
    assert clamped.level_clamped


def test_custom_max_reconsume_times() -> None:
    config = RetryConfig(max_reconsume_times=2)
    assert send_back(1, config=config).target is RetryTarget.RETRY
    dead = send_back(2, config=config)
    assert dead.target is RetryTarget.DLQ
    assert dead.properties[props.MAX_RECONSUME_TIMES] == "2"
    assert RetryConfig(max_reconsume_times=0).max_reconsume_times == 0
    assert send_back(0, config=RetryConfig(max_reconsume_times=0)).target is RetryTarget.DLQ


def test_requested_level_overrides_and_negative_means_dlq() -> None:
    """RocketMQ's send-back header: delayLevel 0 = 3 + reconsumeTimes, < 0 = straight to DLQ."""
    assert send_back(0, requested_level=1).delay_level == 1
    assert send_back(0, requested_level=99).level_clamped
    assert send_back(0, requested_level=-1).target is RetryTarget.DLQ


def test_schedule_properties_are_dropped_and_schedule_topic_refused() -> None:
    decision = send_back(
        0, properties={props.DELAY: "3", props.REAL_TOPIC: "x", props.REAL_QID: "1", "a": "b"}
    )
    assert set(decision.properties) == {
        "a",
        props.RETRY_TOPIC,
        props.ORIGIN_MESSAGE_ID,
        props.RECONSUME_TIME,
        props.MAX_RECONSUME_TIMES,
    }
    with pytest.raises(InvalidRetryRequest) as caught:
        send_back(0, topic="SCHEDULE_TOPIC_XXXX")
    assert caught.value.field == "topic"


@pytest.mark.parametrize(
    ("group", "fragment"),
    [("", "non-empty"), ("a b", "may contain only"), ("g" * 121, "at most 120")],
)
def test_bad_group_is_a_caller_error(group: str, fragment: str) -> None:
    with pytest.raises(InvalidRetryRequest, match=fragment) as caught:
        plan_retry(
            topic="orders",
            msg_id="M",
            reconsume_times=0,
            properties={},
            group=group,
            config=DEFAULT,
        )
    assert caught.value.field == "group"
    assert caught.value.as_error_body()["error"] == "invalid_retry"


@pytest.mark.parametrize("bad", [-1, True])
def test_bad_reconsume_times_is_a_caller_error(bad: int) -> None:
    with pytest.raises(InvalidRetryRequest) as caught:
        send_back(bad)
    assert caught.value.field == "reconsume_times"


def test_bad_max_reconsume_times_names_the_key() -> None:
    with pytest.raises(ConfigError) as caught:
        RetryConfig(max_reconsume_times=-1)
    assert caught.value.key == MAX_RECONSUME_TIMES_KEY
