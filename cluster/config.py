"""Node configuration: one TOML file per node, every key overridable from the environment.

Every key is declared once in :data:`KEYS` with its type, default, limits, whether it may change
at runtime, and its documentation; the README's configuration reference is generated from this
table (``chronomq config docs``). Names follow RocketMQ's where one exists, in snake_case.
A bad file, key or value stops the node at start with a message naming the key.
"""

from __future__ import annotations

import ipaddress
import os
import tomllib
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from chronomq.raftlog.config import RaftConfig, RaftPeer, default_max_pending_bytes

ENV_PREFIX = "CHRONOMQ_"
MIN_SECRET_CHARS = 16
# Keys naming a file that holds a secret key's value: ``<key>_file`` -> ``<key>``.
SECRET_FILE_KEYS = ("auth_token_file", "cluster_secret_file")


class ConfigError(ValueError):
    """A configuration key has a bad value. ``key`` names it."""

    def __init__(self, key: str, problem: str) -> None:
        super().__init__(f"{key}: {problem}")
        self.key = key
        self.problem = problem


@dataclass(frozen=True, slots=True)
class Key:
    name: str
    type: type
    default: Any
    doc: str
    # Changed cluster-wide with PATCH /v1/admin/config: replicated, applied on every node
    # (how each is carried: cluster/runtimeconfig.py).
    runtime: bool = False
    min: float | None = None
    max: float | None = None
    choices: tuple[str, ...] | None = None
    secret: bool = False
    check: Callable[[Any], str | None] | None = None  # returns a problem or None


def _delay_levels(value: Any) -> str | None:
    from chronomq.schedule.errors import ConfigError as ScheduleConfigError
    from chronomq.schedule.levels import DelayLevelTable

    try:
        DelayLevelTable.parse(value)
    except ScheduleConfigError as exc:
        return exc.problem
    return None


