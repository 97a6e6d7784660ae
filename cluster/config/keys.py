"""The configuration keys: one row per key, the table every other part reads.

Each :class:`Key` gives a key's name, type, default, limits, whether it may change at runtime,
and its documentation. :class:`chronomq.cluster.config.nodeconfig.NodeConfig` has one typed attribute per
row (checked when it is imported), loading and validation live in :mod:`chronomq.cluster.config.nodeconfig`,
and the configuration reference (docs/reference/config.md) is generated from this table
(``chronomq config reference``).

Names follow RocketMQ's where one exists, in snake_case, with the unit last: ``_ms``, ``_s``,
``_h``, ``_bytes``; a count names what it counts (``_messages``, ``_batches``, ``_slots``).
A key renamed for that keeps its old name in ``formerly`` for one release.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

ENV_PREFIX: Final = "CHRONOMQ_"
"""A key's environment variable is this prefix and its name in capitals."""


@dataclass(frozen=True, slots=True)
class Key:
    name: str
    type: type
    default: Any
    doc: str
    # Changed cluster-wide with PATCH /v1/admin/config: replicated, applied on every node
    # (how each is carried: cluster/node/runtimeconfig.py).
    runtime: bool = False
    min: float | None = None
    max: float | None = None
    choices: tuple[str, ...] | None = None
    secret: bool = False
    check: Callable[[Any], str | None] | None = None  # returns a problem or None
    # The key's name before it was renamed: still accepted in config files, CHRONOMQ_*
    # variables, --set and PATCH /v1/admin/config, with a warning naming both, for one release.
    formerly: str | None = None


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
        "Port of the CommitLog catch-up channel; 0 means raft_port + 1000. A node whose "
        "http_port, grpc_port, raft_port and fetch_port are not four different ports (on one "
        "address) does not start, naming both keys.",
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
        "grpc_max_telemetry_streams",
        int,
        2000,
        "Most Telemetry streams the gRPC endpoint holds open at once (an official client holds "
        "one per node while it runs); one more is refused with RESOURCE_EXHAUSTED. At most half "
        "the endpoint's 10,000 calls, so sends, receives and acks always have room. A client id "
        "holds at most 8 (its next one closes its oldest), a connection at most 16.",
        min=1,
        max=5_000,
    ),
    Key(
        "grpc_telemetry_settings_timeout_ms",
        int,
        10_000,
        "How long a new Telemetry stream may stay open without sending its settings (official "
        "clients send them at once) before the node closes it.",
        min=100,
        max=600_000,
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
        "Durability (see the durability table in the docs): 'async' survives a killed process "
        "(bytes reach "
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
        "max_message_bytes",
        int,
        4 * 1024 * 1024,
        "Largest message body in bytes.",
        min=1,
        max=64 * 1024 * 1024,
        formerly="max_message_size",
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
        "follower_read_timeout_ms",
        int,
        5_000,
        "Longest a follower waits, before it answers a read with no such topic or an empty "
        "page, to learn the leader's commit index and apply that far (so that it answers only "
        "once it holds every write acknowledged before the read); past it the read answers "
        "503 replica_behind.",
        min=10,
        max=300_000,
    ),
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
    Key(
        "forward_long_polls",
        int,
        256,
        "Long polls (receives that wait for messages) a follower forwards to the leader at "
        "once, each holding a connection of its own, apart from the connections that forward "
        "writes (so waiting receives never delay a produce). A receive past this waits for a "
        "slot within its own wait and answers with no messages if none comes free. Keep the "
        "followers' sum under the leader's max_http_connections.",
        min=1,
        max=100_000,
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
        "idempotency_window_batches",
        int,
        20_000,
        "Internal batches (the node's own writes) remembered by count to drop retried "
        "duplicates. Client keys no longer count here: see idempotency_window_s.",
        min=100,
        max=10_000_000,
        formerly="idempotency_window",
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
        "large entry (up to max_message_bytes, or one append batch of a larger request) must "
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
        "raft_leader_lost_ms",
        int,
        100,
        "A follower whose connection to its leader closed (the leader's process died) and "
        "that heard nothing from it for this long (plus a random part of it) asks for votes "
        "at once instead of waiting out the election timeout; peers still hearing the leader "
        "refuse. 0 turns the fast path off (silent failures always wait for the timeout).",
        min=0,
        max=60_000,
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
        "access_key",
        str,
        "",
        "The access key RocketMQ 5 clients give with auth_token as their secret key "
        "(`Credentials(access_key, token)`): when set, a signed gRPC call must name it. Empty "
        "accepts any access key (the token alone proves the caller).",
    ),
    Key(
        "grpc_signature_window_s",
        int,
        900,
        "How far a signed gRPC call's x-mq-date-time may lie from the node's clock, in seconds, "
        "either way, as RocketMQ's ACL allows (15 minutes): a captured signature stops working "
        "after it. The official clients write their local time with a Z, so a client clock in "
        "another time zone than UTC and the node's needs a window that covers the difference.",
        min=1,
        max=172_800,
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
        "oldest first (the files being written are kept, and rotate at 64 MiB or a twelfth of "
        "this bound, whichever is smaller, at least 16 KiB); 0 means no bound.",
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
        min=1_000,  # chronomq.pop.state.MIN_INVISIBLE_MS
        max=12 * 3_600_000,  # chronomq.pop.state.MAX_INVISIBLE_MS
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
        "timer_max_delay_s",
        int,
        365 * 86400,
        "Longest accepted timer delay (RocketMQ's timerMaxDelaySec).",
        min=1,
        max=10 * 365 * 86400,
        formerly="timer_max_delay_sec",
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
        "timer_log_segment_bytes",
        int,
        64 * 1024 * 1024,
        "Size of one TimerLog segment file (80-byte records, one per timer message in the "
        "wheel). Whole segments that no unread slot, pending roll or cancel still reaches "
        "into are deleted at the node's checkpoints, so a smaller segment gives disk back "
        "sooner. It decides where records lie, so every node of a cluster must have the same "
        "value (a node with another refuses to apply timer commands), and it cannot change "
        "on an existing data directory.",
        min=80,
        max=2**30,
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

KEY_BY_NAME: Final[Mapping[str, Key]] = {k.name: k for k in KEYS}

RENAMED: Final[Mapping[str, str]] = {k.formerly: k.name for k in KEYS if k.formerly}
"""Old name -> current name, for each renamed key."""
