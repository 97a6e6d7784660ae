"""The packages import one way: ``cluster -> schedule, timer -> raftlog``, with ``ops`` and the
command line (``chronomq.cli``) above them all. Checked on the source, import by import."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
TOP = ("raftlog", "schedule", "timer", "cluster", "ops", "chronomq")

# What each package must never import.
FORBIDDEN = {
    "raftlog": {"schedule", "timer", "cluster", "ops", "chronomq"},
    "schedule": {"timer", "cluster", "ops", "chronomq"},
    "timer": {"schedule", "cluster", "ops", "chronomq"},
    "cluster": {"ops", "chronomq.cli"},
}


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


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_imports_point_one_way(package: str) -> None:
    bad = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for module in imported(path):
            if _hits(module, FORBIDDEN[package]):
                bad.append(f"{path.relative_to(ROOT)} imports {module}")
    assert bad == []
