"""Under ``CI=true`` a skipped test fails the run unless ``CI_MAY_SKIP`` (tests/conftest.py)
names it: a real pytest run of a few throwaway tests with the suite's hooks loaded."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import CI_MAY_SKIP

REPO = Path(__file__).resolve().parent.parent

TOOLS = """
import pytest

def test_passes():
    pass

def test_skips_at_run_time():
    pytest.skip("needs a tool that is not installed")

@pytest.mark.skipif(True, reason="needs nftables")
def test_skipped_by_a_mark():
    pass

@pytest.mark.xfail(reason="a known bug", strict=True)
def test_expected_to_fail():
    assert False
"""

ALLOWED = """
import pytest

def test_needs_the_package_index():
    pytest.skip("no package index here")
"""


def run_suite(tmp_path: Path, ci: str | None) -> tuple[int, str]:
    (tmp_path / "tests").mkdir(exist_ok=True)
    (tmp_path / "test_tools.py").write_text(TOOLS)
    (tmp_path / "test_whole_module.py").write_text(
        "import pytest\npytest.importorskip('no_such_module_anywhere')\n"
        "def test_never_collected():\n    pass\n"
    )
    (tmp_path / "tests" / "test_coexistence.py").write_text(ALLOWED)
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    if ci is not None:
        env["CI"] = ci
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "tests.conftest",
            "-p",
            "no:cacheprovider",
            "-c",
            os.devnull,
            "--rootdir",
            str(tmp_path),
            "-q",
            "-rA",
            "--continue-on-collection-errors",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    return done.returncode, done.stdout + done.stderr


def test_skips_fail_under_ci_unless_allowed(tmp_path: Path) -> None:
    assert "tests/test_coexistence.py::" in CI_MAY_SKIP
    code, out = run_suite(tmp_path, "true")
    assert code == 1, out  # failed (2 would be a run stopped by the collection error)
    assert "FAILED test_tools.py::test_skips_at_run_time - skipped under CI=true" in out, out
    assert "ERROR test_tools.py::test_skipped_by_a_mark - skipped under CI=true" in out, out
    assert "ERROR test_whole_module.py - skipped under CI=true" in out, out
    assert "needs a tool that is not installed" in out and "needs nftables" in out, out
    assert "CI_MAY_SKIP" in out, out
    # What the list allows still skips; an expected failure is not a skip; passing passes.
    assert "SKIPPED [1] tests/test_coexistence.py" in out, out
    assert "XFAIL test_tools.py::test_expected_to_fail" in out, out
    assert "PASSED test_tools.py::test_passes" in out, out


def test_skips_are_skips_off_ci(tmp_path: Path) -> None:
    for ci in (None, "false"):
        code, out = run_suite(tmp_path, ci)
        assert code == 0, out
        assert "CI_MAY_SKIP" not in out, out
        assert "failed" not in out.splitlines()[-1], out
