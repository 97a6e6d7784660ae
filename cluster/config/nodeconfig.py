"""Node configuration: one TOML file per node, every key overridable from the environment.

The keys themselves (type, default, limits, documentation) are the table in
:mod:`chronomq.cluster.config.keys`. This module reads them: defaults, then the TOML file, then
``CHRONOMQ_*`` variables, then overrides (``--set``), each value checked against its key, into a
:class:`NodeConfig` with one typed attribute per key. A bad file, key or value stops the node at
start with a message naming the key. A renamed key's old name is still accepted for one
release: it is read as the new one, and a warning naming both is logged once per key.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import tomllib
import urllib.parse
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from chronomq.cluster.config.keys import ENV_PREFIX, KEY_BY_NAME, KEYS, RENAMED, Key
from chronomq.raftlog.config import RaftConfig, RaftPeer, default_max_pending_bytes

log = logging.getLogger(__name__)

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
class Listener:
    """A port a node listens on: the setting that gives it, the address, and what it is
    derived from when the setting is 0 (empty: set directly)."""

    setting: str
    host: str
    port: int
    derived_from: str

    def describe(self) -> str:
        if self.derived_from:
            return f"{self.setting} ({self.derived_from} = {self.port})"
        return f"{self.setting} ({self.port})"


_ANY_HOST = frozenset({"", "0.0.0.0", "::", "*", "[::]"})


def hosts_overlap(a: str, b: str) -> bool:
    """Whether listening on ``a`` and on ``b`` with one port would clash."""
    names = {"localhost": "127.0.0.1"}
    a, b = names.get(a, a), names.get(b, b)
    return a == b or a in _ANY_HOST or b in _ANY_HOST


# ---------------------------------------------------------------------- renamed keys

_warned: set[str] = set()


def current_name(name: str) -> str:
    """``name``, or the current name of the key once called ``name`` (warned about once)."""
    new = RENAMED.get(name)
    if new is None:
        return name
    warn_renamed((name,))
    return new


def warn_renamed(old_names: Iterable[str]) -> None:
    """Log that each old key name is deprecated, naming its new name: once per name and
    process."""
    for old in old_names:
        if old in _warned:
            continue
        _warned.add(old)
        new = RENAMED[old]
        log.warning(
            "config key %s is renamed %s (environment %s%s): the old name is still read in "
            "this release only; use the new one",
            old,
            new,
            ENV_PREFIX,
            new.upper(),
        )


def _read(
    items: Iterable[tuple[str, Any]],
    read: Callable[[Key, Any], Any],
    renamed: list[str],
    unknown: str = "unknown key",
) -> dict[str, Any]:
    """The ``(name, value)`` pairs of one source, each value checked by ``read``, keyed by the
    keys' current names; the old names met are added to ``renamed``. An unknown name, or a key
    named both ways, is a :class:`ConfigError`."""
    out: dict[str, Any] = {}
    for name, value in items:
        current = RENAMED.get(name, name)
        key = KEY_BY_NAME.get(current)
        if key is None:
            raise ConfigError(name, unknown)
        if current in out:
            raise ConfigError(current, f"set {current} or its old name {key.formerly}, not both")
        if current != name:
            renamed.append(name)
        out[current] = read(key, value)
    return out


# ---------------------------------------------------------------------- values


def parse_value(name: str, value: Any) -> Any:
    """``value`` (as JSON or TOML gives it) checked against key ``name``'s type and limits;
    :class:`ConfigError` naming the key when it does not fit."""
    key = KEY_BY_NAME.get(name)
    if key is None:
        raise ConfigError(name, "unknown key")
    return _coerce(key, value, from_env=False)


def parse_setting(name: str, value: Any) -> Any:
    """A value given for key ``name`` by a caller (``--set``, a test's or a drill's settings),
    checked; a string is read as from the environment."""
    key = KEY_BY_NAME.get(name)
    if key is None:
        raise ConfigError(name, "unknown key")
    return _from_setting(key, value)


def _from_file(key: Key, value: Any) -> Any:
    return _coerce(key, value, from_env=False)


def _from_env(key: Key, value: Any) -> Any:
    return _coerce(key, value, from_env=True)


def _from_setting(key: Key, value: Any) -> Any:
    return _coerce(key, value, from_env=isinstance(value, str) and key.type is not str)


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
    """Validated settings of one node: one typed attribute per key of
    :data:`~chronomq.cluster.config.keys.KEYS`, in the table's order (checked below, at import).

    ``peers`` holds the checked :class:`Peer` entries; :meth:`values` gives every key as it was
    set. ``renamed_keys`` names the old key names this config was given (see
    :func:`warn_renamed`).
    """

    # Identity and addresses.
    node_id: int
    data_dir: str
    http_host: str
    http_port: int
    raft_host: str
    raft_port: int
    fetch_port: int
    grpc_host: str
    grpc_port: int
    grpc_max_concurrent_streams: int
    grpc_max_telemetry_streams: int
    grpc_telemetry_settings_timeout_ms: int
    peers: tuple[Peer, ...]
    # Storage.
    flush: str
    commitlog_segment_bytes: int
    file_reserved_time_h: float
    disk_max_used_space_ratio: float
    disk_space_warning_level_ratio: float
    max_message_bytes: int
    max_request_bytes: int
    max_messages_per_request: int
    max_pull_messages: int
    max_wait_ms: int
    follower_read_timeout_ms: int
    max_pull_bytes: int
    forward_long_polls: int
    # HTTP server limits.
    max_http_connections: int
    http_header_timeout_ms: int
    http_body_timeout_ms: int
    http_keepalive_timeout_ms: int
    auto_create_topic: bool
    default_topic_queues: int
    # Bounds on growth and on open files.
    max_topics: int
    max_queues: int
    max_topics_listed: int
    # Group commit and Raft.
    batch_max_messages: int
    batch_max_bytes: int
    max_inflight_commands: int
    max_pending_messages: int
    max_pending_bytes: int
    commit_timeout_ms: int
    idempotency_window_batches: int
    idempotency_window_s: int
    idempotency_max_keys: int
    append_entries_period_ms: int
    append_entries_use_batch: bool
    append_entries_batch_bytes: int
    wire_compression_level: int
    raft_min_timeout_ms: int
    raft_max_timeout_ms: int
    raft_leader_lost_ms: int
    connection_timeout_ms: int
    leader_fallback_timeout_ms: int
    leader_lease_ms: int
    log_compaction_min_entries: int
    log_compaction_min_time_s: int
    log_compaction_max_bytes: int
    # Security.
    auth_token: str
    auth_token_file: str
    access_key: str
    grpc_signature_window_s: int
    cluster_secret: str
    cluster_secret_file: str
    allow_insecure: bool
    metrics_public: bool
    tls_cert_file: str
    tls_key_file: str
    tls_ca_file: str
    # Logs.
    log_level: str
    log_format: str
    ops_log_dir: str
    ops_log_enabled: bool
    ops_log_retention_h: int
    ops_log_max_bytes: int
    ops_log_sample_rate: float
    # Schedule service (RocketMQ 4.x delay levels).
    message_delay_level: str
    enable_schedule_async_deliver: bool
    schedule_async_deliver_max_pending_limit: int
    schedule_async_deliver_max_resend_num_to_blocked: int
    max_reconsume_times: int
    # Renewal of auto_renew receives over gRPC.
    enable_proxy_auto_renew: bool
    default_invisible_time_ms: int
    renew_max_time_ms: int
    renew_max_tracked: int
    renew_max_per_second: int
    # Timer service (RocketMQ 5.x, RIP-43).
    timer_precision_ms: int
    timer_max_delay_s: int
    timer_roll_window_slots: int
    timer_congest_num_each_slot: int
    timer_log_segment_bytes: int
    timer_stop_enqueue: bool
    timer_stop_dequeue: bool

    def __init__(self, values: Mapping[str, Any], renamed_keys: Iterable[str] = ()) -> None:
        self._values = dict(values)
        self.renamed_keys = tuple(renamed_keys)
        for key in KEYS:
            setattr(self, key.name, self._values[key.name])
        self.peers = self._parse_peers(self._values["peers"])
        self._check_security()
        if self.raft_min_timeout_ms >= self.raft_max_timeout_ms:
            raise ConfigError("raft_max_timeout_ms", "must be greater than raft_min_timeout_ms")
        if self.raft_leader_lost_ms >= self.raft_min_timeout_ms:
            raise ConfigError(
                "raft_leader_lost_ms", "must be less than raft_min_timeout_ms (0 turns it off)"
            )
        if not self.grpc_port and self.http_port + 100 > 65535:
            raise ConfigError("grpc_port", "set it: http_port + 100 is not a port")
        if not self.fetch_port and self.raft_port + 1000 > 65535:
            raise ConfigError("fetch_port", "set it: raft_port + 1000 is not a port")
        self._check_ports()
        if self.raft_min_timeout_ms <= 3 * self.append_entries_period_ms:
            raise ConfigError(
                "raft_min_timeout_ms", "must be more than 3 x append_entries_period_ms"
            )

    def listeners(self) -> list[Listener]:
        """Each port this node listens on, with the setting that gives it."""
        return [
            Listener("http_port", self.http_host, self.http_port, ""),
            Listener(
                "grpc_port",
                self.grpc_bind_host,
                self.grpc_listen_port,
                "" if self.grpc_port else "http_port + 100",
            ),
            Listener("raft_port", self.raft_host, self.raft_port, ""),
            Listener(
                "fetch_port",
                self.raft_host,
                self.fetch_listen_port,
                "" if self.fetch_port else "raft_port + 1000",
            ),
        ]

    def _check_ports(self) -> None:
        """Two listeners on one port of one address would leave the node dead at start with a
        bind error: refuse it here, naming both settings."""
        found = self.listeners()
        for k, b in enumerate(found):
            for a in found[:k]:
                if a.port == b.port and hosts_overlap(a.host, b.host):
                    # A derived one first (it is the one to set), else in this order.
                    first, second = (b, a) if b.derived_from and not a.derived_from else (a, b)
                    raise ConfigError(
                        first.setting,
                        f"{first.describe()} is also {second.describe()}: each of http_port, "
                        f"grpc_port, raft_port and fetch_port needs a port of its own; set "
                        f"{first.setting}",
                    )

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
        return f"{self.raft_host}:{self.fetch_listen_port}"

    @property
    def fetch_listen_port(self) -> int:
        """The catch-up channel's port: ``fetch_port``, or ``raft_port + 1000`` when it is 0."""
        return int(self.fetch_port or self.raft_port + 1000)

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
            current = current_name(name)
            values[current] = parse_value(current, value)
        return NodeConfig(values, self.renamed_keys)

    def raft_config(self) -> RaftConfig:
        return RaftConfig(
            data_dir=self.data_dir,
            raft_address=self.raft_address,
            fetch_address=self.fetch_address,
            peers=tuple(RaftPeer(p.raft, p.fetch) for p in self.peers),
            flush=self.flush,
            commitlog_segment_bytes=self.commitlog_segment_bytes,
            max_message_bytes=self.max_message_bytes,
            batch_max_messages=self.batch_max_messages,
            batch_max_bytes=self.batch_max_bytes,
            max_inflight_commands=self.max_inflight_commands,
            max_pending_messages=self.max_pending_messages,
            max_pending_bytes=self.max_pending_bytes or default_max_pending_bytes(),
            commit_timeout_ms=self.commit_timeout_ms,
            idempotency_window_batches=self.idempotency_window_batches,
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
            raft_leader_lost_ms=self.raft_leader_lost_ms,
            connection_timeout_ms=self.connection_timeout_ms,
            leader_fallback_timeout_ms=self.leader_fallback_timeout_ms,
            leader_lease_ms=self.leader_lease_ms,
            log_compaction_min_entries=self.log_compaction_min_entries,
            log_compaction_min_time_s=self.log_compaction_min_time_s,
            log_compaction_max_bytes=self.log_compaction_max_bytes,
            cluster_secret=self.cluster_secret_bytes,
        )


