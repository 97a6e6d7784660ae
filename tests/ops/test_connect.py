"""The report through Spark Connect (``--master sc://``) gives the same summary.json as local.

Needs the ``pyspark[connect]`` extras (pandas, pyarrow, grpcio, ...) in this interpreter; the
test is skipped without them. The server is the pip-installed pyspark's own
``sbin/start-connect-server.sh`` on 127.0.0.1, stopped at the end whatever happens.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.ops.conftest import ReportRun, cli_report

START_DEADLINE_S = 120.0
STOP_DEADLINE_S = 30.0
CONNECT_EXTRAS = ("pandas", "pyarrow", "grpc", "google.protobuf", "zstandard")


def _missing_extras() -> list[str]:
    missing = []
    for name in CONNECT_EXTRAS:
        try:
            found = importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            missing.append(name)
    return missing


# Alone, after the suite's parallel part: a Spark Connect server and a report through it want
# both cores, and beside the other test process (Spark standalone, node clusters) and any other
# load it took 300 s and more (the item's time limit), 115 s without.
pytestmark = [
    pytest.mark.spark,
    pytest.mark.alone,
    pytest.mark.skipif(
        bool(_missing_extras()),
        reason=f"Spark Connect extras not installed ({', '.join(_missing_extras())}); "
        "pip install 'pyspark[connect]' to run it",
    ),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


@pytest.fixture(scope="module")
def connect_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    pyspark = pytest.importorskip("pyspark")
    home = Path(pyspark.__file__).resolve().parent
    base = tmp_path_factory.mktemp("spark-connect")
    env = dict(
        os.environ,
        SPARK_HOME=str(home),
        SPARK_LOCAL_IP="127.0.0.1",
        SPARK_LOG_DIR=str(base / "logs"),
        SPARK_PID_DIR=str(base / "pids"),
        SPARK_IDENT_STRING=f"chronomq-test-{os.getpid()}",
    )
    port = free_port()
    start = [
        "bash",
        str(home / "sbin" / "start-connect-server.sh"),
        "--master",
        "local[2]",
        "--conf",
        f"spark.connect.grpc.binding.port={port}",
        "--conf",
        "spark.connect.grpc.binding.address=127.0.0.1",
        "--conf",
        "spark.ui.enabled=false",
    ]
    pids: list[int] = []
    try:
        subprocess.run(start, env=env, check=True, capture_output=True, timeout=60)
        deadline = time.monotonic() + START_DEADLINE_S
        while not listening(port):
            if time.monotonic() > deadline:
                logs = "\n".join(p.read_text()[-3000:] for p in (base / "logs").glob("*.out"))
                pytest.fail(
                    f"Spark Connect server not listening within {START_DEADLINE_S} s\n{logs}"
                )
            time.sleep(0.5)
        pids = [int(p.read_text()) for p in (base / "pids").glob("*.pid")]
        yield f"sc://127.0.0.1:{port}"
    finally:
        pids = pids or [int(p.read_text()) for p in (base / "pids").glob("*.pid")]
        stop = ["bash", str(home / "sbin" / "stop-connect-server.sh")]
        subprocess.run(stop, env=env, check=False, capture_output=True, timeout=60)
        deadline = time.monotonic() + STOP_DEADLINE_S
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        for pid in pids:
            if _alive(pid):
                os.kill(pid, 9)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_spark_connect_gives_the_same_summary_as_local(
    connect_url: str, small_logs: tuple[Path, object], local_report: ReportRun, tmp_path: Path
) -> None:
    run = cli_report(small_logs[0], tmp_path / "connect", connect_url)
    assert run.returncode == 0, run.stderr
    assert "\tat " not in run.stderr and "Traceback" not in run.stderr, run.stderr
    same = (local_report.out / "summary.json").read_bytes()
    assert (tmp_path / "connect" / "summary.json").read_bytes() == same
    assert json.loads((tmp_path / "connect" / "run.json").read_text())["master"] == connect_url
