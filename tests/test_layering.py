"""The packages import one way, layer by layer (lowest first)::

    version <- raftlog <- schedule, timer <- pop <- cluster.config <- cluster.logs
        <- chronomq (the client library) <- cluster.node <- cluster.httpapi, cluster.rocketmq
        <- cluster.process <- cluster.cli <- ops <- chronomq.cli

A unit (a package, or a subpackage of ``cluster``) imports its own modules and the units of
the layers below it, never a unit beside it or above it. The client library (``chronomq/``
but the command line) imports only itself, ``chronomq.version`` and the ops-log format
(``cluster.logs``, for its consumers' latency logs), and only the commands use it. Everything is
imported under the ``chronomq`` name (nothing installs a top-level ``cluster``, ``pop``,
``schedule``, ``timer``, ``ops`` or ``raftlog``). Checked on the source, import by import,
imports inside functions and for the type checker included."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
TOP = ("raftlog", "schedule", "timer", "pop", "cluster", "ops", "chronomq")

# The client library: ``chronomq`` and its modules that no unit below claims.
LIBRARY = "chronomq"

# Lowest first. ``chronomq.cluster`` is the package's own ``__init__`` and ``__main__``
# (``python -m chronomq.cluster``, the node's commands alone).
LAYERS: tuple[tuple[str, ...], ...] = (
    ("chronomq.version",),
    ("chronomq.raftlog",),
    ("chronomq.schedule", "chronomq.timer"),
    ("chronomq.pop",),
    ("chronomq.cluster.config",),
    ("chronomq.cluster.logs",),
    (LIBRARY,),
    ("chronomq.cluster.node",),
    ("chronomq.cluster.httpapi", "chronomq.cluster.rocketmq"),
    ("chronomq.cluster.process",),
    ("chronomq.cluster.cli",),
    ("chronomq.cluster",),
    ("chronomq.ops",),
    ("chronomq.cli",),
    ("chronomq.__main__",),
)
UNITS = tuple(u for layer in LAYERS for u in layer)

# What each unit may import of ours: itself and the layers below it.
ALLOWED: dict[str, set[str]] = {
    unit: {unit}.union(*(set(lower) for lower in LAYERS[:i]))
    for i, layer in enumerate(LAYERS)
    for unit in layer
}
# And what it may not, although it sits below: the client library is for the commands (the
# node speaks HTTP, it does not call itself through a client), and it needs nothing else.
FORBIDDEN: dict[str, set[str]] = {
    unit: {LIBRARY}
    for unit in UNITS
    if unit not in ("chronomq.cluster.cli", "chronomq.ops", "chronomq.cli", LIBRARY)
}
# The library writes the consumers' latency logs in the ops-log format (``cluster.logs``).
FORBIDDEN[LIBRARY] = set(UNITS) - {LIBRARY, "chronomq.version", "chronomq.cluster.logs"}
# Modules every unit may read that import nothing of ours (checked below).
LEAVES = ("chronomq/version.py",)


def unit_of(module: str) -> str | None:
    """The unit a module of ours belongs to: the longest unit name it starts with (the client
    library for the rest of ``chronomq``); None for a module not of ours."""
    if module != LIBRARY and not module.startswith(LIBRARY + "."):
        return None
    return max(
        (u for u in UNITS if module == u or module.startswith(u + ".")), key=len, default=LIBRARY
    )


def imported(path: pathlib.Path) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def test_unit_of() -> None:
    assert unit_of("chronomq.cluster.node.broker") == "chronomq.cluster.node"
    assert unit_of("chronomq.cluster") == "chronomq.cluster"
    assert unit_of("chronomq.pop") == unit_of("chronomq.pop.state") == "chronomq.pop"
    assert unit_of("chronomq.cli") == "chronomq.cli"
    assert unit_of("chronomq._wire") == unit_of("chronomq") == LIBRARY
    assert unit_of("aiohttp.web") is None


def wrong_way(root: pathlib.Path, package: str) -> list[str]:
    """The imports of ``package`` (a folder under ``root``) that point to a unit beside or
    above the importing one, or that use an old top-level name."""
    bad = []
    files = module_names(root, (package,), "chronomq.")
    assert files, package
    for module, path in sorted(files.items()):
        unit = unit_of(module)
        assert unit is not None, module
        for target in imported(path):
            if target.split(".")[0] in TOP and target.split(".")[0] != "chronomq":
                bad.append(f"{path.relative_to(root)} imports {target} by its old name")
                continue
            other = unit_of(target)
            if other is None or other == unit:
                continue
            if other not in ALLOWED[unit] or other in FORBIDDEN.get(unit, set()):
                bad.append(f"{path.relative_to(root)} ({unit}) imports {target} ({other})")
    return bad


@pytest.mark.parametrize("package", TOP)
def test_imports_point_down(package: str) -> None:
    """No import of a unit beside or above, and none by an old top-level name."""
    assert wrong_way(ROOT, package) == []


def test_the_layer_check_finds_an_upward_a_sideways_and_an_old_name_import(
    tmp_path: pathlib.Path,
) -> None:
    """The checker itself, on a small tree: the log reaching up into the node (inside a
    function, where a cycle would hide), delay levels reaching sideways into the timer, the
    client library reaching into the node, a top-level name; and imports that are fine."""
    files = {
        "raftlog/__init__.py": "",
        "raftlog/store.py": (
            "from chronomq.raftlog import record\n"
            "from chronomq.version import VERSION\n"
            "def f():\n    from chronomq.cluster.node import broker\n"
        ),
        "schedule/__init__.py": "",
        "schedule/levels.py": "from chronomq.timer import wheel\nfrom chronomq.raftlog import store\n",
        "chronomq/__init__.py": "",
        "chronomq/_wire.py": "from chronomq.cluster.node import models\nimport cluster.config\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert wrong_way(tmp_path, "raftlog") == [
        "raftlog/store.py (chronomq.raftlog) imports chronomq.cluster.node (chronomq.cluster.node)"
    ]
    assert wrong_way(tmp_path, "schedule") == [
        "schedule/levels.py (chronomq.schedule) imports chronomq.timer (chronomq.timer)"
    ]
    assert sorted(wrong_way(tmp_path, "chronomq")) == [
        "chronomq/_wire.py (chronomq) imports chronomq.cluster.node (chronomq.cluster.node)",
        "chronomq/_wire.py imports cluster.config by its old name",
    ]


def test_cluster_holds_only_its_subpackages() -> None:
    """Every module of ``cluster/`` sits in one of the subpackages the layers name."""
    loose = sorted(
        p.name
        for p in (ROOT / "cluster").glob("*.py")
        if p.name not in ("__init__.py", "__main__.py")
    )
    subpackages = {p.name for p in (ROOT / "cluster").iterdir() if (p / "__init__.py").exists()}
    assert loose == []
    assert subpackages == {u.split(".")[2] for u in UNITS if u.startswith("chronomq.cluster.")}


def test_pop_is_used_through_its_public_module() -> None:
    """Outside ``pop/``, pop is ``chronomq.pop`` (its ``__all__``), never one of its modules."""
    bad = []
    for package in TOP:
        if package == "pop":
            continue
        for path in sorted((ROOT / package).rglob("*.py")):
            for target in imported(path):
                if target.startswith("chronomq.pop."):
                    bad.append(f"{path.relative_to(ROOT)} imports {target}")
    assert bad == []


def test_a_leaf_imports_nothing_of_ours() -> None:
    for leaf in LEAVES:
        ours = {m for m in imported(ROOT / leaf) if m.split(".")[0] in TOP}
        assert ours == set(), f"{leaf} imports {sorted(ours)}"


# ---------------------------------------------------------------------- cycles between modules

# Packages whose modules form no import cycle, imports inside functions counted (an import
# moved into a function to dodge a cycle is still a cycle): all of them, checked together, so
# that a cycle through two packages counts too.
ACYCLIC = TOP
# Of these, the packages where no module imports one of ours inside a function.
NO_LOCAL_IMPORTS = ("raftlog", "schedule", "timer", "pop", "chronomq")


def _is_type_checking(test: ast.expr) -> bool:
    """``if TYPE_CHECKING:`` or ``if typing.TYPE_CHECKING:``."""
    if isinstance(test, ast.Name):
        return test.id == "TYPE_CHECKING"
    return isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"


def _imports(
    tree: ast.AST, in_function: bool = False
) -> list[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import statement that runs (none under ``if TYPE_CHECKING:``), with whether it
    sits inside a function."""
    out: list[tuple[ast.Import | ast.ImportFrom, bool]] = []
    for child in ast.iter_child_nodes(tree):
        if isinstance(child, ast.If) and _is_type_checking(child.test):
            for stmt in child.orelse:
                out.extend(_imports(stmt, in_function))
            continue
        if isinstance(child, ast.Import | ast.ImportFrom):
            out.append((child, in_function))
        inner = in_function or isinstance(
            child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda
        )
        out.extend(_imports(child, inner))
    return out


