"""Imports point down the layers (``docs/design.md``), and no package's modules import each other in a circle.

``sbp_core`` imports none of ours; ``runtime`` only ``sbp_core``; ``toolkit``
``runtime`` and ``sbp_core``; ``recipes`` anything below them; ``benchkit``
(what the scripts share) anything, and nothing imports it. Every import
counts, the ones inside functions too (read from the source, not by running
it). A circle is a cycle among the module-level imports of one package.
"""
from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BELOW = {"sbp_core": set(), "runtime": {"sbp_core"}, "toolkit": {"runtime", "sbp_core"},
         "recipes": {"toolkit", "runtime", "sbp_core"}, "benchkit": {"recipes", "toolkit", "runtime", "sbp_core"}}


def _modules(pkg: str):
    for base, _, files in os.walk(os.path.join(ROOT, pkg)):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(base, f)
                name = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                yield name.removesuffix(".__init__"), path, f == "__init__.py"


def _imports(name: str, path: str, is_pkg: bool, top_level_only: bool) -> set:
    """Absolute names of the modules ``name`` imports (relative imports resolved)."""
    tree = ast.parse(open(path).read())
    nodes = tree.body if top_level_only else ast.walk(tree)
    here = name.split(".") if is_pkg else name.split(".")[:-1]
    out = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = here[:len(here) - node.level + 1] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            out.add(mod)
            out |= {f"{mod}.{a.name}" for a in node.names}  # ``from pkg import module``
    return out


def test_imports_point_down_the_layers():
    bad = []
    for pkg, allowed in BELOW.items():
        for name, path, is_pkg in _modules(pkg):
            for imp in _imports(name, path, is_pkg, top_level_only=False):
                top = imp.split(".")[0]
                if top in BELOW and top != pkg and top not in allowed:
                    bad.append(f"{name} imports {imp}")
    assert not bad, "\n".join(sorted(bad))


def test_no_import_circles():
    known = {name for pkg in BELOW for name, _, _ in _modules(pkg)}
    graph = {}
    for pkg in BELOW:
        for name, path, is_pkg in _modules(pkg):
            graph[name] = {i for i in _imports(name, path, is_pkg, top_level_only=True) if i in known and i != name}
    # A package's __init__ importing its own submodules is how a package is assembled, not a circle.
    for name in graph:
        graph[name] = {i for i in graph[name] if not name.startswith(i + ".") and not i.startswith(name + ".")}
    seen, stack, cycles = set(), [], []

    def visit(n):
        if n in stack:
            cycles.append(stack[stack.index(n):] + [n])
            return
        if n in seen:
            return
        seen.add(n)
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            visit(m)
        stack.pop()

    for n in sorted(graph):
        visit(n)
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)
