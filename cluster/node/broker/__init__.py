"""One broker node: the replicated log plus what the HTTP API and the gRPC endpoint need around it.

The :class:`Broker` lives on the asyncio loop. It turns JSON messages into
:class:`chronomq.raftlog.node.NewMessage` (rewriting delayed ones into the schedule topic), waits for
commits without blocking the loop, wakes long-polling consumers when new entries apply, and
aggregates the cluster view from every node.

It is one object made of parts, one module each, on :class:`~.base.BrokerBase` (state,
lifecycle, leader and members, commits, limits): :mod:`.parse` and :mod:`.produce`,
:mod:`.pull`, :mod:`.offsets`, :mod:`.retry` (consumer retry and the DLQ), :mod:`.members`
(membership changes) and :mod:`.view` (the cluster view). The parts import the base, never
this module or each other (but produce its parsing, and the view the membership history).
"""

from __future__ import annotations

from chronomq.cluster.config.nodeconfig import NodeConfig
from chronomq.cluster.node.broker.base import MEMBER_PREFIX, REMOVED, BrokerBase
from chronomq.cluster.node.broker.offsets import GroupOffsets
from chronomq.cluster.node.broker.produce import Producing
from chronomq.cluster.node.broker.pull import Pulling
from chronomq.cluster.node.broker.retry import ConsumerRetry
from chronomq.cluster.node.broker.view import ClusterView
from chronomq.raftlog.node import RaftLog

__all__ = ["MEMBER_PREFIX", "REMOVED", "Broker", "BrokerBase"]


class Broker(Producing, Pulling, GroupOffsets, ConsumerRetry, ClusterView):
    """One node's broker: every part, one object (see the package)."""

    def __init__(self, config: NodeConfig, raftlog: RaftLog) -> None:
        super().__init__(config, raftlog)
        raftlog.add_apply_listener(self._log_membership)
