"""A script of ``scripts/`` run as a user runs it: a fresh process from the repository root, its cache in a
test's temporary directory."""
from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_script(name: str, args: list, tmp_path, timeout: float = 600) -> subprocess.CompletedProcess:
    """``python scripts/<name> <args>``, output captured (``SBP_CACHE_DIR`` under ``tmp_path``)."""
    env = {**os.environ, "SBP_CACHE_DIR": str(tmp_path), "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, os.path.join(ROOT, "scripts", name), *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)