KEYS: tuple[Key, ...] = (
    # Identity and addresses.
    Key("node_id", int, 0, "This node's id, unique in the cluster (0-based).", min=0, max=1023),
    Key(
        "data_dir",
        str,
        "./var/node-0",
        "Directory for the CommitLog, ConsumeQueues, Raft journal and snapshots.",
    ),
    Key("http_host", str, "127.0.0.1", "Address the HTTP API binds to. Loopback by default."),
    Key("http_port", int, 8080, "Port of the HTTP API.", min=1, max=65535),
    Key("raft_host", str, "127.0.0.1", "Address Raft listens on and peers use to reach this node."),
    Key("raft_port", int, 9080, "Port of Raft traffic.", min=1, max=65535),
    Key(
        "fetch_port",
        int,
        0,
        "Port of the CommitLog catch-up channel; 0 means raft_port + 1000.",
        min=0,
        max=65535,
    ),
    Key(
        "grpc_host",
        str,
        "",
        "Address the RocketMQ 5 gRPC endpoint binds to; empty means http_host.",
    ),
    Key(
        "grpc_port",
        int,
        0,
        "Port of the RocketMQ 5 gRPC endpoint (apache.rocketmq.v2.MessagingService); 0 means "
        "http_port + 100. Other members' gRPC ports are derived the same way: their HTTP port "
        "plus this node's offset (grpc_port - http_port).",
        min=0,
        max=65535,
    ),
    Key(
        "grpc_max_concurrent_streams",
        int,
        1000,
        "Most concurrent gRPC calls (streams) one client connection may have open.",
        min=1,
        max=100_000,
    ),
    Key(
        "peers",
        list,
        [],
        "The other members: a list of tables with id, raft (host:port), http (URL) and optionally fetch (host:port).",
    ),
    # Storage.
    Key(
        "flush",
        str,
        "async",
        "Durability (see the README's table): 'async' survives a killed process (bytes reach "
        "the page cache before the answer) and syncs every 500 ms, so a power cut of every "
        "node at once loses at most the last interval; 'sync' also survives a power cut of "
        "every node (Raft journal entries are fsynced, one fsync per group of commands, "
        "before a node counts or acknowledges them).",
        choices=("async", "sync"),
    ),
    Key(
        "commitlog_segment_bytes",
        int,
        128 * 1024 * 1024,
        "CommitLog segment size. Must be equal on every node.",
        min=1 << 16,
        max=1 << 32,
    ),
    Key(
        "file_reserved_time_h",
        float,
        72.0,
        "Hours a CommitLog segment is kept after its last write (RocketMQ's fileReservedTime; "
        "fractions allowed). Older whole segments are deleted, never one holding a message "
        "still waiting in a delay level or the timer wheel.",
        min=0.0,
        max=100_000.0,
    ),
    Key(
        "disk_max_used_space_ratio",
        float,
        0.75,
        "Above this used fraction of the data directory's disk, every expired CommitLog "
        "segment is deleted at once instead of a few per pass (RocketMQ's "
        "diskMaxUsedSpaceRatio). Segments that have not expired are never deleted.",
        min=0.1,
        max=1.0,
    ),
    Key(
        "disk_space_warning_level_ratio",
        float,
        0.90,
        "Above this used fraction of the data directory's disk, produce answers 507 "
        "disk_full with Retry-After; delivery, consumption and admin go on (RocketMQ's "
        "diskSpaceWarningLevelRatio).",
        min=0.1,
        max=1.0,
    ),
    Key(
        "max_message_size",
        int,
        4 * 1024 * 1024,
        "Largest message body in bytes.",
        min=1,
        max=64 * 1024 * 1024,
    ),
    Key(
        "max_request_bytes",
        int,
        16 * 1024 * 1024,
        "Largest HTTP request body in bytes.",
        min=1024,
        max=256 * 1024 * 1024,
    ),
    Key(
        "max_messages_per_request",
        int,
        1000,
        "Most messages in one produce request.",
        min=1,
        max=100_000,
    ),
    Key("max_pull_messages", int, 1000, "Most messages one pull returns.", min=1, max=100_000),
    Key("max_wait_ms", int, 30_000, "Longest long-poll a pull may ask for.", min=0, max=300_000),
    Key(
        "max_pull_bytes",
        int,
        4 * 1024 * 1024,
        "Largest pull answer in bytes: a pull returns messages until the next would take the "
        "JSON answer past this, but always at least one (so a single message larger than this "
        "is still returned alone).",
        min=1024,
        max=256 * 1024 * 1024,
    ),
    # HTTP server limits.
    Key(
        "max_http_connections",
        int,
        1024,
        "Open HTTP connections this node serves at once. At the limit a new connection "
        "displaces the oldest one that has not yet sent a complete request; when every open "
        "connection is inside a request, the new one is answered 503 and closed. Keep it under "
        "the process's open-file limit.",
        min=1,
        max=1_000_000,
    ),
    Key(
        "http_header_timeout_ms",
        int,
        5_000,
        "A new HTTP connection that has not sent the complete headers of its first request "
        "within this is closed (slow or idle clients cannot hold connections).",
        min=100,
        max=600_000,
    ),
    Key(
        "http_body_timeout_ms",
        int,
        30_000,
        "A request body must arrive in full within this after its headers, or the answer is "
        "408 and the connection is closed.",
        min=100,
        max=3_600_000,
    ),
    Key(
        "http_keepalive_timeout_ms",
        int,
        30_000,
        "An HTTP connection idle this long after a response is closed; the next request's "
        "headers must be complete within it.",
        min=100,
        max=3_600_000,
    ),
    Key("auto_create_topic", bool, True, "Create a topic on its first produce."),
    Key("default_topic_queues", int, 4, "Queues of an auto-created topic.", min=1, max=1024),
    # Bounds on growth and on open files.
    Key(
        "max_topics",
        int,
        10_000,
        "Most topics the cluster holds. Creating one more (auto-create on produce, a retry or "
        "DLQ topic) answers 429 too_many_topics naming the topic; checked at the edge and at "
        "apply, so every replica agrees. Set it equal on every node.",
        min=1,
        max=1_000_000,
    ),
    Key(
        "max_queues",
        int,
        80_000,
        "Most queues over all topics; past it topic creation answers 429 too_many_topics like "
        "max_topics. Set it equal on every node.",
        min=1,
        max=10_000_000,
    ),
    Key(
        "max_topics_listed",
        int,
        1_000,
        "Most topics one GET /v1/topics answers; it pages on with ?after=<last topic> and says "
        "truncated: true when more follow.",
        min=1,
        max=100_000,
    ),
    # Group commit and Raft.
    Key(
        "batch_max_messages",
        int,
        512,
        "Most messages in one Raft command (group commit).",
        min=1,
        max=100_000,
    ),
    Key(
        "batch_max_bytes",
        int,
        1024 * 1024,
        "Most bytes in one Raft command.",
        min=1024,
        max=64 * 1024 * 1024,
    ),
    Key(
        "max_inflight_commands",
        int,
        64,
        "Raft commands proposed and not yet committed.",
        min=1,
        max=10_000,
    ),
    Key(
        "max_pending_messages",
        int,
        200_000,
        "Messages waiting for commit before produce answers 429.",
        min=1,
        max=10_000_000,
    ),
    Key(
        "max_pending_bytes",
        int,
        0,
        "Bytes of produce requests held by the leader (bodies being read, batches waiting "
        "for commit or in flight) before produce answers 429 with Retry-After at once; "
        "0 derives it: min(64 MiB, 1/16 of RAM), at least 16 MiB, so that what is held commits "
        "well within commit_timeout_ms. A single request is always taken when nothing else "
        "is held.",
        min=0,
        max=1 << 40,
    ),
    Key(
        "commit_timeout_ms",
        int,
        10_000,
        "How long a produce waits for its commit. Writes are refused (429 overloaded) while "
        "the oldest one not yet committed has waited a quarter of it.",
        min=100,
        max=600_000,
    ),
    Key(
        "idempotency_window",
        int,
        20_000,
        "Internal batches (the node's own writes) remembered by count to drop retried "
        "duplicates. Client keys no longer count here: see idempotency_window_s.",
        min=100,
        max=10_000_000,
    ),
    Key(
        "idempotency_window_s",
        int,
        600,
        "How long a client's Idempotency-Key is remembered (with a hash of its request), "
        "measured in the leader's propose times: a retry within it answers the first "
        "placement, the same key with another request answers 422 idempotency_key_reused.",
        min=1,
        max=7 * 24 * 3600,
    ),
    Key(
        "idempotency_max_keys",
        int,
        100_000,
        "Most client Idempotency-Keys remembered: about 230 bytes of memory and 71 bytes of "
        "snapshot each (23 MB and 7 MB at the default), and writing a snapshot takes about "
        "1.5 s per million on the Raft thread. When full, the oldest keys are forgotten before "
        "their window ends: a retry with a forgotten key is stored again.",
        min=1000,
        max=20_000_000,
    ),
    Key(
        "append_entries_period_ms",
        int,
        50,
        "Raft heartbeat and batching period.",
        min=1,
        max=10_000,
    ),
    Key(
        "append_entries_use_batch",
        bool,
        False,
        "Send Raft entries on the heartbeat period (true) or at once (false). Group commit makes "
        "'at once' affordable: it halves commit latency and doubles throughput here.",
    ),
    Key(
        "append_entries_batch_bytes",
        int,
        4 * 1024 * 1024,
        "Most bytes of Raft entries in one message.",
        min=65536,
        max=64 * 1024 * 1024,
    ),
    Key(
        "wire_compression_level",
        int,
        0,
        "zlib level of Raft messages (0 stores; 1-9 trade CPU for bandwidth).",
        min=0,
        max=9,
    ),
    Key(
        "raft_min_timeout_ms",
        int,
        1000,
        "Lower bound of the election timeout. The heartbeat budget: a follower busy with a "
        "large entry (up to max_message_size, or one append batch of a larger request) must "
        "hear the leader within it; 300 deposed leaders under 4 MiB messages on 2 cores.",
        min=10,
        max=60_000,
    ),
    Key(
        "raft_max_timeout_ms",
        int,
        2000,
        "Upper bound of the election timeout.",
        min=20,
        max=120_000,
    ),
    Key(
        "connection_timeout_ms", int, 60_000, "Raft connection idle timeout.", min=100, max=600_000
    ),
    Key(
        "leader_fallback_timeout_ms",
        int,
        3_000,
        "A leader without a quorum's answers steps down after this.",
        min=100,
        max=600_000,
    ),
    Key(
        "leader_lease_ms",
        int,
        1_500,
        "A leader that commits nothing for this long stops leader-only work.",
        min=100,
        max=600_000,
    ),
    Key(
        "log_compaction_min_entries",
        int,
        1_000,
        "A thin snapshot is taken once more Raft entries than this are in the log.",
        min=10,
        max=10_000_000,
    ),
    Key(
        "log_compaction_min_time_s",
        int,
        60,
        "A thin snapshot is taken at least this often while commands are applied.",
        min=1,
        max=86_400,
    ),
    Key(
        "log_compaction_max_bytes",
        int,
        32 * 1024 * 1024,
        "A thin snapshot is taken once the applied Raft entries kept in memory exceed this "
        "many bytes; bounds every node's memory under a burst of large commands.",
        min=1024 * 1024,
        max=4 * 1024 * 1024 * 1024,
    ),
    # Security.
    Key(
        "auth_token",
        str,
        "",
        "Bearer token every HTTP route requires (but /healthz and /readyz, and /metrics when "
        "metrics_public), and every gRPC call (as `authorization: Bearer <token>` metadata, or "
        "a RocketMQ client's credentials with the token as secret key); empty disables. Prefer auth_token_file or CHRONOMQ_AUTH_TOKEN: a "
        "secret is never taken on a command line.",
        secret=True,
    ),
    Key(
        "auth_token_file",
        str,
        "",
        "File holding auth_token (one line; must not be readable by group or others).",
    ),
    Key(
        "cluster_secret",
        str,
        "",
        "Secret every Raft and catch-up connection proves with HMAC, at least 16 characters. "
        "From the config file, CHRONOMQ_CLUSTER_SECRET or cluster_secret_file; never a command "
        "line. Empty is allowed only on loopback (`cluster up` generates one per data directory).",
        secret=True,
    ),
    Key(
        "cluster_secret_file",
        str,
        "",
        "File holding cluster_secret (must not be readable by group or others).",
    ),
    Key(
        "allow_insecure",
        bool,
        False,
        "Let a node bind Raft or HTTP to a non-loopback address without a cluster_secret and an "
        "auth_token. For networks you trust completely.",
    ),
    Key(
        "metrics_public",
        bool,
        False,
        "Serve /metrics without the bearer token (for a Prometheus that cannot send one).",
    ),
    Key(
        "tls_cert_file",
        str,
        "",
        "PEM certificate (chain) for HTTPS; with tls_key_file the HTTP API speaks TLS only.",
    ),
    Key("tls_key_file", str, "", "PEM private key of tls_cert_file."),
    Key(
        "tls_ca_file",
        str,
        "",
        "PEM bundle a node trusts for its peers' HTTPS; empty: the system's, plus tls_cert_file.",
    ),
    # Logs.
    Key(
        "log_level",
        str,
        "info",
        "The least severe level of log line written (by this process: ours and the libraries'; "
        "pysyncobj's stay at error or above).",
        runtime=True,
        choices=("debug", "info", "warning", "error"),
    ),
    Key(
        "log_format",
        str,
        "auto",
        "Log lines as 'json', 'text', or 'auto' (JSON when not on a terminal).",
        choices=("auto", "json", "text"),
    ),
    Key(
        "ops_log_dir",
        str,
        "",
        "Directory for replication/latency/event logs read by `chronomq report`; empty: <data_dir>/ops.",
    ),
    Key("ops_log_enabled", bool, True, "Write replication, latency and event logs.", runtime=True),
    Key(
        "ops_log_retention_h",
        int,
        72,
        "Rotated ops log files older than this many hours are deleted; 0 keeps them.",
        min=0,
        max=100_000,
    ),
    Key(
        "ops_log_max_bytes",
        int,
        8 * 1024 * 1024 * 1024,
        "Bound on one node's ops log files together: past it rotated files are deleted, "
        "oldest first (the files being written are kept); 0 means no bound.",
        min=0,
        max=1 << 50,
    ),
    Key(
        "ops_log_sample_rate",
        float,
        1.0,
        "Fraction of messages (latency) and Raft commands (replication) logged, the same ones on every node; events are always logged.",
        runtime=True,
        min=0.0,
        max=1.0,
    ),
    # Schedule service (RocketMQ 4.x delay levels).
    Key(
        "message_delay_level",
        str,
        "1s 5s 10s 30s 1m 2m 3m 4m 5m 6m 7m 8m 9m 10m 20m 30m 1h 2h",
        "Delay levels, space-separated, units s m h d.",
        check=_delay_levels,
    ),
    Key(
        "enable_schedule_async_deliver",
        bool,
        False,
        "Deliver delayed messages asynchronously. At runtime it is the schedule's replicated "
        'mode: PATCH /v1/admin/config and PATCH /v1/admin/schedule {"mode"} change the same '
        "state.",
        runtime=True,
    ),
    Key(
        "schedule_async_deliver_max_pending_limit",
        int,
        2000,
        "In-flight async deliveries per level.",
        min=1,
        max=1_000_000,
    ),
    Key(
        "schedule_async_deliver_max_resend_num_to_blocked",
        int,
        3,
        "Failures before a level blocks.",
        min=1,
        max=1000,
    ),
    Key(
        "max_reconsume_times",
        int,
        16,
        "Retries before a message goes to the group's DLQ.",
        min=0,
        max=1000,
    ),
    # Renewal of auto_renew receives over gRPC (RocketMQ's proxy: enableProxyAutoRenew,
    # defaultInvisibleTimeMills, renewMaxTimeMillis).
    Key(
        "enable_proxy_auto_renew",
        bool,
        True,
        "Renew the invisible time of messages received over gRPC with auto_renew (a push "
        "consumer) until they are acked, changed, sent to the DLQ, their consumer goes away "
        "or renew_max_time_ms passes. The node that served the receive renews them; off, "
        "such a message is handed out again after default_invisible_time_ms.",
    ),
    Key(
        "default_invisible_time_ms",
        int,
        60_000,
        "Invisible time of a gRPC receive with auto_renew (whatever invisible duration it "
        "names, as RocketMQ's proxy does), and what each renewal adds; a renewal happens "
        "when less than a third of it is left.",
        min=1_000,  # chronomq.cluster.pop.state.MIN_INVISIBLE_MS
        max=12 * 3_600_000,  # chronomq.cluster.pop.state.MAX_INVISIBLE_MS
    ),
    Key(
        "renew_max_time_ms",
        int,
        3 * 3_600_000,
        "Longest a message received with auto_renew is kept invisible by renewals, counted "
        "from its receive; then it is no longer renewed and comes back at the end of its "
        "current invisible time.",
        min=1_000,
        max=7 * 24 * 3_600_000,
    ),
    Key(
        "renew_max_tracked",
        int,
        10_000,
        "Most auto_renew hand-outs one node renews at once (about 0.5 KB each). Past it the "
        "oldest is no longer renewed (chronomq_grpc_auto_renew_stopped_total{reason="
        '"dropped"}): it comes back at the end of its current invisible time, and an ack '
        "with its first receipt handle after a renewal answers INVALID_RECEIPT_HANDLE.",
        min=1,
        max=1_000_000,
    ),
    Key(
        "renew_max_per_second",
        int,
        300,
        "Most renewals one node proposes per second (each changes a hand-out's invisible "
        "time through Raft, up to 64 per command on the leader). Renewals due beyond it wait "
        "(chronomq_grpc_auto_renew_deferred_total), most urgent first; to keep up it must be "
        "at least renew_max_tracked / (2/3 x default_invisible_time_ms in s): 250 for the "
        "defaults.",
        min=1,
        max=100_000,
    ),
    # Timer service (RocketMQ 5.x, RIP-43).
    Key("timer_precision_ms", int, 100, "Timer wheel slot width.", min=10, max=1000),
    Key(
        "timer_max_delay_sec",
        int,
        365 * 86400,
        "Longest accepted timer delay.",
        min=1,
        max=10 * 365 * 86400,
    ),
    Key(
        "timer_roll_window_slots",
        int,
        3600 * 10 * 2,
        "Wheel window; later messages roll.",
        min=10,
        max=100_000_000,
    ),
    Key(
        "timer_congest_num_each_slot",
        int,
        1_000_000_000,
        "Messages one slot accepts before 429.",
        min=1,
        max=10**12,
    ),
    Key(
        "timer_stop_enqueue",
        bool,
        False,
        "Stop reading new timer messages into the wheel. At runtime it is the timer's "
        "replicated switch (also POST /v1/admin/timer/switches).",
        runtime=True,
    ),
    Key(
        "timer_stop_dequeue",
        bool,
        False,
        "Stop delivering timer messages. At runtime it is the timer's replicated switch (also "
        "POST /v1/admin/timer/switches).",
        runtime=True,
    ),
)

