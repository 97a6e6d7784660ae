"""The node's structured logs for ``chronomq report``: replication, latency and events.

One :class:`NodeLogs` per node owns one :class:`chronomq.cluster.logs.writer.LogWriter`, which writes JSON lines
(schemas in :mod:`chronomq.cluster.logs.schema`) to ``<ops_log_dir>/n<node_id>/`` (``ops_log_dir`` defaults to
``<data_dir>/ops``), so every node of a cluster may share one ``ops_log_dir`` and the report
reads it as one tree. What is written, by whom:

- ``replication``: one line per applied Raft command on every node (the apply listener, Raft
  thread): index, term, CommitLog bytes, message count, this node, ``apply_ms``; not for the
  commands a restarted node re-applies from its journal (logged the first time). The leader's
  line also has ``propose_ms`` (carried in the command, the proposing leader's clock) and
  ``commit_ms``. pysyncobj applies an entry in the very tick its leader learns that it is
  committed, before the commit callbacks run, so the leader's apply time is its commit time
  (late by the time the apply itself takes); this also covers commands the committer did not
  propose (leadership barriers, entries of an earlier term committed by a new leader).
- ``latency``: ``stored`` for each produced message, on the leader after the commit
  (:meth:`stored`, from ``Broker.produce``); ``delivered`` from the schedule and timer services
  (:meth:`delivered_level`, :meth:`delivered_timer`); ``consumed`` comes from the client
  library (``latency_log_dir`` of :class:`chronomq.Consumer`), and for RocketMQ 5 clients from the node that
  served their ``ReceiveMessage`` (:meth:`consumed`, first deliveries only).
- ``events``: this node starting and stopping, leader changes as this node sees them, the
  services' start and stop (:meth:`event`), config changes at runtime, and the writer's own
  drops (``log_drop``, written by the writer).

Nothing here blocks or does I/O on the caller's thread: the callers hand over what they already
hold (the produce answer's placements, the services' delivery tuples) as rows, and the writer
thread turns them into lines. When the buffer is full, rows are dropped and counted, never
waited for. ``ops_log_enabled`` and ``ops_log_sample_rate`` can be changed at runtime; sampling
keeps the same messages and commands on every node (see :func:`chronomq.cluster.logs.writer.keep_sample`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from chronomq.cluster.logs.schema import (
    EventRecord,
    EventType,
    InvalidRecord,
    JsonValue,
    LatencyLines,
    MessageKind,
    RecordType,
    ReplicationRecord,
    Stage,
    consumed_line,
    encode,
    latency_line,
)
from chronomq.cluster.logs.writer import LogWriter, LogWriterConfig, WriterStats
from chronomq.raftlog.clock import Clock, SystemClock
from chronomq.raftlog.record import msg_id_hex

if TYPE_CHECKING:
    from chronomq.cluster.config.nodeconfig import NodeConfig
    from chronomq.raftlog.node import RaftLog
    from chronomq.raftlog.store import ApplyResult, Placed

log = logging.getLogger(__name__)

DeliveredItem = tuple[str, str, int, int]
"""(msg_id hex, real topic, store_ms, due_ms) of one delivered message."""

ENABLED_KEY = "ops_log_enabled"
SAMPLE_RATE_KEY = "ops_log_sample_rate"

_LEVEL, _TIMER, _PLAIN = MessageKind.LEVEL.value, MessageKind.TIMER.value, MessageKind.PLAIN.value
_STORED, _DELIVERED = Stage.STORED.value, Stage.DELIVERED.value


def node_name(node_id: int) -> str:
    """The node's name in the logs (``node`` fields, directory name): ``n<id>``."""
    return f"n{node_id}"


def log_dir(config: NodeConfig) -> Path:
    """Where the nodes' log directories are: ``ops_log_dir``, or ``<data_dir>/ops``."""
    return Path(config.ops_log_dir or Path(config.data_dir) / "ops")


