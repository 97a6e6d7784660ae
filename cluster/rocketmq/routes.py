"""Where the members serve gRPC, and a topic's route (``QueryRoute``, ``QueryAssignment``).

A member's gRPC address is derived, not replicated: the host and port of its HTTP URL, the
port moved by this node's own offset (``grpc_port - http_port``; 100 by default). This node
names itself by its HTTP host, or its Raft host when HTTP binds every interface. Every node
of a cluster started by ``chronomq cluster up`` (or configured alike) has the same offset.

Each queue of a route names every live member (this node, and the peers its Raft connections
reach) as its broker's endpoints, so an official client's channel (``pick_first`` over the
addresses) moves to another node by itself when one dies; any node takes any call and sends
writes on to the leader. The protocol allows several addresses only for IP literals; when a
member is known by a host name, each queue names one member instead (queue ``i`` the
``i``-th live member), so the client's own retry on the next queue reaches another node.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Final

from rocketmq.grpc_protocol import definition_pb2 as pb
from yarl import URL

from chronomq.cluster.config.nodeconfig import NodeConfig, Peer

BROKER_NAME: Final = "chronomq"
ACCEPTED_TYPES: Final = (pb.MessageType.NORMAL, pb.MessageType.DELAY)


@dataclass(frozen=True, slots=True)
class GrpcAddress:
    host: str
    port: int

    @property
    def scheme(self) -> int:
        try:
            ip = ipaddress.ip_address(self.host)
        except ValueError:
            return int(pb.AddressScheme.DOMAIN_NAME)
        return int(pb.AddressScheme.IPv4 if ip.version == 4 else pb.AddressScheme.IPv6)


def grpc_address(http_url: str, offset: int) -> GrpcAddress | None:
    """A member's gRPC address from its HTTP URL; None when it has no usable one."""
    try:
        u = URL(http_url)
    except (ValueError, TypeError):
        return None
    if not u.host or u.port is None or not 0 < u.port + offset <= 65535:
        return None
    return GrpcAddress(u.host, u.port + offset)


def _unspecified(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False


def own_address(config: NodeConfig) -> GrpcAddress:
    """How clients reach this node: its HTTP host, or, when that binds every interface
    (``0.0.0.0``, as in a container), its Raft host, the name its peers know it by."""
    host = str(config.http_host)
    if _unspecified(host):
        host = str(config.raft_host)
    return GrpcAddress(host, int(config.grpc_listen_port))


def live_members(
    config: NodeConfig, peers: Sequence[Peer], connected: dict[str, bool]
) -> list[GrpcAddress]:
    """This node first, then the peers whose Raft connection is up (by id)."""
    offset = config.grpc_listen_port - config.http_port
    out = [own_address(config)]
    for p in sorted(peers, key=lambda p: p.id):
        if not connected.get(p.raft):
            continue
        addr = grpc_address(p.http, offset)
        if addr is not None and addr not in out:
            out.append(addr)
    return out


def leader_first(
    members: list[GrpcAddress], leader_http_url: str | None, config: NodeConfig
) -> list[GrpcAddress]:
    """``members`` with the leader's address first, so a client's channel (``pick_first``)
    talks to the node that serves its writes instead of one that forwards them; it moves on
    to the next address by itself when that node dies."""
    if not leader_http_url:
        return members
    leader: GrpcAddress | None = own_address(config)
    if leader_http_url != config.http_url:
        leader = grpc_address(leader_http_url, config.grpc_listen_port - config.http_port)
    if leader is None or leader not in members:
        return members
    return [leader, *(m for m in members if m != leader)]


def _endpoints(addresses: Iterable[GrpcAddress]) -> pb.Endpoints:
    addrs = list(addresses)
    ep = pb.Endpoints(scheme=addrs[0].scheme if addrs else pb.AddressScheme.IPv4)
    for a in addrs:
        ep.addresses.add(host=a.host, port=a.port)
    return ep


def message_queues(
    topic: pb.Resource, queue_count: int, members: Sequence[GrpcAddress]
) -> list[pb.MessageQueue]:
    """The route of ``topic``: ``queue_count`` queues, readable and writable."""
    shared = len({m.scheme for m in members}) == 1 and all(
        m.scheme != pb.AddressScheme.DOMAIN_NAME for m in members
    )
    out = []
    for q in range(queue_count):
        chosen = list(members) if shared or not members else [members[q % len(members)]]
        out.append(
            pb.MessageQueue(
                topic=pb.Resource(name=topic.name, resource_namespace=topic.resource_namespace),
                id=q,
                permission=pb.Permission.READ_WRITE,
                broker=pb.Broker(name=BROKER_NAME, id=0, endpoints=_endpoints(chosen)),
                accept_message_types=list(ACCEPTED_TYPES),
            )
        )
    return out


POP_QUEUE_ID: Final = -1
"""The queue of an assignment: every queue of the topic, as the RocketMQ proxy assigns for pop
consumption (a receive hands out from any queue of the broker)."""


def assignments(topic: pb.Resource, members: Sequence[GrpcAddress]) -> list[pb.Assignment]:
    """What a push consumer is assigned: the whole topic (queue ``-1``) once, with every live
    member as endpoints; when members are known by host name, once per member (the protocol
    allows several addresses only for IP literals)."""
    shared = len({m.scheme for m in members}) == 1 and all(
        m.scheme != pb.AddressScheme.DOMAIN_NAME for m in members
    )
    groups = [list(members)] if shared or not members else [[m] for m in members]
    return [
        pb.Assignment(
            message_queue=pb.MessageQueue(
                topic=pb.Resource(name=topic.name, resource_namespace=topic.resource_namespace),
                id=POP_QUEUE_ID,
                permission=pb.Permission.READ_WRITE,
                broker=pb.Broker(name=BROKER_NAME, id=0, endpoints=_endpoints(chosen)),
                accept_message_types=list(ACCEPTED_TYPES),
            )
        )
        for chosen in groups
    ]
