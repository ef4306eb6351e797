"""Local rank processes, for the launcher (``toolkit.launcher``) and the rank pool (``toolkit.rank_pool``): how
a CPU rank is started (forked by a fork server that imported the project once), and what a rank does for its
parent (take its environment, leave when it is gone, send it pickled messages)."""
from __future__ import annotations

import os
import pickle
import sys
import threading
import time
from multiprocessing import forkserver, get_all_start_methods, get_context
from typing import Callable

PARENT_POLL_S = 1.0


def host_rank_context():
    """The ``multiprocessing`` context that starts CPU ranks: the fork server's, which imported
    ``toolkit.preload`` (torch and this project) once.

    A spawned rank imports torch and this project again (about 3 s of CPU each, which ranks sharing a few
    cores pay one after another); a rank forked from the server starts in a fraction of a second. The
    server is a fresh process that only imported modules: no thread pool, no process group, no CUDA state is
    inherited (``tests/toolkit/test_rank_pool.py`` counts its threads). It is started here, with this
    process's ``sys.path`` as its ``PYTHONPATH`` (``multiprocessing`` does not hand it ``sys.path``), so it
    imports the modules this process would. A forked rank inherits the server's environment, this
    process's as it was when the server started: callers pass ``dict(os.environ)`` and the rank installs
    it (:func:`take_environment`). ``spawn`` where the platform has no fork server."""
    if "forkserver" not in get_all_start_methods():
        return get_context("spawn")
    ctx = get_context("forkserver")
    ctx.set_forkserver_preload(["toolkit.preload"])
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p or os.getcwd() for p in sys.path)
    try:
        forkserver.ensure_running()  # a no-op once it runs
    finally:
        if before is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = before
    return ctx


def take_environment(environ: dict, **extra: str) -> None:
    """Make this process's environment ``environ`` plus ``extra``, and re-read what sbp_core read from the
    environment at import (its timeouts), which a fork server's import did before this environment."""
    os.environ.clear()
    os.environ.update(environ, **extra)
    groups = sys.modules.get("sbp_core.process_groups")
    if groups is not None:  # else its import reads this environment
        groups.read_environment()


def leave_with_parent(parent_pid: int) -> None:
    """Start a daemon thread that ends this process when its parent ``parent_pid`` dies.

    A rank blocked in a collective never reads its pipe, so it would not notice
    the parent's death by EOF; the thread polls the parent instead and leaves hard.
    A spawned child's parent process is ``parent_pid``; a child forked by a fork
    server (:func:`host_rank_context`) is the server's, which outlives
    ``parent_pid`` while any rank it forked lives. So the child leaves when the
    process that started it is gone, or ``parent_pid`` is (no such process, a
    zombie, or another user's under a reused pid).
    """
    started_by = os.getppid()

    def gone() -> bool:
        if os.getppid() != started_by:
            return True
        try:
            os.kill(parent_pid, 0)
        except (ProcessLookupError, PermissionError):
            return True
        try:
            with open(f"/proc/{parent_pid}/stat") as f:
                return f.read().rpartition(")")[2].split()[0] == "Z"  # dead, not yet reaped
        except (OSError, IndexError):
            return False  # no /proc: the signal above is the check

    def watch() -> None:
        while True:
            time.sleep(PARENT_POLL_S)
            if gone():
                os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def send(conn, message, unpicklable: Callable[[Exception], object]) -> None:
    """Send ``message`` pickled on ``conn``; if it does not pickle, send ``unpicklable(exc)`` instead."""
    try:
        payload = pickle.dumps(message)
    except Exception as exc:
        payload = pickle.dumps(unpicklable(exc))
    conn.send_bytes(payload)
