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


def run_main(name: str, args: list, tmp_path, monkeypatch, capsys) -> tuple:
    """``scripts/<name>.py``'s ``main(args)`` in this process: ``(exit status, stdout, stderr)``.

    What the script runs is the same; what is saved is a fresh interpreter importing torch and, where the
    script starts ranks, a fresh fork server doing so again (seconds each on 2 cores): its ranks fork from
    this process's server, or run on its rank pool. ``SBP_CACHE_DIR`` is ``tmp_path`` for the call (a pool or
    fork server the call starts keeps it, and pytest keeps the directory past the session). Each script keeps a
    test through :func:`run_script` for its command line."""
    import importlib

    import torch

    monkeypatch.setenv("SBP_CACHE_DIR", str(tmp_path))
    threads = torch.get_num_threads()  # a script may set this process's threads
    try:
        code = importlib.import_module(f"scripts.{name}").main(args)
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr()
    return code, out.out, out.err
