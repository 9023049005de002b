"""The import graph: the CLI above the services above the simulator (mempo_sim) above
the core (mempo), no upward edge and no module cycle, and no module loaded by name
(importlib), which an import graph cannot see. Every import counts: those for type
checking only and those inside a function too."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

from tests.conftest import REPO

LAYERS = {"mempo": 0, "mempo_sim": 1, "services": 2, "mempo_cli": 3}


def _modules() -> dict[str, Path]:
    found = {}
    for package in LAYERS:
        for path in (REPO / package).rglob("*.py"):
            name = ".".join(path.relative_to(REPO).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def _edges() -> dict[str, set[str]]:
    modules = _modules()
    edges: dict[str, set[str]] = defaultdict(set)
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                targets = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            else:
                continue
            edges[name] |= {t for t in targets if t in modules and t != name}
    return edges


def test_no_upward_edge_and_no_module_loaded_by_name() -> None:
    layer = {name: LAYERS[name.split(".")[0]] for name in _modules()}
    upward = sorted((a, b) for a, targets in _edges().items() for b in targets if layer[b] > layer[a])
    assert not upward, upward
    by_name = [str(p) for p in _modules().values() if "importlib" in p.read_text()]
    assert not by_name, by_name


def test_no_import_cycle() -> None:
    edges = _edges()
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> None:
        if name in path:
            raise AssertionError(" -> ".join([*path[path.index(name) :], name]))
        if name in done:
            return
        for target in sorted(edges.get(name, ())):
            visit(target, [*path, name])
        done.add(name)

    for module in sorted(_modules()):
        visit(module, [])
