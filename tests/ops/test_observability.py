"""The Prometheus rules, the Grafana dashboard and the compose profile in ``ops/observability``.

``promtool check rules`` and ``promtool test rules`` run here (Debian's ``prometheus`` package
ships ``promtool``; ``.ci/run`` installs it on CI); without promtool those tests skip saying
so. That every metric named here exists on a live node is
``tests/integration/test_metrics.py``'s."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
HERE = ROOT / "ops" / "observability"
ALERTS = HERE / "alerts.yml"
ALERTS_TEST = HERE / "alerts_test.yml"
DASHBOARD = HERE / "grafana-dashboard.json"
PROMETHEUS = HERE / "prometheus.yml"
COMPOSE = ROOT / "compose.yaml"

_METRIC = re.compile(r"\b((?:chronomq|process|python)_[a-z0-9_]+)\b")


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool not installed (Debian: apt-get install prometheus)")
    return path


def alert_rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(ALERTS.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return data


def dashboard_exprs() -> list[str]:
    return [t["expr"] for p in dashboard()["panels"] for t in p.get("targets", [])]


def metric_names(exprs: list[str]) -> set[str]:
    """The sample names (``_total``, ``_bucket``... included) the PromQL expressions read."""
    return {m for e in exprs for m in _METRIC.findall(e)}


def rule_metric_names() -> set[str]:
    return metric_names([str(rule["expr"]) for rule in alert_rules()])


def dashboard_metric_names() -> set[str]:
    return metric_names(dashboard_exprs())


def test_promtool_checks_the_rules() -> None:
    done = subprocess.run(
        [promtool(), "check", "rules", str(ALERTS)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_promtool_unit_tests_of_the_rules_pass() -> None:
    done = subprocess.run(
        [promtool(), "test", "rules", ALERTS_TEST.name],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=HERE,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def test_every_alert_has_a_unit_test_that_fires_it() -> None:
    tests = yaml.safe_load(ALERTS_TEST.read_text())["tests"]
    fired = {
        case["alertname"]
        for test in tests
        for case in test["alert_rule_test"]
        if case.get("exp_alerts")
    }
    names = [rule["alert"] for rule in alert_rules()]
    assert len(names) == len(set(names))
    assert set(names) <= fired, f"never seen firing: {sorted(set(names) - fired)}"


def test_every_alert_has_a_severity_and_says_what_is_wrong() -> None:
    for rule in alert_rules():
        assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]


def test_the_rules_watch_what_the_issue_names() -> None:
    names = rule_metric_names()
    for metric in (
        "chronomq_raft_role",
        "chronomq_raft_leader_changes_total",
        "chronomq_raft_replication_lag_entries",
        "chronomq_schedule_oldest_due_lag_seconds",
        "chronomq_timer_read_behind_seconds",
        "chronomq_raft_slow_ticks_total",
        "chronomq_disk_used_ratio",
        "process_resident_memory_bytes",
    ):
        assert metric in names


def test_prometheus_config_is_valid(tmp_path: Path) -> None:
    tool = promtool()
    # As the container sees it: the rules next to the config, a token file.
    config = PROMETHEUS.read_text()
    token = tmp_path / "chronomq.token"
    token.write_text("t")
    shutil.copy(ALERTS, tmp_path / "alerts.yml")
    config = config.replace("/etc/prometheus/alerts.yml", str(tmp_path / "alerts.yml"))
    config = config.replace("/prometheus/chronomq.token", str(token))
    (tmp_path / "prometheus.yml").write_text(config)
    done = subprocess.run(
        [tool, "check", "config", str(tmp_path / "prometheus.yml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_dashboard_panels_are_well_formed() -> None:
    board = dashboard()
    assert board["uid"] == "chronomq-overview"
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    variables = {v["name"] for v in board["templating"]["list"]}
    assert {"datasource", "job"} <= variables
    for panel in board["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            # Every series is filtered by the cluster chosen at the top.
            assert 'job=~"$job"' in target["expr"], (panel["title"], target["expr"])
    # Panels do not overlap.
    cells: set[tuple[int, int]] = set()
    for panel in board["panels"]:
        g = panel["gridPos"]
        mine = {
            (x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])
        }
        assert not cells & mine, panel["title"]
        cells |= mine


def test_the_dashboard_shows_what_the_alerts_watch() -> None:
    missing = rule_metric_names() - dashboard_metric_names()
    assert not missing, f"alerted on but not on the dashboard: {sorted(missing)}"


def test_compose_profile_starts_prometheus_and_grafana_provisioned_from_the_repo() -> None:
    compose = yaml.safe_load(COMPOSE.read_text())
    services = compose["services"]
    for name in ("prometheus", "grafana"):
        assert services[name]["profiles"] == ["observability"], name
        for volume in services[name]["volumes"]:
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (ROOT / source).exists(), source
    for name in ("node0", "node1", "node2"):
        assert "profiles" not in services[name]  # the cluster starts without the profile
    prometheus = yaml.safe_load(PROMETHEUS.read_text())
    job = prometheus["scrape_configs"][0]
    assert job["job_name"] == "chronomq"  # the job ChronomqNodeDown names
    assert job["static_configs"][0]["targets"] == ["node0:8080", "node1:8080", "node2:8080"]
    provisioning = HERE / "grafana" / "provisioning"
    datasource = yaml.safe_load((provisioning / "datasources" / "chronomq.yml").read_text())
    assert datasource["datasources"][0]["url"] == "http://prometheus:9090"
    provider = yaml.safe_load((provisioning / "dashboards" / "chronomq.yml").read_text())
    mounted = [v for v in services["grafana"]["volumes"] if "grafana-dashboard.json" in v]
    assert mounted[0].split(":")[1].startswith(provider["providers"][0]["options"]["path"] + "/")
