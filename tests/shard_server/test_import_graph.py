"""The shard server's layers, read from its source: no import circle, and ``distributed/``
(the strategies and their communication) stays a library below the server and the CLI."""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

import kubeshard_shard

PACKAGE = Path(kubeshard_shard.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The package's modules that ``path`` imports (``from a import b`` counts ``a.b`` when
    that is a module, else ``a``)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [(alias.name, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            targets = [(base, alias.name) for alias in node.names]
        else:
            continue
        for base, member in targets:
            target = f"{base}.{member}" if member and f"{base}.{member}" in modules else base
            if target in modules and target != name:
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(p) for p in paths}
    return {module_name(p): imports_of(p, modules) for p in paths}


def test_the_graph_is_read_whole():
    graph = import_graph()
    assert "kubeshard_shard.distributed.strategy" in graph
    assert "kubeshard_shard.config" in graph["kubeshard_shard.cli"]
    assert len(graph) > 40


def test_no_import_circle():
    graphlib.TopologicalSorter(import_graph()).prepare()  # raises CycleError with the circle


def test_distributed_imports_neither_the_server_nor_the_cli():
    above = ("kubeshard_shard.server", "kubeshard_shard.cli", "kubeshard_shard.local_launcher")
    wrong = {module: sorted(d for d in deps if d.startswith(above))
             for module, deps in import_graph().items()
             if module.startswith("kubeshard_shard.distributed")}
    assert {m: d for m, d in wrong.items() if d} == {}
