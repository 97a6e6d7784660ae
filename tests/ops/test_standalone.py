"""The report on a real Spark standalone cluster (master + worker on 127.0.0.1) gives the same
summary.json as on local[*]. Both runs go through the command line in their own process."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.ops.conftest import ReportRun, cli_report

pytestmark = pytest.mark.spark

MASTER = "org.apache.spark.deploy.master.Master"
WORKER = "org.apache.spark.deploy.worker.Worker"
START_DEADLINE_S = 90.0
STOP_DEADLINE_S = 30.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spark_home() -> Path:
    pyspark = pytest.importorskip("pyspark")
    home = Path(pyspark.__file__).resolve().parent
    if not (home / "sbin" / "spark-daemon.sh").exists():
        pytest.skip(f"no sbin/spark-daemon.sh in {home}")
    return home


@dataclass
class Cluster:
    url: str
    ui: str
    env: dict[str, str]
    home: Path
    logs: Path

    def daemon(self, action: str, cls: str, *args: str) -> None:
        script = self.home / "sbin" / "spark-daemon.sh"
        subprocess.run(
            ["bash", str(script), action, cls, "1", *args],
            env=self.env,
            check=True,
            capture_output=True,
            timeout=60,
        )

    def status(self) -> dict[str, object]:
        with urllib.request.urlopen(f"{self.ui}/json/", timeout=5) as answer:
            result: dict[str, object] = json.loads(answer.read())
            return result

    def wait_for(self, what: str, check: object) -> None:
        assert callable(check)
        deadline = time.monotonic() + START_DEADLINE_S
        last_error: Exception | None = None
        while time.monotonic() < deadline:
            try:
                if check(self.status()):
                    return
            except OSError as exc:
                last_error = exc
            time.sleep(0.5)
        pytest.fail(f"{what} not up within {START_DEADLINE_S} s ({last_error}):\n{self.log_tail()}")

    def log_tail(self) -> str:
        parts = []
        for path in sorted(self.logs.glob("*.out")):
            lines = path.read_text(errors="replace").splitlines()[-30:]
            parts.append(f"--- {path.name}\n" + "\n".join(lines))
        return "\n".join(parts)

    def pids(self) -> list[int]:
        out = []
        for path in Path(self.env["SPARK_PID_DIR"]).glob("*.pid"):
            with contextlib.suppress(ValueError):
                out.append(int(path.read_text().strip()))
        return out


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    home = spark_home()
    base = tmp_path_factory.mktemp("spark-standalone")
    env = dict(os.environ)
    env.update(
        SPARK_HOME=str(home),
        SPARK_LOCAL_IP="127.0.0.1",
        SPARK_LOG_DIR=str(base / "logs"),
        SPARK_PID_DIR=str(base / "pids"),
        SPARK_WORKER_DIR=str(base / "work"),
        SPARK_IDENT_STRING=f"chronomq-test-{os.getpid()}",
        SPARK_MASTER_OPTS="-Dspark.master.rest.enabled=false",
    )
    port, ui_port = free_port(), free_port()
    c = Cluster(
        f"spark://127.0.0.1:{port}", f"http://127.0.0.1:{ui_port}", env, home, base / "logs"
    )
    pids: list[int] = []
    try:
        c.daemon(
            "start",
            MASTER,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--webui-port",
            str(ui_port),
        )
        c.wait_for("Spark master", lambda s: s.get("status") == "ALIVE")
        c.daemon(
            "start",
            WORKER,
            "--host",
            "127.0.0.1",
            "--port",
            str(free_port()),
            "--webui-port",
            str(free_port()),
            "--cores",
            "2",
            "--memory",
            "1g",
            c.url,
        )
        c.wait_for("Spark worker", lambda s: int(s.get("aliveworkers", 0)) >= 1)
        pids = c.pids()
        yield c
    finally:
        pids = pids or c.pids()
        for cls in (WORKER, MASTER):
            with contextlib.suppress(subprocess.SubprocessError, OSError):
                c.daemon("stop", cls)
        deadline = time.monotonic() + STOP_DEADLINE_S
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        for pid in pids:
            if alive(pid):
                os.kill(pid, 9)
        assert not any(alive(p) for p in pids), "Spark daemons still running"


def test_standalone_cluster_gives_the_same_summary_as_local(
    cluster: Cluster,
    small_logs: tuple[Path, object],
    local_report: ReportRun,
    tmp_path: Path,
) -> None:
    local = local_report.process
    assert "delivery lateness" in local.stdout and "failover term 1->2 (n0->n1)" in local.stdout
    assert "[00:" in local.stderr and "latency: " in local.stderr  # progress phases
    conf = ["--conf", "spark.executor.memory=512m", "--conf", "spark.cores.max=2"]
    conf += ["--conf", "spark.sql.shuffle.partitions=8"]  # other partitions, same figures
    remote = cli_report(small_logs[0], tmp_path / "remote", cluster.url, *conf)
    assert remote.returncode == 0, remote.stderr + "\n" + cluster.log_tail()
    for run in (local, remote):
        assert "\tat " not in run.stderr and "Traceback" not in run.stderr, run.stderr
    same = (local_report.out / "summary.json").read_bytes()
    assert (tmp_path / "remote" / "summary.json").read_bytes() == same
    assert json.loads(same)["inputs"]["latency"]["lines"] > 0
    run = json.loads((tmp_path / "remote" / "run.json").read_text())
    assert run["master"] == cluster.url
    apps = cluster.status()["completedapps"]
    assert isinstance(apps, list) and any(a["name"] == "chronomq-report" for a in apps)
    assert (tmp_path / "remote" / "parquet" / "lateness").is_dir()