KEY_BY_NAME = {k.name: k for k in KEYS}


def parse_value(name: str, value: Any) -> Any:
    """``value`` (as JSON or TOML gives it) checked against key ``name``'s type and limits;
    :class:`ConfigError` naming the key when it does not fit."""
    key = KEY_BY_NAME.get(name)
    if key is None:
        raise ConfigError(name, "unknown key")
    return _coerce(key, value, from_env=False)


def _coerce(key: Key, value: Any, from_env: bool) -> Any:  # noqa: C901
    t = key.type
    if from_env and isinstance(value, str):
        try:
            if t is bool:
                low = value.strip().lower()
                if low in ("1", "true", "yes", "on"):
                    value = True
                elif low in ("0", "false", "no", "off"):
                    value = False
                else:
                    raise ValueError(value)
            elif t is int:
                value = int(value)
            elif t is float:
                value = float(value)
            elif t is list:
                value = tomllib.loads(f"v = {value}")["v"]
        except (ValueError, tomllib.TOMLDecodeError):
            raise ConfigError(key.name, f"cannot read {value!r} as {t.__name__}") from None
    if t is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if t is int and isinstance(value, bool) or not isinstance(value, t):
        raise ConfigError(key.name, f"must be {t.__name__}, got {type(value).__name__} {value!r}")
    number: Any = value
    if t is float and number != number:  # NaN passes every comparison
        raise ConfigError(key.name, "must be a number, got NaN")
    if key.min is not None and number < key.min:
        raise ConfigError(key.name, f"must be >= {key.min}, got {value}")
    if key.max is not None and number > key.max:
        raise ConfigError(key.name, f"must be <= {key.max}, got {value}")
    if key.choices is not None and value not in key.choices:
        raise ConfigError(key.name, f"must be one of {', '.join(key.choices)}, got {value!r}")
    if key.check is not None:
        problem = key.check(value)
        if problem:
            raise ConfigError(key.name, problem)
    return value


