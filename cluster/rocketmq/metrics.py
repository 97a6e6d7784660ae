"""Prometheus metrics of the gRPC endpoint, on the node's registry (served at ``/metrics``).

- ``chronomq_grpc_requests_total{rpc, code}``: calls by RPC and by the protocol's status code
  (``OK``, ``BAD_REQUEST``, ...; ``UNAUTHENTICATED`` for calls refused for their credentials,
  ``CANCELLED`` for calls the client or the node's stop cut short);
- ``chronomq_grpc_request_seconds{rpc}``: latency (a Telemetry stream: how long it stayed open);
- ``chronomq_grpc_messages_received_total``, ``chronomq_grpc_messages_acked_total``: pop
  hand-outs and acks served by this node;
- ``chronomq_grpc_messages_pulled_total``: messages this node answered offset pulls
  (``PullMessage``) with;
- renewal of ``auto_renew`` receives (:mod:`chronomq.cluster.rocketmq.renew`):
  ``chronomq_grpc_auto_renew_tracked`` (hand-outs this node renews now),
  ``chronomq_grpc_auto_renew_renewals_total`` (invisible times renewed),
  ``chronomq_grpc_auto_renew_failures_total{reason}`` (``stale``: refused, the hand-out was
  over; ``error``: not answered, tried again when next due),
  ``chronomq_grpc_auto_renew_stopped_total{reason}`` (why tracking ended: ``acked``,
  ``changed``, ``dlq``, ``stale``, ``client_gone``, ``max_time``, ``dropped`` at
  ``renew_max_tracked``) and ``chronomq_grpc_auto_renew_deferred_total`` (renewals due but
  held back by ``renew_max_per_second``);
- ``chronomq_grpc_telemetry_streams`` (open now) and
  ``chronomq_grpc_telemetry_refused_total{reason}`` (:mod:`chronomq.cluster.rocketmq.streams`);
- messages produced over gRPC also count in ``chronomq_messages_produced``, like HTTP's.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class GrpcMetrics:
    def __init__(self, registry: CollectorRegistry, produced: Counter | None = None) -> None:
        self.requests = Counter(
            "chronomq_grpc_requests",
            "gRPC calls by RPC and status code",
            ["rpc", "code"],
            registry=registry,
        )
        self.latency = Histogram(
            "chronomq_grpc_request_seconds",
            "gRPC call latency",
            ["rpc"],
            buckets=_BUCKETS_S,
            registry=registry,
        )
        self.produced = (
            produced
            if produced is not None
            else Counter(
                "chronomq_grpc_messages_produced", "Messages produced over gRPC", registry=registry
            )
        )

        self.received = Counter(
            "chronomq_grpc_messages_received",
            "Messages handed out to consumers over gRPC (pop)",
            registry=registry,
        )
        self.acked = Counter(
            "chronomq_grpc_messages_acked", "Messages acked over gRPC (pop)", registry=registry
        )
        self.pulled = Counter(
            "chronomq_grpc_messages_pulled",
            "Messages pulled by offset over gRPC (PullMessage)",
            registry=registry,
        )

        self.telemetry_streams = Gauge(
            "chronomq_grpc_telemetry_streams",
            "Telemetry streams open on this node's gRPC endpoint",
            registry=registry,
        )
        self.telemetry_refused = Counter(
            "chronomq_grpc_telemetry_refused",
            "Telemetry streams refused or closed by a cap: client (a client id's oldest, "
            "closed), connection, total, settings (none sent in time)",
            ["reason"],
            registry=registry,
        )

        self.renew_tracked = Gauge(
            "chronomq_grpc_auto_renew_tracked",
            "Messages received with auto_renew whose invisible time this node renews",
            registry=registry,
        )
        self.renewals = Counter(
            "chronomq_grpc_auto_renew_renewals",
            "Invisible times of auto_renew receives renewed by this node",
            registry=registry,
        )
        self.renew_failures = Counter(
            "chronomq_grpc_auto_renew_failures",
            "Renewals that did not renew: stale (the hand-out was over) or error (unanswered)",
            ["reason"],
            registry=registry,
        )
        self.renew_stopped = Counter(
            "chronomq_grpc_auto_renew_stopped",
            "Auto_renew receives this node stopped renewing, by reason",
            ["reason"],
            registry=registry,
        )
        self.renew_deferred = Counter(
            "chronomq_grpc_auto_renew_deferred",
            "Renewals due but held back by renew_max_per_second",
            registry=registry,
        )

    def observe(self, rpc: str, code: str, seconds: float) -> None:
        self.requests.labels(rpc, code).inc()
        self.latency.labels(rpc).observe(seconds)
