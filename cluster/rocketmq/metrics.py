"""Prometheus metrics of the gRPC endpoint, on the node's registry (served at ``/metrics``).

- ``chronomq_grpc_requests_total{rpc, code}``: calls by RPC and by the protocol's status code
  (``OK``, ``BAD_REQUEST``, ...; ``UNAUTHENTICATED`` for calls refused for their credentials,
  ``CANCELLED`` for calls the client or the node's stop cut short);
- ``chronomq_grpc_request_seconds{rpc}``: latency (a Telemetry stream: how long it stayed open);
- ``chronomq_grpc_messages_received_total``, ``chronomq_grpc_messages_acked_total``: pop
  hand-outs and acks served by this node;
- ``chronomq_grpc_messages_pulled_total``: messages this node answered offset pulls
  (``PullMessage``) with;
- messages produced over gRPC also count in ``chronomq_messages_produced``, like HTTP's.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

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

    def observe(self, rpc: str, code: str, seconds: float) -> None:
        self.requests.labels(rpc, code).inc()
        self.latency.labels(rpc).observe(seconds)
