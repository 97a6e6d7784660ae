"""Start, kill and restart local node processes: ``chronomq cluster up``, tests, benches, drills.

Node ``i`` (0-based) serves HTTP on ``127.0.0.1:http_port+i``, the RocketMQ 5 gRPC endpoint on
``grpc_port+i`` (default ``http_port+100+i``), Raft on ``raft_port+i`` and its catch-up channel
on ``fetch_port+i`` (default ``raft_port+1000+i``); a derived default that would clash with
another port moves on (:mod:`chronomq.cluster.process.ports`). Its files live in
``data_dir/node-i``, its config in ``node-i/node.toml`` and its log in ``node-i/node.log``.
"""

from __future__ import annotations

import contextlib
import functools
import http.client
import json
import os
import secrets
import signal
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from chronomq.cluster.config.keys import ENV_PREFIX, KEY_BY_NAME, RENAMED
from chronomq.cluster.config.nodeconfig import (
    ConfigError,
    current_name,
    is_loopback_host,
    load,
    parse_setting,
    to_toml,
)
from chronomq.cluster.process.ports import plan_ports

HOST = "127.0.0.1"


SECRET_FILE = "cluster.secret"
#: How long :meth:`LocalCluster.stop` waits after SIGTERM before SIGKILL: above a node's own
#: stop deadline (:data:`chronomq.cluster.process.stopping.STOP_DEADLINE_S`), so a node normally exits itself.
STOP_TIMEOUT_S = 12.0
TOKEN_FILE = "auth.token"


def http_get_json(
    url: str,
    timeout_s: float = 1.0,
    token: str | None = None,
    context: ssl.SSLContext | None = None,
) -> Any:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    req = urllib.request.Request(url, headers=headers)
    with urllib.request.urlopen(req, timeout=timeout_s, context=context) as r:  # noqa: S310 - URLs we built
        return json.loads(r.read())


def _signal_group(p: subprocess.Popen[bytes], sig: int) -> None:
    """Send ``sig`` to the process group node ``p`` leads (it starts a session of its own)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(p.pid, sig)


def wait_stopped(pid: int, timeout_s: float = 5.0) -> bool:
    """Wait until every thread of process ``pid`` is stopped (SIGSTOP); False when the time
    ran out or the process is gone, True at once where there is no ``/proc`` to tell.

    ``kill(SIGSTOP)`` returns before the process has stopped: the kernel wakes one thread to
    stop the group, and until that thread runs the others go on. A node's Raft thread
    answered an append after the kill returned, committing a write a test sent "to a leader
    whose followers are paused" (a probe outside the suite: 26 of 50 such kills answered)."""
    if not Path("/proc/self/task").is_dir():
        return True
    tasks = Path(f"/proc/{pid}/task")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            states = [_thread_state(t) for t in tasks.iterdir()]
        except FileNotFoundError:  # gone
            return False
        if states and all(s in ("T", "t") for s in states if s):
            return True
        time.sleep(0.002)
    return False