def _json_value(value: Any) -> JsonValue:
    if value is None or isinstance(value, str | int | float | bool):
        return value
    if isinstance(value, Mapping):
        return {str(k): _json_value(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_value(v) for v in value]
    return str(value)


MIN_ROTATE_BYTES = 16 * 1024
"""The smallest size ops log files rotate at, however small ``ops_log_max_bytes`` is."""


def rotate_bytes_within(rotate_bytes: int, max_total_bytes: int) -> int:
    """The size files rotate at under a bound on all files together: the files being written
    (one per record type) are never deleted, so together they take at most a quarter of the
    bound, and rotated files are pruned to keep the rest within it."""
    if max_total_bytes <= 0:
        return rotate_bytes
    return max(MIN_ROTATE_BYTES, min(rotate_bytes, max_total_bytes // (4 * len(RecordType))))


class NodeLogs:
    """One node's replication, latency and event logs. Build it, then :meth:`close` it.

    ``raftlog`` may be None (tests, tools): then only what is handed in explicitly is written.
    """

    def __init__(
        self,
        config: NodeConfig,
        raftlog: RaftLog | None = None,
        *,
        writer_config: LogWriterConfig | None = None,
        clock: Clock | None = None,
    ) -> None:
        self.node = node_name(config.node_id)
        self.directory = log_dir(config)
        base = writer_config or LogWriterConfig()
        max_total = int(config.ops_log_max_bytes)
        self.writer = LogWriter(
            self.directory,
            self.node,
            dataclasses.replace(
                base,
                enabled=bool(config.ops_log_enabled),
                sample_rate=float(config.ops_log_sample_rate),
                retention_ms=int(config.ops_log_retention_h) * 3_600_000,
                max_total_bytes=max_total,
                rotate_bytes=rotate_bytes_within(base.rotate_bytes, max_total),
            ),
        )
        self._clock = clock or (raftlog.clock if raftlog is not None else SystemClock())
        self._raftlog = raftlog
        # A restarted node re-applies its journal from its last snapshot: those commands were
        # applied, and logged, before the restart; a second line would show a lag of the whole
        # downtime. The journal's commit index at start (pysyncobj saves it about once a
        # second) bounds most of them; the report keeps each node's earliest apply of the rest.
        self._replayed_up_to = (
            int(getattr(raftlog.machine, "raftCommitIndex", 0) or 0) if raftlog is not None else 0
        )
        self._bad_event_logged = False
        self.writer.start()
        log.info(
            "ops logs of %s in %s (%s); replayed commands up to index %d are not logged again",
            self.node,
            self.writer.directory,
            "on" if self.enabled else "off",
            self._replayed_up_to,
        )
        self.event(EventType.SERVICE_START, service="node")
        if raftlog is not None:
            raftlog.add_apply_listener(self._on_apply)

    # ------------------------------------------------------------------ state

    @property
    def enabled(self) -> bool:
        return self.writer.config.enabled

    def stats(self) -> WriterStats:
        return self.writer.stats()

    def close(self, timeout_s: float = 30.0) -> WriterStats:
        """Write the node's stop event, drain the buffer, close the files."""
        self.event(EventType.SERVICE_STOP, service="node")
        stats = self.writer.close(timeout_s)
        if stats.dropped or stats.write_errors:
            log.warning(
                "ops logs of %s: %d records dropped (buffer full), %d lost to write errors",
                self.node,
                stats.dropped,
                stats.write_errors,
            )
        return stats

    # ------------------------------------------------------------------ replication

    def _on_apply(self, result: ApplyResult) -> None:
        # Raft thread, after every applied command: a tuple and an append, nothing more.
        if not self.writer.config.enabled or result.index <= self._replayed_up_to:
            return
        apply_ms = self._clock.now_ms()
        machine = self._raftlog.machine  # type: ignore[union-attr]
        propose_ms = result.propose_ms if machine._isLeader() else None
        row = (
            result.index,
            machine.raftCurrentTerm,
            result.bytes_written,
            result.messages,
            apply_ms,
            propose_ms,
        )
        self.writer.write_rows(
            RecordType.REPLICATION, (row,), self._render_replication, _replication_key
        )

    def _render_replication(self, row: tuple[int, int, int, int, int, int | None]) -> bytes:
        index, term, size_bytes, msg_count, apply_ms, propose_ms = row
        leader = propose_ms is not None
        return encode(
            ReplicationRecord(
                index=index,
                term=term,
                size_bytes=size_bytes,
                msg_count=msg_count,
                node=self.node,
                apply_ms=apply_ms,
                propose_ms=propose_ms,
                commit_ms=apply_ms if leader else None,
            )
        )

    # ------------------------------------------------------------------ latency

    def stored(
        self,
        topic: str,
        placed: Sequence[Placed],
        extras: Sequence[Mapping[str, Any]],
        store_ms: int,
    ) -> None:
        """Messages of one produce request, committed (event loop; O(1) here).

        ``topic`` is the topic produced to (delayed messages wait elsewhere); ``extras[i]`` is
        message ``i``'s part of the produce answer: ``deliver_ms`` for a delayed message, with
        ``delay_level`` for a delay-level one (a timer message has ``deliver_ms`` only).
        Neither sequence may change afterwards.
        """
        if not self.writer.config.enabled or not placed:
            return
        node = self.node
        templates: dict[tuple[int | None, int | None], LatencyLines] = {}

        def render(i: int) -> bytes:
            extra = extras[i]
            due_ms = extra.get("deliver_ms")
            level = extra.get("delay_level") if due_ms is not None else None
            lines = templates.get((level, due_ms))
            if lines is None:
                kind = _PLAIN if due_ms is None else _LEVEL if level is not None else _TIMER
                lines = templates[(level, due_ms)] = LatencyLines(
                    topic, kind, _STORED, node, level=level, store_ms=store_ms, due_ms=due_ms
                )
            return lines.line(msg_id_hex(placed[i].msg_id))

        def key(i: int) -> str:
            return msg_id_hex(placed[i].msg_id)

        self.writer.write_rows(RecordType.LATENCY, range(len(placed)), render, key)

    def delivered_level(
        self, level: int, items: list[tuple[str, str, int, int]], delivered_ms: int
    ) -> None:
        """Delay-level messages written back to their real topic (schedule service thread)."""
        self._delivered(_LEVEL, level, items, delivered_ms)

    def delivered_timer(self, items: list[tuple[str, str, int, int]], delivered_ms: int) -> None:
        """Timer messages written back to their real topic (timer service thread)."""
        self._delivered(_TIMER, None, items, delivered_ms)

    def _delivered(
        self, kind: str, level: int | None, items: Sequence[DeliveredItem], delivered_ms: int
    ) -> None:
        if not self.writer.config.enabled or not items:
            return
        node = self.node

        def render(item: DeliveredItem) -> bytes:
            msg_id, topic, store_ms, due_ms = item
            return latency_line(
                msg_id,
                topic,
                kind,
                _DELIVERED,
                node,
                level=level,
                store_ms=store_ms,
                due_ms=due_ms,
                delivered_ms=delivered_ms,
            )

        self.writer.write_rows(RecordType.LATENCY, items, render, _item_key)

    def consumed(self, topic: str, messages: Sequence[Mapping[str, Any]], consumed_ms: int) -> None:
        """Messages this node handed to a consumer that cannot log them itself (the RocketMQ
        5 clients over gRPC): ``consumed`` lines as :class:`chronomq.ConsumedLog` writes
        them, each a message as a pull answers it (event loop; O(1) here)."""
        if not self.writer.config.enabled or not messages:
            return
        node = self.node

        def render(m: Mapping[str, Any]) -> bytes:
            return consumed_line(m, topic, consumed_ms, node)

        def key(m: Mapping[str, Any]) -> str:
            return str(m["msg_id"])

        self.writer.write_rows(RecordType.LATENCY, messages, render, key)

    # ------------------------------------------------------------------ events

    def event(self, type: EventType | str, **detail: Any) -> None:
        """Something for the report's timeline; never raises (any thread)."""
        try:
            record = EventRecord(
                ts_ms=self._clock.now_ms(),
                node=self.node,
                type=EventType(type),
                detail={k: _json_value(v) for k, v in detail.items()},
            )
        except (InvalidRecord, ValueError) as exc:
            if not self._bad_event_logged:
                self._bad_event_logged = True
                log.warning("ops logs: event %r not logged: %s", type, exc)
            return
        self.writer.write(record)

    def leader_changed(
        self,
        leader: int | str | None,
        previous: int | str | None,
        term: int,
        election_ms: float | None,
    ) -> None:
        """This node now knows ``leader`` (a node id, or an address when not a known member)."""
        self.event(
            EventType.LEADER_CHANGE,
            leader=_peer_name(leader),
            previous=_peer_name(previous),
            term=term,
            election_ms=election_ms,
        )

    def on_config_change(self, changes: Mapping[str, Any]) -> None:
        """A ``CONFIG_HOOKS`` hook: log the change, and apply the ops log keys among them.

        The values were validated by the config before the hooks run.
        """
        enabled = changes.get(ENABLED_KEY)
        rate = changes.get(SAMPLE_RATE_KEY)
        turning_off = enabled is not None and not enabled
        if not turning_off:
            self._reconfigure(enabled, rate)
        self.event(EventType.CONFIG_CHANGE, changes=dict(changes))
        if turning_off:
            self._reconfigure(False, rate)

    def _reconfigure(self, enabled: Any, rate: Any) -> None:
        if enabled is None and rate is None:
            return
        config = self.writer.reconfigure(
            enabled=None if enabled is None else bool(enabled),
            sample_rate=None if rate is None else float(rate),
        )
        log.info(
            "ops logs of %s %s, sample rate %s",
            self.node,
            "on" if config.enabled else "off",
            config.sample_rate,
        )


def _peer_name(peer: int | str | None) -> str | None:
    return node_name(peer) if isinstance(peer, int) else peer


def _replication_key(row: tuple[Any, ...]) -> int:
    index: int = row[0]
    return index


def _item_key(item: DeliveredItem) -> str:
    return item[0]


def install_metrics(registry: Any, logs: NodeLogs) -> None:
    """``chronomq_ops_log_*`` on ``/metrics``: what the writer wrote, dropped, sampled out."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    class _Collector:
        def collect(self) -> Iterable[Any]:
            st = logs.stats()
            records = CounterMetricFamily(
                "chronomq_ops_log_records",
                "Ops log records by outcome (dropped: buffer full; sampled_out: not in sample)",
                labels=["outcome"],
            )
            for outcome, value in (
                ("written", st.written),
                ("dropped", st.dropped),
                ("sampled_out", st.sampled_out),
                ("write_error", st.write_errors),
            ):
                records.add_metric([outcome], value)
            yield records
            yield GaugeMetricFamily(
                "chronomq_ops_log_buffered",
                "Records waiting for the log writer",
                logs.writer.buffered,
            )
            yield GaugeMetricFamily(
                "chronomq_ops_log_enabled", "1 when ops logs are written", int(logs.enabled)
            )

    registry.register(_Collector())
