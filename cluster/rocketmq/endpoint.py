"""The grpcio asyncio server of a node: bound, limited, authenticated, started and stopped with
the node on the HTTP API's event loop.

Limits: a received message at most ``max_message_bytes`` plus :data:`HEADROOM_BYTES` (properties,
keys, several messages of one send); a sent one at most the larger of ``max_pull_bytes`` and
``max_message_bytes``, plus the headroom; ``grpc_max_concurrent_streams`` calls per connection;
keepalive pings every :data:`KEEPALIVE_TIME_MS` so a vanished client's streams are closed, and
client pings at most every :data:`MIN_CLIENT_PING_MS`. The port is never shared
(``SO_REUSEPORT`` off), so a second process on it fails to start instead of splitting calls.

With ``tls_cert_file`` and ``tls_key_file`` the endpoint speaks TLS only (the HTTP API's
certificate); with ``auth_token`` every call needs it (:mod:`chronomq.cluster.rocketmq.credentials`),
else the call fails with gRPC's ``UNAUTHENTICATED`` before its handler runs.

The renewal of ``auto_renew`` receives (:mod:`chronomq.cluster.rocketmq.autorenew`) starts
with the server and stops before it.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any, Final

import grpc
from prometheus_client import CollectorRegistry, Counter
from rocketmq.grpc_protocol import service_pb2_grpc as spb_grpc

from chronomq.cluster.config.nodeconfig import ConfigError, NodeConfig
from chronomq.cluster.node.broker import Broker
from chronomq.cluster.rocketmq.credentials import Clock, GrpcCredentials, call_is_authorized
from chronomq.cluster.rocketmq.metrics import GrpcMetrics
from chronomq.cluster.rocketmq.service import MessagingService

log = logging.getLogger(__name__)

HEADROOM_BYTES: Final = 1024 * 1024
KEEPALIVE_TIME_MS: Final = 60_000
KEEPALIVE_TIMEOUT_MS: Final = 20_000
MIN_CLIENT_PING_MS: Final = 10_000
STOP_GRACE_S: Final = 1.0
"""In-flight unary calls get this long to finish when the node stops; open streams are cut."""
MAX_CONCURRENT_RPCS: Final = 10_000
"""Calls in progress on the whole endpoint (Telemetry streams included); beyond, a call fails
with gRPC's RESOURCE_EXHAUSTED."""


def server_options(config: NodeConfig) -> list[tuple[str, Any]]:
    receive = int(config.max_message_bytes) + HEADROOM_BYTES
    send = max(int(config.max_pull_bytes), int(config.max_message_bytes)) + HEADROOM_BYTES
    return [
        ("grpc.so_reuseport", 0),
        ("grpc.max_receive_message_length", receive),
        ("grpc.max_send_message_length", send),
        ("grpc.max_concurrent_streams", int(config.grpc_max_concurrent_streams)),
        ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", MIN_CLIENT_PING_MS),
        ("grpc.http2.max_ping_strikes", 2),
    ]


def _credentials(config: NodeConfig) -> grpc.ServerCredentials | None:
    if not config.tls_cert_file:
        return None
    blobs = []
    for key in ("tls_key_file", "tls_cert_file"):
        path = getattr(config, key)
        try:
            with open(path, "rb") as f:
                blobs.append(f.read())
        except OSError as exc:
            raise ConfigError(key, f"cannot read {path}: {exc.strerror or exc}") from None
    return grpc.ssl_server_credentials([(blobs[0], blobs[1])])


def _method_name(full: str) -> str:
    return full.rpartition("/")[2] or full


class _AuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses a call without the token before its handler runs (and counts it)."""

    def __init__(self, creds: GrpcCredentials, metrics: GrpcMetrics) -> None:
        self._creds = creds
        self._metrics = metrics

    async def intercept_service(
        self,
        continuation: Callable[[Any], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(details)
        if handler is None or call_is_authorized(
            details.invocation_metadata, self._creds, Clock.read()
        ):
            return handler
        self._metrics.observe(_method_name(details.method), "UNAUTHENTICATED", 0.0)
        message = (
            "this node needs its auth_token: metadata 'authorization: Bearer <token>', or a "
            "RocketMQ client's credentials with the token as secret key"
        )

        async def deny(request: Any, context: grpc.aio.ServicerContext) -> None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

        kinds = {
            (False, False): grpc.unary_unary_rpc_method_handler,
            (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler,
        }
        make = kinds[(bool(handler.request_streaming), bool(handler.response_streaming))]
        result: grpc.RpcMethodHandler = make(
            deny,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
        return result


class GrpcEndpoint:
    """``await start()`` on the node's loop once the broker runs; ``await stop()`` before it
    stops."""

    def __init__(
        self, broker: Broker, registry: CollectorRegistry, produced: Counter | None = None
    ) -> None:
        self.broker = broker
        self.config = broker.config
        self.metrics = GrpcMetrics(registry, produced)
        self.service = MessagingService(broker, self.metrics)
        self._server: grpc.aio.Server | None = None
        self.port = 0

    @property
    def address(self) -> str:
        return f"{self.config.grpc_bind_host}:{self.config.grpc_listen_port}"

    async def start(self) -> None:
        """Bind and serve; OSError when the address cannot be bound."""
        interceptors = []
        if self.config.auth_token:
            accepted = GrpcCredentials(
                self.config.auth_token.encode("utf-8", "surrogatepass"),
                self.config.access_key,
                self.config.grpc_signature_window_s,
            )
            interceptors.append(_AuthInterceptor(accepted, self.metrics))
        server = grpc.aio.server(
            interceptors=interceptors,
            options=server_options(self.config),
            maximum_concurrent_rpcs=MAX_CONCURRENT_RPCS,
        )
        spb_grpc.add_MessagingServiceServicer_to_server(self.service, server)
        creds = _credentials(self.config)
        try:
            if creds is not None:
                port = server.add_secure_port(self.address, creds)
            else:
                port = server.add_insecure_port(self.address)
        except RuntimeError as exc:
            raise OSError(f"cannot listen on {self.address}: {exc}") from None
        if not port:
            raise OSError(f"cannot listen on {self.address}")
        await server.start()
        self._server = server
        self.port = port
        if self.service.renewer is not None:
            self.service.renewer.start()

    async def stop(self) -> None:
        self.service.stopping.set()
        if self.service.renewer is not None:
            await self.service.renewer.stop()
        if self._server is not None:
            await self._server.stop(STOP_GRACE_S)
            self._server = None
