"""The leader-only services a node runs next to its replicated log.

Each service follows the same life: built from the node's config, started after the Raft
machine, closed before the Raft machine. Their leader-only work (the schedule level loops, the
timer driver, pop revive) is owned by one :class:`chronomq.raftlog.leadership.Leadership` per
node, fed by the log's confirmed leadership: it runs each term's work only once the last
term's has exited. They all run on the node's
:class:`chronomq.raftlog.leaderloop.LeaderRuntime` (the ``leader-work`` thread), the only work
registered with that owner. Their HTTP routes live in
``cluster/api_<service>.py``.
"""

from __future__ import annotations

from typing import Any, Protocol

from chronomq.cluster.config.nodeconfig import NodeConfig
from chronomq.cluster.node.broker import Broker
from chronomq.cluster.node.metrics import KIND_LEVEL, KIND_TIMER
from chronomq.raftlog.leaderloop import LeaderRuntime
from chronomq.raftlog.leadership import Leadership
from chronomq.raftlog.node import RaftLog


class Service(Protocol):
    def start(self) -> None: ...

    def close(self) -> None: ...

    def stats(self) -> dict[str, Any]: ...


def start_services(config: NodeConfig, raftlog: RaftLog, broker: Broker) -> list[Service]:
    """Build and start every service; the caller closes them in reverse order."""
    leadership = Leadership(now_ms=raftlog.clock.monotonic_ms)
    runtime = LeaderRuntime(leadership)
    broker.leadership = leadership
    services: list[Service] = []
    for build in (_schedule, _timer, _pop, _disk):
        service = build(config, raftlog, broker, runtime)
        if service is not None:
            service.start()
            services.append(service)
    # Started last, with every loop added; closed first, stopping them all.
    runtime.start()
    services.append(runtime)
    raftlog.add_leader_listener(leadership.on_leader)
    term = raftlog.leader_term
    if term is not None:  # confirmed before we listened
        leadership.on_leader(True, term)
    return services


def close_services(services: list[Service]) -> None:
    for service in reversed(services):
        service.close()


def _schedule(
    config: NodeConfig, raftlog: RaftLog, broker: Broker, runtime: LeaderRuntime
) -> Service | None:
    from chronomq.schedule.pending import PendingConfig
    from chronomq.schedule.service import ScheduleService
    from chronomq.schedule.settings import ScheduleSettings

    settings = ScheduleSettings(
        levels=broker.levels,
        async_deliver=config.enable_schedule_async_deliver,
        pending=PendingConfig(
            max_pending_limit=config.schedule_async_deliver_max_pending_limit,
            max_resend_num_to_blocked=config.schedule_async_deliver_max_resend_num_to_blocked,
        ),
    )
    logs = broker.logs

    def delivered(level: int, items: list[tuple[str, str, int, int]], delivered_ms: int) -> None:
        broker.lateness.observe(KIND_LEVEL, items, delivered_ms)
        if logs is not None:
            logs.delivered_level(level, items, delivered_ms)

    service = ScheduleService(
        raftlog,
        settings,
        on_delivered=delivered,
        on_event=getattr(logs, "event", None),
        runtime=runtime,
    )
    broker.schedule = service
    return service


def _timer(
    config: NodeConfig, raftlog: RaftLog, broker: Broker, runtime: LeaderRuntime
) -> Service | None:
    """The RIP-43 timer (``timer/``): its apply extension on every node, its driver on the
    leader. Files live in ``<data_dir>/timer``; a bad ``timer_*`` value stops the node naming
    the key."""
    from pathlib import Path

    from chronomq.cluster.config.nodeconfig import ConfigError
    from chronomq.pop import REVIVE_TOPIC
    from chronomq.timer.config import timer_config_from
    from chronomq.timer.errors import InvalidTimerConfig
    from chronomq.timer.service import TimerService

    try:
        timer_config = timer_config_from(config.values())
    except InvalidTimerConfig as exc:
        raise ConfigError(exc.field or "timer", exc.message) from None

    def observer(items: list[tuple[str, str, int, int]], delivered_ms: int) -> None:
        # Looked up per call: the ops logs may be attached to the broker after this runs.
        logs = getattr(broker, "logs", None)
        record = getattr(logs, "delivered_timer", None) if logs is not None else None
        # Pop checkpoints ride on the timer too; they are no user's timer messages.
        items = [item for item in items if item[1] != REVIVE_TOPIC]
        broker.lateness.observe(KIND_TIMER, items, delivered_ms)
        if record is not None and items:
            record(items, delivered_ms)

    def peer_urls() -> list[str]:
        return [p.http for p in broker.peers() if p.id != config.node_id]

    service = TimerService(
        raftlog,
        timer_config,
        Path(config.data_dir) / "timer",
        default_topic_queues=config.default_topic_queues,
        auto_create_topics=config.auto_create_topic,
        peer_urls=peer_urls,
        open_url=broker.peer_client.urlopen,
        on_delivered=observer,
        commit_timeout_ms=config.commit_timeout_ms,
        runtime=runtime,
    )
    broker.timer = service
    broker.timer_hook = service.produce_hook
    return service


def _pop(
    config: NodeConfig, raftlog: RaftLog, broker: Broker, runtime: LeaderRuntime
) -> Service | None:
    """RocketMQ 5 pop consumption (``pop/``): its apply extension on every node, its
    revive driver on the leader. Receipt handles are signed with the cluster secret."""
    from chronomq.pop import PopService

    service = PopService(
        raftlog,
        config.cluster_secret_bytes or b"chronomq/no-cluster-secret",
        max_reconsume_times=config.max_reconsume_times,
        commit_timeout_ms=config.commit_timeout_ms,
        runtime=runtime,
    )
    broker.pop = service
    return service


def _disk(
    config: NodeConfig, raftlog: RaftLog, broker: Broker, runtime: LeaderRuntime
) -> Service | None:
    """CommitLog retention and the produce guard (``cluster/node/disk.py``), on every node."""
    from chronomq.cluster.node.disk import DiskService

    service = DiskService(config, raftlog, broker)
    broker.disk = service
    return service
