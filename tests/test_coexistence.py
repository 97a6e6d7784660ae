"""Installing chronomq shadows nothing: in one virtualenv with PyPI's ``schedule`` (a
well-known distribution whose name is also one of our folders) both ``import schedule;
schedule.every`` and chronomq's client and command line work, and the wheel's only top-level
name is ``chronomq``.

The wheel is built from this checkout and installed without its dependencies; they come from
the test's own interpreter (its site-packages is put on the new virtualenv's path, the way a
``.pth`` line does, which does not bring in that interpreter's editable install of chronomq).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OURS = ("cluster", "raftlog", "schedule", "timer", "ops")


def run(*cmd: str | Path, timeout: int = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, cwd="/"
    )


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # From a copy of the sources, as a release builds it: a build/ folder left in the
    # checkout by an earlier build would otherwise add its stale files.
    src = tmp_path_factory.mktemp("src") / "chronomq"
    shutil.copytree(
        ROOT,
        src,
        symlinks=True,
        ignore=shutil.ignore_patterns(
            ".git", ".venv*", "build", "dist", "*.egg-info", "var", "__pycache__", ".*_cache"
        ),
    )
    out = tmp_path_factory.mktemp("wheel")
    built = run(
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "--no-deps",
        "--no-build-isolation",
        "-q",
        "-w",
        out,
        src,
    )
    assert built.returncode == 0, built.stderr[-2000:]
    (found,) = out.glob("chronomq-*.whl")
    return found


def test_the_wheel_has_one_top_level_name(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"chronomq"}
    for pkg in OURS:
        assert f"chronomq/{pkg}/__init__.py" in names
    assert any(n.startswith("chronomq/cluster/httpapi/console/") for n in names)  # package data


def test_pypi_schedule_and_chronomq_live_in_one_virtualenv(wheel: Path, tmp_path: Path) -> None:
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    py = env_dir / "bin" / "python"
    got = run(py, "-m", "pip", "install", "-q", "schedule")
    if got.returncode != 0:
        pytest.skip(f"PyPI's schedule could not be installed here: {got.stderr[-300:]}")
    got = run(py, "-m", "pip", "install", "-q", "--no-deps", wheel)
    assert got.returncode == 0, got.stderr[-2000:]
    # chronomq's dependencies from this interpreter, after the new environment's own packages.
    site = Path(
        run(py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").stdout.strip()
    )
    (site / "zz_test_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")

    code = (
        "import schedule, chronomq, chronomq.aio, chronomq.cluster.node.broker;"
        "assert callable(schedule.every), schedule.__file__;"
        "assert 'chronomq' not in schedule.__file__;"
        "assert chronomq.Producer and chronomq.Consumer and chronomq.aio.Consumer;"
        "import importlib.util as u;"
        f"assert not any(u.find_spec(m) and 'chronomq' in (u.find_spec(m).origin or '') for m in {OURS!r});"
        "print(schedule.__file__)"
    )
    got = run(py, "-c", code)
    assert got.returncode == 0, got.stderr[-3000:]
    assert str(site / "schedule") in got.stdout
    for name in OURS:
        assert not (site / name / "__init__.py").exists() or name == "schedule"
    assert not (site / "schedule" / "levels.py").exists()  # ours is not there
    cli = env_dir / "bin" / "chronomq"
    got = run(cli, "--version")
    assert got.returncode == 0 and got.stdout.startswith("chronomq "), got.stderr[-2000:]
    got = run(cli, "bench", "--help")
    assert got.returncode == 0 and "grpc" in got.stdout, got.stderr[-2000:]