@dataclass(frozen=True, slots=True)
class Peer:
    id: int
    raft: str
    http: str
    fetch: str


class NodeConfig:
    """Validated settings of one node. Attribute access by key name."""

    def __init__(self, values: Mapping[str, Any]) -> None:
        self._values = dict(values)
        self.peers = self._parse_peers(self._values["peers"])
        self._check_security()
        if self._values["raft_min_timeout_ms"] >= self._values["raft_max_timeout_ms"]:
            raise ConfigError("raft_max_timeout_ms", "must be greater than raft_min_timeout_ms")
        if not self._values["grpc_port"] and self._values["http_port"] + 100 > 65535:
            raise ConfigError("grpc_port", "set it: http_port + 100 is not a port")
        if self._values["raft_min_timeout_ms"] <= 3 * self._values["append_entries_period_ms"]:
            raise ConfigError(
                "raft_min_timeout_ms", "must be more than 3 x append_entries_period_ms"
            )

    def __getattr__(self, name: str) -> Any:
        try:
            return self._values[name]
        except KeyError:
            raise AttributeError(name) from None

    def _parse_peers(self, peers: list[Any]) -> tuple[Peer, ...]:
        out = []
        seen = {self._values["node_id"]}
        for i, p in enumerate(peers):
            if not isinstance(p, dict):
                raise ConfigError("peers", f"entry {i} must be a table with id, raft and http")
            try:
                pid = int(p["id"])
                raft = str(p["raft"])
                http = str(p["http"]).rstrip("/")
            except (KeyError, TypeError, ValueError):
                raise ConfigError(
                    "peers", f"entry {i} needs id (int), raft (host:port) and http (URL)"
                ) from None
            if pid in seen:
                raise ConfigError("peers", f"id {pid} appears twice (or equals node_id)")
            seen.add(pid)
            problem = host_port_problem(raft)
            if problem:
                raise ConfigError("peers", f"entry {i}: raft {problem}")
            host, _, port = raft.rpartition(":")
            fetch = str(p.get("fetch") or f"{host}:{int(port) + 1000}")
            problem = host_port_problem(fetch)
            if problem:
                raise ConfigError("peers", f"entry {i}: fetch {problem}")
            problem = http_url_problem(http)
            if problem:
                raise ConfigError("peers", f"entry {i}: http {problem}")
            out.append(Peer(pid, raft, http, fetch))
        return tuple(out)

    def _check_security(self) -> None:
        v = self._values
        secret = v["cluster_secret"]
        if secret and len(secret) < MIN_SECRET_CHARS:
            raise ConfigError(
                "cluster_secret", f"must be at least {MIN_SECRET_CHARS} characters long"
            )
        if bool(v["tls_cert_file"]) != bool(v["tls_key_file"]):
            missing = "tls_key_file" if v["tls_cert_file"] else "tls_cert_file"
            raise ConfigError(missing, "tls_cert_file and tls_key_file go together")
        if v["allow_insecure"]:
            return
        exposed = [
            name
            for name in ("raft_host", "http_host", "grpc_host")
            if v[name] and not is_loopback_host(v[name])
        ]
        if not exposed:
            return
        for key in ("cluster_secret", "auth_token"):
            if not v[key]:
                raise ConfigError(
                    key,
                    f"required when {exposed[0]} ({v[exposed[0]]}) is not a loopback address: "
                    f"set {key} or {key}_file (or allow_insecure = true on a network you trust "
                    "completely)",
                )

    @property
    def cluster_secret_bytes(self) -> bytes:
        """The cluster secret as the HMAC key peers prove (empty: none configured)."""
        return str(self._values["cluster_secret"]).encode()

    @property
    def raft_address(self) -> str:
        return f"{self.raft_host}:{self.raft_port}"

    @property
    def fetch_address(self) -> str:
        return f"{self.raft_host}:{self.fetch_port or self.raft_port + 1000}"

    @property
    def grpc_listen_port(self) -> int:
        """The gRPC endpoint's port: ``grpc_port``, or ``http_port + 100`` when it is 0."""
        return int(self.grpc_port or self.http_port + 100)

    @property
    def grpc_bind_host(self) -> str:
        return str(self.grpc_host or self.http_host)

    @property
    def http_url(self) -> str:
        scheme = "https" if self.tls_cert_file else "http"
        return f"{scheme}://{self.http_host}:{self.http_port}"

    def values(self) -> dict[str, Any]:
        return dict(self._values)

    def masked(self) -> dict[str, Any]:
        """The effective config with secrets masked, for logs and the admin API."""
        return {
            k: ("***" if KEY_BY_NAME[k].secret and v else v)
            for k, v in self._values.items()
            if k in KEY_BY_NAME
        }

    def with_changes(self, changes: Mapping[str, Any]) -> NodeConfig:
        values = dict(self._values)
        for name, value in changes.items():
            key = KEY_BY_NAME.get(name)
            if key is None:
                raise ConfigError(name, "unknown key")
            values[name] = _coerce(key, value, from_env=False)
        return NodeConfig(values)

    def raft_config(self) -> RaftConfig:
        return RaftConfig(
            data_dir=self.data_dir,
            raft_address=self.raft_address,
            fetch_address=self.fetch_address,
            peers=tuple(RaftPeer(p.raft, p.fetch) for p in self.peers),
            flush=self.flush,
            commitlog_segment_bytes=self.commitlog_segment_bytes,
            max_message_bytes=self.max_message_size,
            batch_max_messages=self.batch_max_messages,
            batch_max_bytes=self.batch_max_bytes,
            max_inflight_commands=self.max_inflight_commands,
            max_pending_messages=self.max_pending_messages,
            max_pending_bytes=self.max_pending_bytes or default_max_pending_bytes(),
            commit_timeout_ms=self.commit_timeout_ms,
            idempotency_window=self.idempotency_window,
            idempotency_window_s=self.idempotency_window_s,
            idempotency_max_keys=self.idempotency_max_keys,
            default_topic_queues=self.default_topic_queues,
            max_topics=self.max_topics,
            max_queues=self.max_queues,
            append_entries_period_ms=self.append_entries_period_ms,
            append_entries_use_batch=self.append_entries_use_batch,
            append_entries_batch_bytes=self.append_entries_batch_bytes,
            wire_compression_level=self.wire_compression_level,
            raft_min_timeout_ms=self.raft_min_timeout_ms,
            raft_max_timeout_ms=self.raft_max_timeout_ms,
            connection_timeout_ms=self.connection_timeout_ms,
            leader_fallback_timeout_ms=self.leader_fallback_timeout_ms,
            leader_lease_ms=self.leader_lease_ms,
            log_compaction_min_entries=self.log_compaction_min_entries,
            log_compaction_min_time_s=self.log_compaction_min_time_s,
            log_compaction_max_bytes=self.log_compaction_max_bytes,
            cluster_secret=self.cluster_secret_bytes,
        )


