"""``chronomq node --config FILE``: run one broker node until SIGTERM or SIGINT.

Shutdown is graceful: a leader hands its leadership to the most caught-up follower while it
still serves (bounded by :data:`chronomq.cluster.process.stopping.HAND_OVER_TIMEOUT_S`; a
single node, or one whose followers are down, skips it), so writers go on with the new leader
at once; then stop accepting requests, let in-flight commits finish, flush and close the store, drain the ops logs (:mod:`chronomq.cluster.logs.nodelogs`), exit 0. It is also bounded: whatever
state the node is in (starting, restoring, stuck), it is gone within
:data:`chronomq.cluster.process.stopping.STOP_DEADLINE_S` of the signal (:mod:`chronomq.cluster.process.stopping`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import ssl
import sys

import orjson
from aiohttp import web

from chronomq.cluster.config.nodeconfig import ConfigError, NodeConfig, load, warn_renamed
from chronomq.cluster.httpapi.api import create_app
from chronomq.cluster.httpapi.base import CONFIG_HOOKS, CONNECTIONS, METRICS
from chronomq.cluster.httpapi.httpconn import GuardedSite
from chronomq.cluster.logs import stdlog as logs
from chronomq.cluster.logs.nodelogs import NodeLogs
from chronomq.cluster.logs.nodelogs import install_metrics as install_log_metrics
from chronomq.cluster.node import reserved, tls
from chronomq.cluster.node.broker import Broker
from chronomq.cluster.node.services import close_services, start_services
from chronomq.cluster.process import fdbudget, malloc
from chronomq.cluster.process.fdbudget import FdBudget
from chronomq.cluster.process.stopping import HAND_OVER_TIMEOUT_S, StopSignals
from chronomq.cluster.rocketmq.endpoint import GrpcEndpoint
from chronomq.raftlog.catchup import ListenError
from chronomq.raftlog.clock import SkewedClock
from chronomq.raftlog.node import RaftLog

log = logging.getLogger("chronomq.node")

RAFT_BIND_TIMEOUT_S = 10.0
"""How long the Raft listener may take to bind (pysyncobj retries once a second) before the
node gives up and exits with status 2, as it does when its HTTP or gRPC port is taken."""


async def serve(
    config: NodeConfig,
    ssl_context: ssl.SSLContext | None = None,
    signals: StopSignals | None = None,
) -> int:
    """Run the node; with ``ssl_context`` the HTTP API speaks HTTPS only. ``signals`` (made
    by :func:`run`) stops it; without them SIGTERM and SIGINT are handled on the loop."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    if signals is not None:
        signals.on_stop(lambda: loop.call_soon_threadsafe(stop.set))
    else:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
    skew_file = os.environ.get("CHRONOMQ_CLOCK_SKEW_FILE")
    clock = SkewedClock(skew_file) if skew_file else None
    if skew_file:
        log.warning("wall clock skewed by the offset in %s (a drill fault)", skew_file)
    budget = fd_budget(config)
    try:
        raftlog = RaftLog(
            dataclasses.replace(config.raft_config(), max_open_cq_files=budget.cache_files),
            clock=clock,
            auto_create_topics=config.auto_create_topic,
            extensions=reserved.APPLY_EXTENSIONS,
            record_rules=reserved.apply_rules(),
        )
    except ListenError as exc:
        # As for the Raft, HTTP and gRPC ports: say which address and setting, and stop.
        log.error(
            "%s (%s); stopping, as no peer could catch up from this node",
            exc,
            _port_setting(config, "fetch_port"),
        )
        return 2
    unbound = await asyncio.to_thread(raftlog.wait_listening, RAFT_BIND_TIMEOUT_S)
    if unbound is not None:
        log.error(
            "cannot listen for Raft on %s (%s): %s (tried for %.0f s); stopping, as no peer "
            "could reach this node",
            config.raft_address,
            _port_setting(config, "raft_port"),
            unbound,
            RAFT_BIND_TIMEOUT_S,
        )
        await asyncio.to_thread(raftlog.close)
        return 2
    broker = Broker(config, raftlog)
    node_logs = NodeLogs(config, raftlog)
    broker.logs = node_logs
    services = start_services(config, raftlog, broker)
    app = create_app(broker)
    guard = app[CONNECTIONS]
    guard.limits = dataclasses.replace(guard.limits, max_connections=budget.http_connections)
    app[CONFIG_HOOKS].append(node_logs.on_config_change)
    install_log_metrics(app[METRICS].registry, node_logs)
    runner = web.AppRunner(app, handle_signals=False, access_log=None, shutdown_timeout=5.0)
    await runner.setup()
    site = GuardedSite(
        runner, config.http_host, config.http_port, app[CONNECTIONS], ssl_context=ssl_context
    )
    try:
        await site.start()
    except OSError as exc:
        log.error(
            "cannot listen for HTTP on %s:%s (%s): %s",
            config.http_host,
            config.http_port,
            _port_setting(config, "http_port"),
            exc,
        )
        close_services(services)
        raftlog.close()
        node_logs.close()
        return 2
    grpc_endpoint = GrpcEndpoint(broker, app[METRICS].registry, app[METRICS].produced)
    try:
        await grpc_endpoint.start()
    except (OSError, ConfigError) as exc:
        log.error("cannot serve gRPC (%s): %s", _port_setting(config, "grpc_port"), exc)
        await runner.cleanup()
        close_services(services)
        raftlog.close()
        node_logs.close()
        return 2
    log.info(
        "node %s serving HTTP on %s, gRPC on %s, Raft on %s; %s",
        config.node_id,
        config.http_url,
        grpc_endpoint.address,
        config.raft_address,
        budget.describe(),
    )
    await stop.wait()
    # Still serving: what arrives during the hand-over is committed, or answered with the
    # new leader's address (and forwarded to it once this node follows).
    handed = await broker.hand_over_before_stop(HAND_OVER_TIMEOUT_S)
    if handed is not None:
        app[METRICS].transfers.labels(handed.outcome.value).inc()
    log.info("stopping: finishing in-flight requests")
    await grpc_endpoint.stop()
    await runner.cleanup()
    await asyncio.to_thread(close_services, services)
    await asyncio.to_thread(raftlog.close)
    await asyncio.to_thread(node_logs.close)
    log.info("stopped")
    return 0