def module_names(
    root: pathlib.Path, packages: tuple[str, ...], prefix: str
) -> dict[str, pathlib.Path]:
    """Dotted name -> file of every module under ``root/package`` (``prefix`` goes in front:
    this repository's packages install as ``chronomq.<package>``)."""
    out = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            name = ".".join(parts)
            # The folder that is the prefix itself (``chronomq/``) gets no second one.
            out[name if prefix and parts[0] == prefix.rstrip(".") else prefix + name] = path
    return out


def _targets(
    node: ast.Import | ast.ImportFrom, module: str, is_package: bool, known: set[str]
) -> set[str]:
    """The modules of ``known`` that an import statement in ``module`` loads by name."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:
            parent = module.split(".")
            parent = parent[: len(parent) - node.level + (1 if is_package else 0)]
            base = ".".join([*parent, *([base] if base else [])])
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
    return {n for n in names if n in known}


def import_graph(
    root: pathlib.Path, packages: tuple[str, ...], prefix: str = "chronomq."
) -> tuple[dict[str, set[str]], list[str]]:
    """Edges ``module -> modules it imports`` between the modules of ``packages`` (imports
    inside functions included, ``if TYPE_CHECKING:`` blocks left out), and a line for every
    import of one of them made inside a function."""
    files = module_names(root, packages, prefix)
    known = set(files)
    graph: dict[str, set[str]] = {m: set() for m in files}
    local: list[str] = []
    for module, path in files.items():
        tree = ast.parse(path.read_text(), str(path))
        for node, in_function in _imports(tree):
            hits = _targets(node, module, path.name == "__init__.py", known) - {module}
            graph[module] |= hits
            if in_function and hits:
                local.append(f"{path.relative_to(root)}:{node.lineno} imports {sorted(hits)}")
    return graph, local


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted: every
    module of one reaches every other, so each is at least one cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:  # recursion depth is bounded by the number of modules
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph.get(v, ()):
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def test_no_import_cycle_between_modules() -> None:
    graph, _ = import_graph(ROOT, ACYCLIC)
    assert find_cycles(graph) == []


def test_no_import_of_ours_inside_a_function() -> None:
    _, local = import_graph(ROOT, NO_LOCAL_IMPORTS)
    assert local == []


def test_the_cycle_check_finds_a_cycle_dodged_inside_a_function(tmp_path: pathlib.Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.b import B\n")
    # b needs a: the import is moved into a function, which hides the cycle from Python only.
    (pkg / "b.py").write_text(
        "class B:\n    def f(self):\n        from pkg import a\n        return a\n"
    )
    # c and d name each other for the type checker only: no cycle at run time.
    (pkg / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.d import D\nC = 1\n"
    )
    (pkg / "d.py").write_text("from .c import C\nD = C\n")
    # e -> f -> g -> e, through a relative import and a package-level one.
    (pkg / "e.py").write_text("from . import f\n")
    (pkg / "f.py").write_text("import pkg.g\n")
    (pkg / "g.py").write_text("def later():\n    from .e import x\n")

    graph, local = import_graph(tmp_path, ("pkg",), prefix="")

    assert graph["pkg.d"] == {"pkg.c"} and graph["pkg.c"] == set()
    assert find_cycles(graph) == [["pkg.a", "pkg.b"], ["pkg.e", "pkg.f", "pkg.g"]]
    assert local == ["pkg/b.py:3 imports ['pkg.a']", "pkg/g.py:2 imports ['pkg.e']"]


def test_the_cycle_check_on_a_graph() -> None:
    assert find_cycles({"x": {"y"}, "y": {"z"}, "z": set()}) == []
    assert find_cycles({"x": {"y"}, "y": {"x", "z"}, "z": {"z"}}) == [["x", "y"], ["z"]]


# Calls that take a module or package name as a string and resolve it through ``sys.path``.
_NAME_RESOLVERS = frozenset(
    {
        "import_module",
        "__import__",
        "files",
        "find_spec",
        "run_module",
        "resolve_name",
        "read_text",
        "read_binary",
        "open_text",
        "open_binary",
        "contents",
        "is_resource",
        "path",
        "get_data",
    }
)


def _call_name(func: ast.expr) -> str | None:
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return None


def _old_name(value: object) -> bool:
    """A string naming one of our packages (or a module in it) by its top-level name."""
    return isinstance(value, str) and value.split(".")[0] in TOP and value.split(".")[0] != LIBRARY


def names_resolved_at_run_time(root: pathlib.Path, packages: tuple[str, ...]) -> list[str]:
    """Strings that name a module of ours by a top-level name where Python resolves them at run
    time through ``sys.path`` (so the current directory, for ``python -m``): the argument of
    ``importlib.import_module``, ``importlib.resources.files``, ``find_spec``, ``__import__``,
    ``runpy``..., and what follows ``-m`` in a command line."""
    bad = []
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            where = path.relative_to(root)
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Call) and _call_name(node.func) in _NAME_RESOLVERS:
                    for arg in [*node.args[:1], *(k.value for k in node.keywords)]:
                        if isinstance(arg, ast.Constant) and _old_name(arg.value):
                            bad.append(f"{where}:{node.lineno} resolves {arg.value!r}")
                if isinstance(node, ast.List | ast.Tuple):
                    items = node.elts
                    for first, second in zip(items, items[1:], strict=False):
                        if (
                            isinstance(first, ast.Constant)
                            and first.value == "-m"
                            and isinstance(second, ast.Constant)
                            and _old_name(second.value)
                        ):
                            bad.append(f"{where}:{node.lineno} runs -m {second.value!r}")
    return bad


def test_no_module_resolves_a_top_level_name_of_ours_at_run_time() -> None:
    """A node started anywhere but the repository's root (every real install) cannot find a
    top-level ``cluster`` or ``ops``, and a node started where someone can write would import
    theirs: every name handed to the import machinery is ``chronomq.``-qualified."""
    assert names_resolved_at_run_time(ROOT, TOP) == []


def test_the_run_time_name_check_finds_strings_that_name_old_packages(
    tmp_path: pathlib.Path,
) -> None:
    (tmp_path / "cluster").mkdir()
    (tmp_path / "cluster" / "console.py").write_text(
        "import importlib, importlib.resources, subprocess, sys\n"
        'root = importlib.resources.files("cluster")\n'
        'mod = importlib.import_module("ops.bench")\n'
        'subprocess.run([sys.executable, "-m", "cluster", "node"])\n'
        'ok = importlib.resources.files("chronomq.cluster.httpapi")\n'
        'also_ok = importlib.import_module(name="json")\n'
        'print("cluster", "-m")\n'
    )
    assert names_resolved_at_run_time(tmp_path, ("cluster",)) == [
        "cluster/console.py:2 resolves 'cluster'",
        "cluster/console.py:3 resolves 'ops.bench'",
        "cluster/console.py:4 runs -m 'cluster'",
    ]
