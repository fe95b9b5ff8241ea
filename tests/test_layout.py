"""The package layout: the sans-IO core stays sans-IO, and the public import paths keep working."""

from __future__ import annotations

import ast
import importlib
import pkgutil
from pathlib import Path

import pytest

import dafka
import dafka.core

CORE = Path(dafka.core.__file__).parent

# What the sans-IO core must not import at module level: sockets, threads, clocks, storage.
IO_MODULES = {"asyncio", "lmdb", "os", "select", "selectors", "socket", "threading", "time", "zmq"}
# What the core may import of dafka: itself and the errors.
CORE_MAY_IMPORT = ("dafka.core", "dafka.errors")


def core_modules() -> list[Path]:
    return sorted(CORE.glob("*.py"))


def imported(tree: ast.Module, top_level_only: bool) -> list[str]:
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    names: list[str] = []
    for node in nodes:
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names += [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
    return names


@pytest.mark.parametrize("path", core_modules(), ids=lambda p: p.name)
def test_core_module_imports_no_io_and_no_shell(path: Path) -> None:
    tree = ast.parse(path.read_text(), str(path))
    io = [n for n in imported(tree, top_level_only=True) if n.split(".")[0] in IO_MODULES]
    assert io == [], f"{path.name} imports I/O at module level: {io}"
    shells = [
        n
        for n in imported(tree, top_level_only=False)
        if n.split(".")[0] == "dafka" and n != "dafka" and not n.startswith(CORE_MAY_IMPORT)
    ]
    assert shells == [], f"{path.name} (sans-IO core) imports outside the core: {shells}"


def test_the_core_holds_the_protocol_modules() -> None:
    names = {p.stem for p in core_modules()}
    expected = {"wire", "gaps", "unacked", "peers", "groups", "resume", "audience", "beacon", "reach"}
    assert expected <= names


def test_public_import_paths_are_the_node_classes() -> None:
    from dafka import consumer, producer
    from dafka.nodes import consumer as node_consumer
    from dafka.nodes import producer as node_producer

    assert producer.Producer is node_producer.Producer
    assert producer.Receipt is node_producer.Receipt
    assert consumer.Consumer is node_consumer.Consumer
    assert consumer.ConsumerRecord is node_consumer.ConsumerRecord
    for shim in (producer, consumer):
        for name in shim.__all__:
            assert getattr(shim, name) is not None


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # kafka-python reads its schemas the old way
def test_every_module_imports() -> None:
    # Catches an import of a moved module by its old path (the Spark connector needs pyspark).
    failed = []
    for info in pkgutil.walk_packages(dafka.__path__, "dafka."):
        if info.name.endswith("__main__") or info.name.startswith("dafka.spark"):
            continue
        try:
            importlib.import_module(info.name)
        except ImportError as exc:
            failed.append(f"{info.name}: {exc}")
    assert failed == []


# Import circles among dafka's modules.  Every import counts: module level, inside a function (an
# import moved into a function to dodge a circle at import time is still a circle in the design:
# each side needs the other to be understood or changed), and under TYPE_CHECKING (an annotation
# naming the other side's class is a dependency on it; the circles issue 41 names were mostly
# of that kind).  A package's __init__ counts as the module named by the package.
PACKAGE = Path(dafka.__file__).parent

# Known circles, each an explicit allowance to be removed when it is broken (none now).
ALLOWED_CIRCLES: set[frozenset[str]] = set()


def dafka_modules() -> dict[str, tuple[Path, bool]]:
    """Every module of the package: dotted name -> (file, whether it is a package's __init__)."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        modules[".".join(parts)] = (path, is_package)
    return modules


def module_imports(name: str, path: Path, is_package: bool, modules: set[str]) -> dict[str, int]:
    """The modules of dafka that `name` imports anywhere in its file, with the first line of each."""
    package = name if is_package else name.rpartition(".")[0]
    found: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            # `from dafka.x import y` imports the module dafka.x.y if there is one, else dafka.x.
            targets = [
                f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source
                for alias in node.names
            ]
        for target in targets:
            if target in modules and target != name:
                found.setdefault(target, node.lineno)
    return found


def import_graph() -> dict[str, dict[str, int]]:
    modules = dafka_modules()
    return {name: module_imports(name, path, pkg, set(modules)) for name, (path, pkg) in modules.items()}


def circles(graph: dict[str, dict[str, int]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(frozenset(component))
    return found


def describe(circle: frozenset[str], graph: dict[str, dict[str, int]]) -> str:
    edges = [
        f"{source} -> {target} (line {line})"
        for source in sorted(circle)
        for target, line in sorted(graph[source].items())
        if target in circle
    ]
    return "; ".join(edges)


def test_no_import_circles() -> None:
    graph = import_graph()
    found = circles(graph)
    new = [describe(circle, graph) for circle in found if circle not in ALLOWED_CIRCLES]
    assert new == [], f"import circles among dafka's modules: {new}"
    stale = [sorted(circle) for circle in ALLOWED_CIRCLES if circle not in found]
    assert stale == [], f"allowed circles that are gone (remove them from ALLOWED_CIRCLES): {stale}"


def test_circle_finder_sees_function_level_and_type_checking_imports(tmp_path: Path) -> None:
    # The checker itself: a circle closed only by a function-level import, one closed only under
    # TYPE_CHECKING, and a relative import; a chain without a way back is no circle.
    files = {
        "a.py": "def f():\n    from pkg import b\n",
        "b.py": "import pkg.a\n",
        "c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.d import D\n",
        "d.py": "from . import c\n",
        "e.py": "from pkg import a\n",
    }
    modules = {f"pkg.{name[:-3]}": (tmp_path / name, False) for name in files}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    graph = {
        name: module_imports(name, path, pkg, set(modules)) for name, (path, pkg) in modules.items()
    }
    assert sorted(sorted(c) for c in circles(graph)) == [["pkg.a", "pkg.b"], ["pkg.c", "pkg.d"]]
