"""The packages import one way: ``cluster -> schedule, timer -> raftlog``, with ``ops`` and the
command line (``chronomq.cli``) above them all, every one under the ``chronomq`` name (nothing
installs a top-level ``cluster``, ``schedule``, ``timer``, ``ops`` or ``raftlog``). Checked on
the source, import by import."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
TOP = ("raftlog", "schedule", "timer", "cluster", "ops", "chronomq")

# What each package may import of ours (``None``: anything but what FORBIDDEN names).
ALLOWED: dict[str, set[str] | None] = {
    "raftlog": {"chronomq.raftlog"},
    "schedule": {"chronomq.schedule", "chronomq.raftlog"},
    "timer": {"chronomq.timer", "chronomq.raftlog"},
    "cluster": None,
}
# The node package never imports the tooling above it.
FORBIDDEN = {"cluster": {"chronomq.ops", "chronomq.cli"}}


def imported(path: pathlib.Path) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def _hits(module: str, forbidden: set[str]) -> bool:
    return any(module == f or module.startswith(f + ".") for f in forbidden)


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_imports_point_one_way(package: str) -> None:
    allowed = ALLOWED[package]
    bad = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for module in imported(path):
            if module.split(".")[0] in TOP and module.split(".")[0] != "chronomq":
                bad.append(f"{path.relative_to(ROOT)} imports {module} by its old name")
            elif not module.startswith("chronomq"):
                continue
            elif (
                allowed is not None
                and not _hits(module, allowed)
                or _hits(module, FORBIDDEN.get(package, set()))
            ):
                bad.append(f"{path.relative_to(ROOT)} imports {module}")
    assert bad == []
