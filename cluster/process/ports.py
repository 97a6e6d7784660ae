"""The ports of a local cluster, planned before anything starts.

Node ``i`` of ``n`` listens on four ports, each ``base + i`` of a block of ``n``: HTTP
(``http_port``), gRPC (``grpc_port``), Raft (``raft_port``) and the CommitLog catch-up channel
(``fetch_port``). The HTTP and Raft bases are given; gRPC and catch-up, unless given, are
derived: gRPC from ``http_port + 100``, catch-up from ``raft_port + 1000``, each moved on by
another 100 (1000) while its block would overlap a block already placed, so that derived
ports never clash. Blocks that are given and overlap are refused, naming both settings:
nothing is started that would die of a bind error.
"""

from __future__ import annotations

from dataclasses import dataclass

from chronomq.cluster.config.nodeconfig import ConfigError

MAX_PORT = 65535
DERIVE_TRIES = 50
"""How far a derived block may move on before the plan gives up (and asks for the setting)."""


@dataclass(frozen=True, slots=True)
class PortBlock:
    """Ports ``base .. base + nodes - 1`` of one setting; ``derived_from`` says how ``base`` was
    derived (empty: given)."""

    setting: str
    base: int
    nodes: int
    derived_from: str = ""

    @property
    def last(self) -> int:
        return self.base + self.nodes - 1

    def overlaps(self, other: PortBlock) -> bool:
        return self.base <= other.last and other.base <= self.last

    def describe(self) -> str:
        span = f"{self.base}" if self.nodes == 1 else f"{self.base}-{self.last}"
        how = f"{self.derived_from}: " if self.derived_from else ""
        return f"{self.setting} ({how}{span})"


@dataclass(frozen=True, slots=True)
class PortPlan:
    """The four blocks of a local cluster; node ``i`` uses ``block.base + i`` of each."""

    http: PortBlock
    grpc: PortBlock
    raft: PortBlock
    fetch: PortBlock


def _fits(block: PortBlock) -> bool:
    return block.base >= 1 and block.last <= MAX_PORT


def plan_ports(
    nodes: int,
    http_port: int,
    raft_port: int,
    grpc_port: int | None = None,
    fetch_port: int | None = None,
) -> PortPlan:
    """The blocks of ``nodes`` nodes; :class:`ConfigError` naming both settings when two given
    blocks overlap, or naming the setting whose block does not fit in the port range."""
    placed: list[PortBlock] = []

    def place(block: PortBlock) -> PortBlock:
        if not _fits(block):
            raise ConfigError(
                block.setting,
                f"{block.describe()} is not within 1-{MAX_PORT} for {nodes} nodes",
            )
        for other in placed:
            if block.overlaps(other):
                raise ConfigError(
                    block.setting,
                    f"{block.describe()} overlaps {other.describe()}: each node needs four "
                    "ports of its own (http_port, grpc_port, raft_port, fetch_port); choose "
                    "bases at least the node count apart",
                )
        placed.append(block)
        return block

    def derive(setting: str, start: int, step: int, how: str) -> PortBlock:
        for k in range(DERIVE_TRIES):
            block = PortBlock(
                setting, start + k * step, nodes, how + (f" + {k * step}" if k else "")
            )
            if not _fits(block):
                break
            if not any(block.overlaps(other) for other in placed):
                return place(block)
        raise ConfigError(setting, f"no free block derived from {how}: set {setting}")

    http = place(PortBlock("http_port", http_port, nodes))
    raft = place(PortBlock("raft_port", raft_port, nodes))
    grpc = fetch = None
    if grpc_port is not None:
        grpc = place(PortBlock("grpc_port", grpc_port, nodes))
    if fetch_port is not None:
        fetch = place(PortBlock("fetch_port", fetch_port, nodes))
    if fetch is None:
        fetch = derive("fetch_port", raft_port + 1000, 1000, "raft_port + 1000")
    if grpc is None:
        grpc = derive("grpc_port", http_port + 100, 100, "http_port + 100")
    return PortPlan(http=http, grpc=grpc, raft=raft, fetch=fetch)
