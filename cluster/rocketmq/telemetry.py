"""The server's answer to a client's settings on the ``Telemetry`` stream (no I/O).

A client opens the stream and writes its ``Settings``; the server answers with the settings the
client must use: for a producer the largest body (``max_message_bytes``) and its send retry
policy, for a consumer the long-polling time (bounded by ``max_wait_ms``), the receive batch
size and its redelivery back-off: ``max_reconsume_times`` + 1 deliveries of a message, the
n-th redelivery waiting as long as delay level ``3 + n - 1`` (``message_delay_level``), the
wait a consumer retry through the HTTP API has (:mod:`chronomq.schedule.retry`) and RocketMQ's own
retry schedule. A push consumer sets a failed message's invisible time to it.
"""

from __future__ import annotations

from typing import Final

from google.protobuf import duration_pb2
from rocketmq.grpc_protocol import definition_pb2 as pb

from chronomq.cluster.config.nodeconfig import NodeConfig
from chronomq.schedule.errors import ScheduleError
from chronomq.schedule.levels import DelayLevelTable
from chronomq.schedule.retry import FIRST_RETRY_LEVEL

SEND_MAX_ATTEMPTS: Final = 5
"""Attempts a producer makes per send: enough to outlast a leader election, and safe because a
retried send is stored once (its message id is its idempotency key)."""
SEND_BACKOFF_INITIAL_MS: Final = 100
SEND_BACKOFF_MAX_MS: Final = 2_000
DEFAULT_LONG_POLLING_MS: Final = 20_000
"""RocketMQ proxy's default longest long poll; bounded here by ``max_wait_ms``."""
RECEIVE_BATCH_SIZE: Final = 32
MIN_BACKOFF_MS: Final = 1_000
"""The shortest redelivery back-off told to a consumer: the shortest invisible time."""


def _duration_ms(ms: int) -> duration_pb2.Duration:
    return duration_pb2.Duration(seconds=ms // 1000, nanos=(ms % 1000) * 1_000_000)


def _exponential(max_attempts: int, initial_ms: int, max_ms: int) -> pb.RetryPolicy:
    return pb.RetryPolicy(
        max_attempts=max_attempts,
        exponential_backoff=pb.ExponentialBackoff(
            initial=_duration_ms(initial_ms), max=_duration_ms(max_ms), multiplier=2.0
        ),
    )


def server_settings(config: NodeConfig, client: pb.Settings) -> pb.Settings:
    """What the server tells a client that sent ``client``."""
    out = pb.Settings()
    out.CopyFrom(client)
    out.metric.on = False
    if client.HasField("publishing") or client.client_type == pb.ClientType.PRODUCER:
        out.publishing.max_body_size = int(config.max_message_bytes)
        out.publishing.validate_message_type = True
        out.backoff_policy.CopyFrom(
            _exponential(SEND_MAX_ATTEMPTS, SEND_BACKOFF_INITIAL_MS, SEND_BACKOFF_MAX_MS)
        )
    if client.HasField("subscription"):
        asked = client.subscription.long_polling_timeout
        asked_ms = asked.seconds * 1000 + asked.nanos // 1_000_000
        poll_ms = min(asked_ms or DEFAULT_LONG_POLLING_MS, int(config.max_wait_ms))
        out.subscription.long_polling_timeout.CopyFrom(_duration_ms(poll_ms))
        out.subscription.receive_batch_size = RECEIVE_BATCH_SIZE
        out.subscription.fifo = False
        out.backoff_policy.CopyFrom(consumer_backoff(config))
    return out


def consumer_backoff(config: NodeConfig) -> pb.RetryPolicy:
    """``max_reconsume_times + 1`` attempts; redelivery ``n`` after the delay of level
    ``FIRST_RETRY_LEVEL + n - 1`` (the last level once past it), at least a second."""
    try:
        delays = DelayLevelTable.parse(str(config.message_delay_level)).delays_ms
    except ScheduleError:  # the node refuses to start with a bad table; be safe anyway
        delays = DelayLevelTable.default().delays_ms
    retry = delays[FIRST_RETRY_LEVEL - 1 :] or delays[-1:]
    policy = pb.RetryPolicy(max_attempts=int(config.max_reconsume_times) + 1)
    for ms in retry:
        policy.customized_backoff.next.append(_duration_ms(max(MIN_BACKOFF_MS, ms)))
    return policy