def load(
    path: str | os.PathLike[str] | None = None,
    *,
    overrides: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> NodeConfig:
    """Defaults, then the TOML file, then ``CHRONOMQ_*`` variables, then ``overrides``."""
    values: dict[str, Any] = {k.name: k.default for k in KEYS}
    if path is not None:
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except FileNotFoundError:
            raise ConfigError("config", f"file {path} does not exist") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError("config", f"{path} is not valid TOML: {exc}") from None
        for name, value in data.items():
            key = KEY_BY_NAME.get(name)
            if key is None:
                raise ConfigError(name, f"unknown key in {path}")
            values[name] = _coerce(key, value, from_env=False)
    env = os.environ if environ is None else environ
    for key in KEYS:
        raw = env.get(ENV_PREFIX + key.name.upper())
        if raw is not None:
            values[key.name] = _coerce(key, raw, from_env=True)
    for name, value in (overrides or {}).items():
        key = KEY_BY_NAME.get(name)
        if key is None:
            raise ConfigError(name, "unknown key")
        values[name] = _coerce(key, value, from_env=isinstance(value, str) and key.type is not str)
    for name in ("data_dir", "ops_log_dir"):
        if values[name]:
            values[name] = str(Path(values[name]).expanduser().absolute())
    for name in SECRET_FILE_KEYS:
        _read_secret_file(values, name)
    return NodeConfig(values)


def host_port_problem(value: object) -> str | None:
    """Why ``value`` is not ``host:port`` (a port 1..65535, a host without spaces), or None."""
    if not isinstance(value, str):
        return "must be a string host:port"
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        return f"must be host:port with a port 1..65535, got {value!r}"
    if any(c.isspace() or ord(c) < 32 for c in host) or "/" in host or "@" in host:
        return f"the host may not contain spaces, control characters, / or @, got {host!r}"
    return None


def http_url_problem(value: object) -> str | None:
    """Why ``value`` is not an ``http(s)://host[:port]`` URL, or None."""
    if not isinstance(value, str):
        return "must be a string URL"
    if any(c.isspace() or ord(c) < 32 for c in value):
        return f"must be a URL without spaces or control characters, got {value!r}"
    try:
        url = urllib.parse.urlsplit(value)
        port = url.port
    except ValueError as exc:
        return f"must be a URL ({exc}), got {value!r}"
    if url.scheme not in ("http", "https") or not url.hostname:
        return f"must be an http:// or https:// URL with a host, got {value!r}"
    if url.username or url.password or url.query or url.fragment or url.path not in ("", "/"):
        return f"must be scheme://host[:port] only, got {value!r}"
    if port == 0:
        return f"must have a port 1..65535, got {value!r}"
    return None


def is_loopback_host(host: str) -> bool:
    """True for ``localhost`` and loopback IP addresses; any other name or address is not."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _read_secret_file(values: dict[str, Any], file_key: str) -> None:
    """Fill the secret ``file_key`` names (``auth_token_file`` -> ``auth_token``) from its file."""
    path = values[file_key]
    if not path:
        return
    key = file_key.removesuffix("_file")
    if values[key]:
        raise ConfigError(file_key, f"set {key} or {file_key}, not both")
    try:
        st = os.stat(path)
        if st.st_mode & 0o077:
            raise ConfigError(
                file_key,
                f"{path} is readable or writable by group or others "
                f"(mode {st.st_mode & 0o777:o}); chmod 600 it",
            )
        with open(path, encoding="utf-8") as f:
            secret = f.read().strip()
    except OSError as exc:
        raise ConfigError(file_key, f"cannot read {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(file_key, f"{path} is not UTF-8 text") from None
    if not secret:
        raise ConfigError(file_key, f"{path} is empty")
    values[key] = secret


def to_toml(values: Mapping[str, Any]) -> str:
    """Write a config as TOML (for ``cluster up``)."""
    lines = []
    tables = []
    for name, value in values.items():
        if name == "peers":
            for p in value:
                body = "\n".join(f"{k} = {_toml_value(v)}" for k, v in p.items())
                tables.append(f"[[peers]]\n{body}\n")
            continue
        lines.append(f"{name} = {_toml_value(value)}")
    return "\n".join(lines) + "\n\n" + "\n".join(tables)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    s = str(v).replace("\\", "\\\\").replace('"', '\\"')
    return f'"{s}"'
