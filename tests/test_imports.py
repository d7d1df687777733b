"""The import graph of ``server`` and ``agentshare`` (read with grimp, without importing them):
no cycles, and each package imports only what its layer may.

- **No cycle between modules** (files; a package's ``__init__`` counts as one). Imports under
  ``if TYPE_CHECKING:`` count too: none is left, and a cycle that only annotations close still
  ties the two modules together for a reader (break it by moving the shared type to a module
  both import, as ``server/backend.py`` does for the API and the router).
- **The backend interface** (``server.backend``) imports neither implementation: not
  ``server.api`` (the local backend) nor ``server.cluster`` (the router), even indirectly.
- **The cluster** uses only the public face of ``server.api`` (:data:`API_PUBLIC`: the app
  factory, its config, its errors, its logging) and no underscore name of it, and of the SDK only
  the wire schemas shared on purpose (:data:`SDK_SHARED`).
- **The SDK installs light**: no ``agentshare`` module imports ``server`` at all (a local server
  is launched as ``python -m server.cli`` in a child process), and importing every SDK module
  loads neither ``server`` nor the server's heavy dependencies.
"""

from __future__ import annotations

import ast
import itertools
import json
import pkgutil
import subprocess
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

import grimp
import pytest

import agentshare

ROOT = Path(__file__).resolve().parent.parent
API_PUBLIC = frozenset({"server.api", "server.api.app", "server.api.config", "server.api.errors",
                        "server.api.logs"})
"""What ``server/cluster`` may import of ``server/api``; the rest is the local backend's inside."""
SDK_SHARED = frozenset({"agentshare.protocol"})
"""What the server side may import of the SDK in ``server/cluster``: the wire schemas."""
HEAVY = ("server", "torch", "transformers", "fastapi", "starlette", "uvicorn", "prometheus_client",
         "safetensors", "numpy")
"""Top-level packages ``import agentshare`` must not load (the ``server`` extra's)."""


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    return grimp.build_graph("server", "agentshare", exclude_type_checking_imports=False, cache_dir=None)


def _line(graph: grimp.ImportGraph, importer: str, imported: str) -> str:
    details = graph.get_import_details(importer=importer, imported=imported)
    return f"line {details[0]['line_number']}" if details else "?"


def _under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def import_cycles(graph: grimp.ImportGraph) -> list[str]:
    """One cycle per strongly connected set of modules, as ``a -> b (line n) -> ... -> a``."""
    edges = {m: sorted(graph.find_modules_directly_imported_by(m)) for m in sorted(graph.modules)}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []
    for root in edges:  # Tarjan's algorithm, iterative (no recursion limit to meet)
        if root in index:
            continue
        work = [(root, iter(edges[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = []
                    while True:
                        m = stack.pop()
                        on_stack.discard(m)
                        group.append(m)
                        if m == node:
                            break
                    if len(group) > 1:
                        groups.append(sorted(group))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(edges[child])))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    cycles = []
    for group in groups:
        start = group[0]
        inside = set(group)
        back = next(b for b in edges[start] if b in inside)
        chain = graph.find_shortest_chain(importer=back, imported=start, as_packages=False) or (back, start)
        path = [start, *chain]
        hops = " -> ".join(f"{b} ({_line(graph, a, b)})" for a, b in itertools.pairwise(path))
        cycles.append(f"{start} -> {hops}   [modules in this cycle set: {', '.join(group)}]")
    return cycles


def interface_leaks(graph: grimp.ImportGraph) -> list[str]:
    """Chains from ``server.backend`` to either implementation."""
    out = []
    for impl in ("server.api", "server.cluster"):
        for target in sorted(m for m in graph.modules if _under(m, impl)):
            chain = graph.find_shortest_chain(importer="server.backend", imported=target, as_packages=False)
            if chain:
                out.append(" -> ".join(chain))
                break
    return out


def cluster_reaches(graph: grimp.ImportGraph) -> list[str]:
    """Imports of ``server/cluster`` modules outside what they may use of the API and the SDK."""
    out = []
    for importer in sorted(m for m in graph.modules if _under(m, "server.cluster")):
        for imported in sorted(graph.find_modules_directly_imported_by(importer)):
            private = any(part.startswith("_") for part in imported.split("."))
            if _under(imported, "server.api") and (imported not in API_PUBLIC or private):
                out.append(f"{importer} imports {imported} ({_line(graph, importer, imported)}): "
                           f"server/cluster may use only {sorted(API_PUBLIC)} of server/api; move what it "
                           "needs to server.backend (shared by both backends) or another server module")
            elif _under(imported, "agentshare") and imported not in SDK_SHARED:
                out.append(f"{importer} imports {imported} ({_line(graph, importer, imported)}): "
                           f"of the SDK, server/cluster may use only {sorted(SDK_SHARED)}")
    return out


def private_names(sources: Mapping[str, str], *, of: Iterable[str]) -> list[str]:
    """``from X import _name`` in ``sources`` (module name -> source) where X is under one of
    the packages ``of``."""
    packages = tuple(of)
    out = []
    for module, source in sorted(sources.items()):
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and any(
                    _under(node.module, p) for p in packages):
                out += [f"{module} line {node.lineno}: from {node.module} import {a.name} (a private name)"
                        for a in node.names if a.name.startswith("_")]
    return out


def sdk_imports_of_server(graph: grimp.ImportGraph) -> list[str]:
    """Any import, at module level or inside a function, of ``server`` by an SDK module."""
    return [f"{importer} imports {imported} ({_line(graph, importer, imported)})"
            for importer in sorted(m for m in graph.modules if _under(m, "agentshare"))
            for imported in sorted(graph.find_modules_directly_imported_by(importer))
            if _under(imported, "server")]


def _sources(package: str) -> dict[str, str]:
    base = ROOT / package.replace(".", "/")
    return {package + "." + ".".join(p.relative_to(base).with_suffix("").parts): p.read_text()
            for p in sorted(base.rglob("*.py"))}


def test_no_import_cycles(graph: grimp.ImportGraph) -> None:
    cycles = import_cycles(graph)
    assert not cycles, ("import cycles (TYPE_CHECKING imports included); break each by moving what both "
                        "sides need into a module they can both import:\n  " + "\n  ".join(cycles))


def test_the_backend_interface_imports_neither_backend(graph: grimp.ImportGraph) -> None:
    leaks = interface_leaks(graph)
    assert not leaks, "server.backend must import neither server.api nor server.cluster:\n  " + "\n  ".join(leaks)


def test_the_cluster_uses_only_the_public_api_and_the_wire_schemas(graph: grimp.ImportGraph) -> None:
    bad = cluster_reaches(graph) + private_names(_sources("server.cluster"), of=("server.api", "agentshare"))
    assert not bad, "server/cluster reaches into another package's inside:\n  " + "\n  ".join(bad)


def test_the_sdk_imports_nothing_of_the_server(graph: grimp.ImportGraph) -> None:
    bad = sdk_imports_of_server(graph)
    assert not bad, ("the SDK must install and import without the server (pip install agentshare); "
                     "launch it as a process instead:\n  " + "\n  ".join(bad))


def test_importing_the_sdk_loads_no_server_dependency() -> None:
    modules = sorted(f"agentshare.{m.name}" for m in pkgutil.iter_modules(agentshare.__path__))
    code = ("import importlib, json, sys\n"
            f"for m in {modules!r}:\n    importlib.import_module(m)\n"
            f"print(json.dumps(sorted({{n.split('.')[0] for n in sys.modules}} & set({list(HEAVY)!r}))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert not loaded, f"importing {modules} loaded {loaded}: the SDK must not need the server extra"
