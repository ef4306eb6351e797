"""Every module the project imports, anywhere in a file (function-level imports too), is declared.

A dependency that is only there because another package pulls it in breaks
on the day that package drops it, and an import inside a function breaks
only when a user reaches that line. This reads every ``import`` of the
packages, scripts and tests and checks its top-level module against the
standard library, the project's own packages, and the distributions
``pyproject.toml`` declares (dependencies and the ``test`` extra). The one
optional import, NVIDIA DALI, is guarded where it is used.
"""
from __future__ import annotations

import ast
import importlib.metadata
import pathlib
import re
import sys

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = pathlib.Path(__file__).resolve().parents[1]
SOURCES = ["sbp_core", "runtime", "toolkit", "recipes", "benchkit", "scripts", "tests", "train.py", "generate.py",
           "conftest.py"]
OWN = {"sbp_core", "runtime", "toolkit", "recipes", "benchkit", "scripts", "tests", "train", "generate"}
OPTIONAL = {"nvidia": "recipes/insightface/data/dali.py checks find_spec('nvidia.dali') first"}


def _imports():
    """``{top-level module: [files importing it]}`` outside the standard library and this project."""
    found: dict = {}
    for src in SOURCES:
        path = ROOT / src
        for f in [path] if path.suffix == ".py" else sorted(path.rglob("*.py")):
            for node in ast.walk(ast.parse(f.read_text(), str(f))):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.split(".")[0]
                    if top in OWN or top in sys.stdlib_module_names or top == "__future__":
                        continue
                    found.setdefault(top, []).append(str(f.relative_to(ROOT)))
    return found


def _declared() -> set:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"]) + list(project["optional-dependencies"]["test"])
    return {_normal(re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0]) for r in reqs}


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_every_imported_module_comes_from_a_declared_distribution():
    declared = _declared()
    owners = importlib.metadata.packages_distributions()
    missing = []
    for module, files in sorted(_imports().items()):
        if module in OPTIONAL:
            continue
        dists = {_normal(d) for d in owners.get(module, [])}
        if not dists & declared:
            missing.append(f"{module} (distribution {sorted(dists) or 'not installed'}), imported by {files[:3]}")
    assert not missing, "imports whose distribution pyproject.toml does not declare:\n" + "\n".join(missing)