def _port_setting(config: NodeConfig, setting: str) -> str:
    """The setting that gives a port, and how it was derived (for a bind error)."""
    return next(x.describe() for x in config.listeners() if x.setting == setting)


def fd_budget(config: NodeConfig) -> FdBudget:
    """Raise the open-file limit and share it out (:mod:`chronomq.cluster.process.fdbudget`)."""
    soft, hard = fdbudget.raise_soft_limit()
    budget = fdbudget.plan(soft, config.max_http_connections)
    if budget.cramped:
        log.warning(
            "the open-file limit %d (hard %d) is too low to share out well (%s); raise it",
            soft,
            hard,
            budget.describe(),
        )
    elif budget.http_connections < config.max_http_connections:
        log.warning(
            "max_http_connections %d lowered to %d to fit the open-file limit %d",
            config.max_http_connections,
            budget.http_connections,
            soft,
        )
    return budget


def run(config_path: str | None, overrides: dict[str, str] | None = None) -> int:
    try:
        config = load(config_path, overrides=overrides, warn=False)
        ssl_context = (
            tls.server_context(config.tls_cert_file, config.tls_key_file)
            if config.tls_cert_file
            else None
        )
        tls.peer_context(config)  # a bad tls_ca_file stops the node here, naming the key
    except ConfigError as exc:
        print(f"chronomq node: bad configuration: {exc}", file=sys.stderr)
        return 2
    # Before any thread starts: every thread inherits the blocked signals.
    signals = StopSignals()
    logs.setup(f"node-{config.node_id}", config.log_level, config.log_format)
    warn_renamed(config.renamed_keys)
    log.info("effective config: %s", orjson.dumps(config.masked()).decode())
    if malloc.fix_mmap_threshold():
        log.debug("glibc mmap threshold fixed at %d bytes", malloc.MMAP_THRESHOLD_BYTES)
    try:
        return asyncio.run(serve(config, ssl_context, signals))
    except KeyboardInterrupt:
        return 0
    # The stop deadline stays armed until the interpreter is gone: a thread that never ends
    # would otherwise keep the process at exit.