def _thread_state(task: Path) -> str:
    """The state letter of one thread (``""`` when it ended meanwhile)."""
    try:
        stat = (task / "stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return ""
    return stat[stat.rindex(")") + 2 :][:1]


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` readable by its owner only (0600), also if it existed."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def generated_secret(path: Path) -> Path:
    """``path``, holding a random secret (made once, 0600, and kept across restarts)."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        write_private(path, secrets.token_urlsafe(32) + "\n")
    return path


LOG_TAIL_BYTES = 64 * 1024
"""How much of a node's log :func:`last_error` reads from its end."""


def describe_exit(returncode: int | None) -> str:
    """``exited with N``, or ``was killed by SIGNAME``, saying what usually sends SIGKILL."""
    if returncode is None:
        return "is running"
    if returncode >= 0:
        return f"exited with {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = f"signal {-returncode}"
    if -returncode == signal.SIGKILL:
        return f"was killed by {name} (the kernel's out-of-memory killer sends it, as does kill -9)"
    return f"was killed by {name}"


def last_error(log: Path) -> str | None:
    """The message of the last ERROR (or CRITICAL) line of a node's log, JSON or text."""
    try:
        with open(log, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - LOG_TAIL_BYTES))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        if line.startswith("{"):
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and record.get("level") in ("error", "critical"):
                return str(record.get("msg"))
        elif " ERROR " in line or " CRITICAL " in line:
            return line.strip()
    return None


class LocalCluster:
    def __init__(
        self,
        nodes: int,
        data_dir: str | os.PathLike[str],
        *,
        http_port: int,
        raft_port: int,
        settings: Mapping[str, Any] | None = None,
        node_settings: Mapping[int, Mapping[str, Any]] | None = None,
        env: Mapping[str, str] | None = None,
        initial: int | None = None,
        hosts: Sequence[str] | None = None,
        prefix: Callable[[int], list[str]] | None = None,
        node_env: Mapping[int, Mapping[str, str]] | None = None,
        grpc_port: int | None = None,
        fetch_port: int | None = None,
    ) -> None:
        """``initial``: how many nodes form the cluster; later ones are configured to join it.

        ``hosts`` gives each node its own address (default 127.0.0.1 for all), ``prefix`` a
        command to start node ``i`` under (e.g. ``ip netns exec``), ``node_env`` extra
        environment per node (e.g. libfaketime). ``grpc_port``: node ``i`` serves gRPC on
        ``grpc_port + i``, ``fetch_port``: its catch-up channel on ``fetch_port + i`` (default:
        derived so that no two ports clash, see :mod:`chronomq.cluster.process.ports`).
        :class:`ConfigError` naming both settings when given ports clash.
        """
        if nodes < 1:
            raise ValueError("a cluster needs at least one node")
        self.n = nodes
        self.data_dir = Path(data_dir).absolute()
        self.ports = plan_ports(nodes, http_port, raft_port, grpc_port, fetch_port)
        self.http_port = http_port
        self.raft_port = raft_port
        self.grpc_port = self.ports.grpc.base
        self.fetch_port = self.ports.fetch.base
        self.settings = dict(settings or {})
        self.node_settings = {i: dict(s) for i, s in (node_settings or {}).items()}
        self.env = dict(env or {})
        self.initial = nodes if initial is None else initial
        self.hosts = list(hosts) if hosts is not None else [HOST] * nodes
        self.prefix = prefix
        self.node_env = {i: dict(e) for i, e in (node_env or {}).items()}
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self._logs: dict[int, Any] = {}
        self._security = self._security_settings()
        self._procs_lock = threading.Lock()
        self._final = False
        """Set by ``stop(final=True)``: no node starts again."""

    # ------------------------------------------------------------------ secrets

    def _given(self, key: str) -> str | None:
        """A key's value from the settings or the nodes' environment, if given there."""
        value = self.settings.get(key)
        if value:
            return str(value)
        env_name = ENV_PREFIX + key.upper()
        return self.env.get(env_name) or os.environ.get(env_name) or None

    def _security_settings(self) -> dict[str, str]:
        """What every node.toml gets so that peers authenticate: a cluster secret generated
        per data directory when none is given, and an auth token generated when a node
        listens on a non-loopback address and none is given."""
        out: dict[str, str] = {}
        if not (self._given("cluster_secret") or self._given("cluster_secret_file")):
            out["cluster_secret_file"] = str(self.data_dir / SECRET_FILE)
        exposed = any(not is_loopback_host(h) for h in self.hosts)
        if exposed and not (self._given("auth_token") or self._given("auth_token_file")):
            out["auth_token_file"] = str(self.data_dir / TOKEN_FILE)
        return out

    @property
    def auth_token(self) -> str | None:
        """The bearer token the nodes require, if any (read from wherever it was given)."""
        token = self._given("auth_token")
        if token:
            return token
        path = self._given("auth_token_file") or self._security.get("auth_token_file")
        if path and os.path.exists(path):
            return Path(path).read_text().strip() or None
        return None

    @property
    def ca_file(self) -> str | None:
        """What a client of these nodes checks their HTTPS against (None: plain HTTP)."""
        return self._given("tls_ca_file") or self._given("tls_cert_file")

    @functools.cached_property
    def _ssl_context(self) -> ssl.SSLContext | None:
        from chronomq.cluster.node.tls import client_context

        return client_context(self.ca_file) if self.ca_file else None

    # ------------------------------------------------------------------ layout

    def http_url(self, i: int) -> str:
        scheme = "https" if self._given("tls_cert_file") else "http"
        return f"{scheme}://{self.hosts[i]}:{self.http_port + i}"

    def grpc_address(self, i: int) -> str:
        """Node ``i``'s RocketMQ 5 gRPC endpoint, ``host:port``."""
        return f"{self.hosts[i]}:{self.grpc_port + i}"

    @property
    def grpc_endpoints(self) -> str:
        """Every node's gRPC endpoint, as the official clients take them (``a;b;c``)."""
        return ";".join(self.grpc_address(i) for i in range(self.n))

    @property
    def urls(self) -> list[str]:
        return [self.http_url(i) for i in range(self.n)]

    def node_dir(self, i: int) -> Path:
        return self.data_dir / f"node-{i}"

    def config_values(self, i: int) -> dict[str, Any]:
        peers = [
            {
                "id": j,
                "raft": f"{self.hosts[j]}:{self.raft_port + j}",
                "http": self.http_url(j),
                "fetch": f"{self.hosts[j]}:{self.fetch_port + j}",
            }
            for j in range(self.n if i >= self.initial else self.initial)
            if j != i
        ]
        values: dict[str, Any] = {
            "node_id": i,
            "data_dir": str(self.node_dir(i) / "data"),
            "http_host": self.hosts[i],
            "http_port": self.http_port + i,
            "raft_host": self.hosts[i],
            "raft_port": self.raft_port + i,
            "fetch_port": self.fetch_port + i,
            "grpc_port": self.grpc_port + i,
        }
        for settings in (self.settings, self.node_settings.get(i, {})):
            for name, value in settings.items():  # node.toml gets a renamed key's new name
                current = current_name(name)
                values[current] = parse_setting(current, value)
        values.update(self._security)
        values["peers"] = peers
        return values

    def write_configs(self) -> None:
        for generated in self._security.values():
            generated_secret(Path(generated))
        for i in range(self.n):
            d = self.node_dir(i)
            d.mkdir(parents=True, exist_ok=True)
            path = d / "node.toml"
            # 0600: the file may hold a secret given in the settings.
            write_private(path, to_toml(self.config_values(i)))
            # Fail here, naming the key, rather than in a child (with the environment the
            # nodes get, which may hold a secret).
            load(path, environ={**os.environ, **self.env, **self.node_env.get(i, {})})

    # ------------------------------------------------------------------ processes

    def start(self, i: int | None = None) -> None:
        if i is None:
            self.write_configs()
            for j in range(self.initial):
                self.start(j)
            return
        with self._procs_lock:
            self._start_node(i)

    def _start_node(self, i: int) -> None:
        if self._final:
            raise RuntimeError(f"node {i} not started: the cluster was stopped for good")
        if i in self.procs and self.procs[i].poll() is None:
            raise RuntimeError(f"node {i} is already running")
        d = self.node_dir(i)
        log = open(d / "node.log", "ab")  # noqa: SIM115 - closed in _reap
        self._logs[i] = log
        env = {**os.environ, **self.env, **self.node_env.get(i, {}), "PYTHONUNBUFFERED": "1"}
        wrapper = self.prefix(i) if self.prefix is not None else []
        self.procs[i] = subprocess.Popen(
            [
                *wrapper,
                sys.executable,
                "-m",
                "chronomq.cluster",
                "node",
                "--config",
                str(d / "node.toml"),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )

    def kill(self, i: int, sig: int = signal.SIGKILL, timeout_s: float = 15.0) -> None:
        """Send ``sig`` to node ``i``; for SIGKILL and SIGTERM wait for it to exit (SIGKILL
        after ``timeout_s``) and reap it and whatever it started; for SIGSTOP wait until it
        has stopped (every thread), so nothing it does after this returns."""
        p = self.procs.get(i)
        if p is None or p.poll() is not None:
            return
        if sig == signal.SIGKILL:
            _signal_group(p, signal.SIGKILL)
        else:
            p.send_signal(sig)
        if sig == signal.SIGSTOP and not wait_stopped(p.pid, timeout_s) and p.poll() is None:
            raise TimeoutError(f"node {i} (pid {p.pid}) did not stop within {timeout_s} s")
        if sig in (signal.SIGKILL, signal.SIGTERM):
            try:
                p.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                _signal_group(p, signal.SIGKILL)
                p.wait(timeout=10)
            self._reap(i)

    def restart(self, i: int) -> None:
        self.kill(i)
        self.start(i)

    def alive(self, i: int) -> bool:
        p = self.procs.get(i)
        return p is not None and p.poll() is None

    def _reap(self, i: int) -> None:
        p = self.procs.get(i)
        if p is not None:
            # Anything the node left in its process group (a wrapper's children) goes too.
            _signal_group(p, signal.SIGKILL)
        log = self._logs.pop(i, None)
        if log is not None:
            log.close()

    def kill_now(self) -> None:
        """SIGKILL every node's process group and return at once (nothing is waited for or
        reaped; for a process that is about to exit). No node starts again."""
        self._final = True
        for p in list(self.procs.values()):
            if p.poll() is None:
                _signal_group(p, signal.SIGKILL)

    def stop(self, timeout_s: float = STOP_TIMEOUT_S, *, final: bool = False) -> None:
        """Stop every node: SIGCONT and SIGTERM to each one's process group, SIGKILL to those
        still there after ``timeout_s``, and reap them all; no process is left behind.
        ``final``: no node starts again, also not from another thread that was about to
        start one (a drill stopped in the middle of a fault)."""
        with self._procs_lock:
            self._final = self._final or final
        for p in list(self.procs.values()):
            if p.poll() is None:
                _signal_group(p, signal.SIGCONT)  # a paused node must be able to stop
                _signal_group(p, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for i, p in list(self.procs.items()):
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                print(
                    f"node {i} (pid {p.pid}) still running {timeout_s:.0f} s after SIGTERM: "
                    "killing it",
                    file=sys.stderr,
                    flush=True,
                )
                _signal_group(p, signal.SIGKILL)
                p.wait(timeout=10)
            self._reap(i)

    def exit_report(self, i: int) -> str:
        """How node ``i``'s process ended (its status, or the signal that killed it, by name)
        and the last error it logged, for a node that ended by itself."""
        p = self.procs[i]
        log = self.node_dir(i) / "node.log"
        said = last_error(log)
        return (
            f"node {i} {describe_exit(p.returncode)}"
            + (f": {said}" if said else "")
            + f"; see {log}"
        )

    # ------------------------------------------------------------------ state

    def node_status(self, i: int, timeout_s: float = 1.0) -> dict[str, Any] | None:
        try:
            data: dict[str, Any] = http_get_json(
                f"{self.http_url(i)}/v1/admin/node", timeout_s, self.auth_token, self._ssl_context
            )
            return data
        except (OSError, urllib.error.URLError, ValueError, http.client.HTTPException):
            # No node answering there (yet), or something else holds its port: a server of
            # another protocol answers what HTTP cannot parse (BadStatusLine).
            return None

    def leader(self, among: list[int] | None = None) -> int | None:
        """The node that is confirmed leader, if exactly one claims it."""
        leaders = []
        for i in among if among is not None else [j for j in range(self.n) if j in self.procs]:
            if not self.alive(i):
                continue
            st = self.node_status(i)
            if st and st.get("role") == "leader":
                leaders.append(i)
        return leaders[0] if len(leaders) == 1 else None

    def wait_leader(self, timeout_s: float = 30.0, among: list[int] | None = None) -> int:
        """The confirmed leader (one of ``among`` when given), once the other nodes (of
        ``among``: a node paused or cut off cannot hear of it) know it too, or the deadline
        passed; TimeoutError when no leader came."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for i in range(self.n):
                p = self.procs.get(i)
                if p is not None and p.poll() is not None and p.returncode not in (0, -9, -15):
                    raise RuntimeError(self.exit_report(i))
            leader = self.leader(among)
            if leader is not None:
                # Callers assume the others know it too (forwarding, /readyz, the cluster
                # view); give them until the deadline to hear from it.
                with contextlib.suppress(TimeoutError):
                    self.wait_all_know_leader(max(0.1, deadline - time.monotonic()), among)
                return leader
            time.sleep(0.05)
        raise TimeoutError(f"no leader within {timeout_s} s")

    def wait_all_know_leader(self, timeout_s: float = 30.0, among: list[int] | None = None) -> None:
        """Wait until every running node (of ``among``, when given) reports the same leader in
        the same term, and that leader has confirmed its leadership (so every /readyz is 200
        and a write goes through)."""
        deadline = time.monotonic() + timeout_s
        nodes = among if among is not None else range(self.n)
        while time.monotonic() < deadline:
            running = [i for i in nodes if self.alive(i)]
            views = {i: self.node_status(i) or {} for i in running}
            seen = {(v.get("leader"), v.get("term")) for v in views.values()}
            if len(seen) == 1:
                ((leader, _term),) = seen
                if leader is not None and views.get(leader, {}).get("role") == "leader":
                    return
            time.sleep(0.05)
        raise TimeoutError(f"not every node knew the leader within {timeout_s} s")

    def digests(self, nodes: list[int] | None = None) -> dict[int, dict[str, Any] | None]:
        out: dict[int, dict[str, Any] | None] = {}
        for i in nodes if nodes is not None else range(self.n):
            st = self.node_status(i)
            out[i] = st["digest"] if st else None
        return out

    def wait_converged(
        self, timeout_s: float = 60.0, nodes: list[int] | None = None
    ) -> dict[str, Any]:
        """Wait until the given nodes report the same CommitLog digest; return it."""
        deadline = time.monotonic() + timeout_s
        last: dict[int, Any] = {}
        while time.monotonic() < deadline:
            last = self.digests(nodes)
            values = list(last.values())
            if values and all(v is not None for v in values):
                keyed = {(v["length"], v["chain"]) for v in values if v}
                if len(keyed) == 1:
                    return values[0]  # type: ignore[return-value]
            time.sleep(0.1)
        raise TimeoutError(f"digests did not converge within {timeout_s} s: {last}")

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def parse_sets(pairs: list[str] | None) -> dict[str, str]:
    """``key=value`` pairs from a command line. A secret is refused: `ps` would show it."""
    out: dict[str, str] = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ConfigError(pair, "--set takes key=value")
        key = key.strip()
        spec = KEY_BY_NAME.get(RENAMED.get(key, key))
        if spec is not None and spec.secret:
            raise ConfigError(
                key,
                "a secret is not taken on the command line, where `ps` shows it: set "
                f"{ENV_PREFIX}{key.upper()} in the environment or {key}_file in a config file",
            )
        out[key] = value
    return out