def _declared_type(key: Key) -> str:
    return "tuple[Peer, ...]" if key.name == "peers" else key.type.__name__


def _check_attributes() -> None:
    """Every key is a declared attribute of :class:`NodeConfig`, in order, with its type."""
    declared = list(NodeConfig.__annotations__.items())
    expected = [(k.name, _declared_type(k)) for k in KEYS]
    if declared != expected:
        wrong = sorted(set(declared) ^ set(expected)) or "the order differs"
        raise AssertionError(f"NodeConfig's attributes do not match the key table: {wrong}")


_check_attributes()


def load(
    path: str | os.PathLike[str] | None = None,
    *,
    overrides: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
    warn: bool = True,
) -> NodeConfig:
    """Defaults, then the TOML file, then ``CHRONOMQ_*`` variables, then ``overrides``.

    An old name of a renamed key is read as the new one and warned about (:func:`warn_renamed`),
    unless ``warn`` is False: then the caller warns about ``renamed_keys`` later (a node, once
    its logging is set up)."""
    values: dict[str, Any] = {k.name: k.default for k in KEYS}
    renamed: list[str] = []
    if path is not None:
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except FileNotFoundError:
            raise ConfigError("config", f"file {path} does not exist") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError("config", f"{path} is not valid TOML: {exc}") from None
        values.update(_read(data.items(), _from_file, renamed, unknown=f"unknown key in {path}"))
    env = os.environ if environ is None else environ
    from_env = (
        (name, env[ENV_PREFIX + name.upper()])
        for name in (*KEY_BY_NAME, *RENAMED)
        if ENV_PREFIX + name.upper() in env
    )
    values.update(_read(from_env, _from_env, renamed))
    values.update(_read((overrides or {}).items(), _from_setting, renamed))
    for name in ("data_dir", "ops_log_dir"):
        if values[name]:
            values[name] = str(Path(values[name]).expanduser().absolute())
    for name in SECRET_FILE_KEYS:
        _read_secret_file(values, name)
    config = NodeConfig(values, dict.fromkeys(renamed))
    if warn:
        warn_renamed(config.renamed_keys)
    return config


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
