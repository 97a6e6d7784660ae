"""Who holds the node's Telemetry streams (no I/O): the caps that keep one client from filling
the endpoint's call limit with streams that do nothing.

A RocketMQ 5 client keeps one Telemetry stream open per node for as long as it runs, and
sends its settings on it first thing. A stream is a call in progress for its whole life, and
the endpoint serves at most :data:`~chronomq.cluster.rocketmq.endpoint.MAX_CONCURRENT_RPCS`
calls at once, so streams opened and left idle would take every slot. Hence:

- at most ``per_client`` streams per client id (``x-mq-client-id``): a client's next one
  closes its oldest (a client that reconnects is not locked out by its own dead stream);
- at most ``per_connection`` per connection (the peer's address and port): one more is refused;
- at most ``total`` in all (``grpc_max_telemetry_streams``, well below the call limit, so the
  rest stays for sends, receives and acks): one more is refused;
- a stream that has not sent its settings within ``grpc_telemetry_settings_timeout_ms`` is
  closed (the caller arms that timer; :meth:`TelemetryStreams.settings_seen` disarms it).

Everything held is bounded by ``total``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

PER_CLIENT: Final = 8
"""Telemetry streams one client id may hold on one node (an official client holds one)."""
PER_CONNECTION: Final = 16
"""Telemetry streams one connection may carry."""


@dataclass(frozen=True, slots=True)
class StreamLimits:
    total: int
    per_client: int = PER_CLIENT
    per_connection: int = PER_CONNECTION


@dataclass(eq=False, slots=True)
class Ticket:
    """One admitted stream; ``close`` ends it (set by the stream's handler)."""

    client_id: str | None
    connection: str
    close: Callable[[], None]
    settings: bool = field(default=False)


class Refused(Exception):
    """A stream past a cap: ``reason`` is ``connection`` or ``total``, the message says more."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class TelemetryStreams:
    """The open Telemetry streams of one node."""

    def __init__(self, limits: StreamLimits) -> None:
        self.limits = limits
        self._by_client: dict[str, OrderedDict[int, Ticket]] = {}
        self._per_connection: dict[str, int] = {}
        self._open: dict[int, Ticket] = {}

    def __len__(self) -> int:
        return len(self._open)

    def admit(self, client_id: str | None, connection: str, close: Callable[[], None]) -> Ticket:
        """Register a new stream, closing the client's oldest one past ``per_client``;
        :class:`Refused` past ``per_connection`` or ``total``."""
        if self._per_connection.get(connection, 0) >= self.limits.per_connection:
            raise Refused(
                "connection",
                f"this connection has {self.limits.per_connection} Telemetry streams open",
            )
        held = self._by_client.get(client_id) if client_id is not None else None
        if held is not None and len(held) >= self.limits.per_client:
            _, oldest = held.popitem(last=False)
            self._forget(oldest)
            oldest.close()
        if len(self._open) >= self.limits.total:
            raise Refused("total", f"the node has {self.limits.total} Telemetry streams open")
        ticket = Ticket(client_id, connection, close)
        self._open[id(ticket)] = ticket
        self._per_connection[connection] = self._per_connection.get(connection, 0) + 1
        if client_id is not None:
            self._by_client.setdefault(client_id, OrderedDict())[id(ticket)] = ticket
        return ticket

    def settings_seen(self, ticket: Ticket) -> None:
        ticket.settings = True

    def release(self, ticket: Ticket) -> None:
        """The stream ended (for whatever reason); idempotent."""
        if id(ticket) not in self._open:
            return
        if ticket.client_id is not None:
            held = self._by_client.get(ticket.client_id)
            if held is not None:
                held.pop(id(ticket), None)
                if not held:
                    del self._by_client[ticket.client_id]
        self._forget(ticket)

    def _forget(self, ticket: Ticket) -> None:
        if self._open.pop(id(ticket), None) is None:
            return
        left = self._per_connection[ticket.connection] - 1
        if left:
            self._per_connection[ticket.connection] = left
        else:
            del self._per_connection[ticket.connection]
