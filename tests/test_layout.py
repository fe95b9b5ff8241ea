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
