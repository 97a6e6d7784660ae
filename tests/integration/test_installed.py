"""A node as a normal install runs it: the wheel built from this tree, installed (not editable)
in a virtual environment of its own, started in a directory that is not the repository and
in which someone planted packages named like ours (``cluster/``, ``ops/``...). The console
loads, in the browser and file by file over HTTP, and none of the planted code runs.

``python -m`` puts the current directory first on ``sys.path``, so a module of ours that
resolved a top-level name (``importlib.resources.files("cluster")``) would import the planted
package there, and answer 500 where there is none."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from chronomq.cluster.process.launcher import LocalCluster
from tests.conftest import register_cluster
from tests.integration.conftest import start_on_free_ports
from tests.integration.test_console_browser import Page, browser  # noqa: F401 - a fixture

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("raftlog", "schedule", "timer", "pop", "cluster", "ops", "chronomq")
PLANTED = ("cluster", "ops", "raftlog", "pop", "schedule", "timer")
BUILD_TIMEOUT_S = 180


def _copy_sources(dest: Path) -> None:
    """The files a wheel is built from (building in the tree would leave build/ there)."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in SOURCES:
        shutil.copytree(ROOT / name, dest / name, symlinks=True, ignore=ignore)
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(ROOT / name, dest / name)


def _run(*args: str, cwd: Path | None = None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        args, check=True, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, cwd=cwd, env=env
    )
    return done.stdout.strip()


@pytest.fixture(scope="module")
def installed_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The interpreter of a fresh virtual environment holding the wheel, not editable. Its
    dependencies come from the test environment's site-packages, named in a ``.pth`` file as
    a plain path: the editable install's finder there is not loaded (its own ``.pth`` is not
    processed), so ``chronomq`` comes from the wheel alone."""
    base = tmp_path_factory.mktemp("installed")
    src = base / "src"
    _copy_sources(src)
    wheels = base / "dist"
    _run(
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "--no-deps",
        "--no-build-isolation",
        "-q",
        "-w",
        str(wheels),
        str(src),
    )
    (wheel,) = wheels.glob("chronomq-*.whl")
    venv = base / "venv"
    _run(sys.executable, "-m", "venv", "--without-pip", str(venv))
    python = venv / "bin" / "python"
    _run(
        sys.executable,
        "-m",
        "pip",
        "--python",
        str(python),
        "install",
        "-q",
        "--no-deps",
        "--no-index",
        str(wheel),
    )
    site = _run(str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    (Path(site) / "test-dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    where = _run(str(python), "-c", "import chronomq; print(chronomq.__file__)", cwd=base)
    assert where.startswith(site), f"chronomq came from {where}, not the wheel"
    return python


def _plant(cwd: Path, marks: Path) -> None:
    """Packages named like ours whose import leaves a mark and fails."""
    for name in PLANTED:
        (cwd / name).mkdir(parents=True)
        (cwd / name / "__init__.py").write_text(
            f"open({str(marks / name)!r}, 'w').write('planted code ran')\n"
            f"raise ImportError('planted {name}')\n"
        )
        (cwd / name / "httpapi" / "console").mkdir(parents=True)
        (cwd / name / "httpapi" / "__init__.py").write_text("")
        (cwd / name / "httpapi" / "console" / "index.html").write_text("planted page")


@pytest.fixture
def installed_node(
    installed_python: Path, tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[LocalCluster]:
    """One node of the installed package, run with ``python -m chronomq.cluster`` in a
    directory holding planted packages; the repository is on no path it gets."""
    cwd = tmp_path / "elsewhere"
    marks = tmp_path / "marks"
    marks.mkdir()
    _plant(cwd, marks)
    # The launcher starts PREFIX + [sys.executable, "-m", ...]: drop its interpreter for the
    # installed one, in the planted directory.
    wrapper = ["/bin/sh", "-c", f'cd "{cwd}" && shift && exec "{installed_python}" "$@"', "sh"]
    started: list[LocalCluster] = []

    def build(http: int, raft: int, attempt: int) -> LocalCluster:
        c = LocalCluster(
            1,
            tmp_path / f"data-{attempt}",
            http_port=http,
            raft_port=raft,
            prefix=lambda i: wrapper,
            env={"PYTHONPATH": ""},
        )
        started.append(c)
        register_cluster(request.node, c)
        return c

    cluster = start_on_free_ports(build, 1)
    try:
        cluster.wait_leader(60)
        yield cluster
    finally:
        for c in started:
            c.stop()
    assert sorted(p.name for p in marks.iterdir()) == [], "planted code ran inside the node"


def _get(url: str) -> tuple[int, str, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:  # noqa: S310 - our node
            return r.status, r.headers.get_content_type(), r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers.get_content_type(), exc.read()


def test_an_installed_node_serves_its_console_and_runs_no_planted_code(
    installed_node: LocalCluster,
) -> None:
    url = installed_node.http_url(0)
    status, ctype, page = _get(f"{url}/console")
    assert (status, ctype) == (200, "text/html"), page[:300]
    assert b"chronomq console" in page and b"planted" not in page
    assets = re.findall(r'(?:src|href)="(/console/[^"]+)"', page.decode())
    assert "/console/app.js" in assets
    app = _get(f"{url}/console/app.js")[2].decode()
    assets += [f"/console/{m}" for m in re.findall(r'import\("\./([a-z0-9-]+\.js)"\)', app)]
    assert len(assets) >= 4, assets
    for asset in assets:
        status, ctype, body = _get(url + asset)
        assert status == 200 and body, (asset, status, body[:200])
    # And the rest of the node answers (its routes import what they need by the real name).
    assert _get(f"{url}/openapi.json")[0] == 200
    assert _get(f"{url}/v1/admin/cluster")[0] == 200


def test_an_installed_node_console_loads_in_the_browser(
    installed_node: LocalCluster,
    browser: Any,  # noqa: F811 - the fixture imported above
) -> None:
    tab = Page(browser, installed_node.http_url(0))
    for view in ("cluster", "topics", "timers"):
        tab.view(view)
    assert not tab.errors, tab.errors
    tab.context.close()
