"""Security keys of the node config: secrets from 0600 files, never from a command line, and
no non-loopback listener without a cluster secret and a token."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from chronomq.cluster.config.nodeconfig import ConfigError, is_loopback_host, load
from chronomq.cluster.process.launcher import LocalCluster, parse_sets

SECRET = "0123456789abcdef0123"


def _private(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o600)
    return path


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.3.2.1", True),
        ("localhost", True),
        ("::1", True),
        ("[::1]", True),
        ("0.0.0.0", False),
        ("::", False),
        ("10.0.0.5", False),
        ("node0", False),
        ("", False),
    ],
)
def test_loopback_hosts(host: str, loopback: bool) -> None:
    assert is_loopback_host(host) is loopback


@pytest.mark.parametrize("key", ["http_host", "raft_host"])
def test_a_non_loopback_bind_needs_a_secret_and_a_token(key: str) -> None:
    env = {f"CHRONOMQ_{key.upper()}": "0.0.0.0"}
    with pytest.raises(ConfigError) as err:
        load(None, environ=env)
    assert err.value.key == "cluster_secret" and "allow_insecure" in err.value.problem
    with pytest.raises(ConfigError) as err:
        load(None, environ={**env, "CHRONOMQ_CLUSTER_SECRET": SECRET})
    assert err.value.key == "auth_token"
    cfg = load(None, environ={**env, "CHRONOMQ_CLUSTER_SECRET": SECRET, "CHRONOMQ_AUTH_TOKEN": "t"})
    assert cfg.cluster_secret_bytes == SECRET.encode()
    assert load(None, environ={**env, "CHRONOMQ_ALLOW_INSECURE": "true"}).allow_insecure


def test_a_short_secret_is_refused() -> None:
    with pytest.raises(ConfigError) as err:
        load(None, environ={"CHRONOMQ_CLUSTER_SECRET": "short"})
    assert err.value.key == "cluster_secret"


def test_secrets_come_from_private_files(tmp_path: Path) -> None:
    secret = _private(tmp_path / "secret", SECRET + "\n")
    token = _private(tmp_path / "token", "tok\n")
    cfg = load(
        None,
        environ={
            "CHRONOMQ_CLUSTER_SECRET_FILE": str(secret),
            "CHRONOMQ_AUTH_TOKEN_FILE": str(token),
        },
    )
    assert cfg.cluster_secret == SECRET and cfg.auth_token == "tok"
    assert cfg.raft_config().cluster_secret == SECRET.encode()
    masked = cfg.masked()
    assert masked["cluster_secret"] == "***" and masked["auth_token"] == "***"


@pytest.mark.parametrize(
    ("setup", "problem"),
    [
        (lambda p: (p.write_text(SECRET), p.chmod(0o644)), "chmod 600"),
        (lambda p: (p.write_text("  \n"), p.chmod(0o600)), "is empty"),
        (lambda p: None, "cannot read"),
    ],
)
def test_a_bad_secret_file_names_the_key(tmp_path: Path, setup: object, problem: str) -> None:
    path = tmp_path / "secret"
    setup(path)  # type: ignore[operator]
    with pytest.raises(ConfigError) as err:
        load(None, environ={"CHRONOMQ_CLUSTER_SECRET_FILE": str(path)})
    assert err.value.key == "cluster_secret_file" and problem in err.value.problem


def test_a_secret_and_its_file_together_are_refused(tmp_path: Path) -> None:
    path = _private(tmp_path / "token", "tok")
    with pytest.raises(ConfigError) as err:
        load(None, environ={"CHRONOMQ_AUTH_TOKEN": "x", "CHRONOMQ_AUTH_TOKEN_FILE": str(path)})
    assert err.value.key == "auth_token_file"


@pytest.mark.parametrize("key", ["auth_token", "cluster_secret"])
def test_the_command_line_takes_no_secret(key: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_sets([f"{key}=abcdefabcdefabcdefabcdef"])
    assert err.value.key == key and f"CHRONOMQ_{key.upper()}" in err.value.problem
    assert parse_sets(["flush=sync"]) == {"flush": "sync"}


def test_cluster_up_generates_a_private_secret_once_and_writes_private_configs(
    tmp_path: Path,
) -> None:
    cluster = LocalCluster(3, tmp_path / "var", http_port=18080, raft_port=19080)
    cluster.write_configs()
    secret_file = tmp_path / "var" / "cluster.secret"
    first = secret_file.read_text()
    assert len(first.strip()) >= 32
    for path in [secret_file, *(cluster.node_dir(i) / "node.toml" for i in range(3))]:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600, path
    for i in range(3):
        cfg = load(cluster.node_dir(i) / "node.toml", environ={})
        assert cfg.cluster_secret == first.strip()
    # Restarts keep it: the nodes' peers must agree.
    LocalCluster(3, tmp_path / "var", http_port=18080, raft_port=19080).write_configs()
    assert secret_file.read_text() == first
    # A loopback cluster gets no generated token; one given in the environment is used.
    assert cluster.auth_token is None
    given = LocalCluster(
        1, tmp_path / "b", http_port=18090, raft_port=19090, env={"CHRONOMQ_AUTH_TOKEN": "tok"}
    )
    assert given.auth_token == "tok"


def test_a_cluster_on_other_addresses_gets_a_generated_token(tmp_path: Path) -> None:
    cluster = LocalCluster(
        2, tmp_path / "var", http_port=18080, raft_port=19080, hosts=["10.9.0.1", "10.9.0.2"]
    )
    cluster.write_configs()
    token = cluster.auth_token
    assert token and len(token) >= 32
    assert stat.S_IMODE(os.stat(tmp_path / "var" / "auth.token").st_mode) == 0o600
    assert load(cluster.node_dir(1) / "node.toml", environ={}).auth_token == token
