"""What a spawned rank process does for its parent, in the launcher (``toolkit.launcher``) and the rank pool
(``toolkit.rank_pool``): leave when the parent is gone, and send it pickled messages."""
from __future__ import annotations

import os
import pickle
import threading
import time
from typing import Callable

PARENT_POLL_S = 1.0


def leave_with_parent(parent_pid: int) -> None:
    """Start a daemon thread that ends this process when its parent ``parent_pid`` dies.

    A rank blocked in a collective never reads its pipe, so it would not notice
    the parent's death by EOF; the thread polls the parent instead and leaves hard.
    A spawned child's parent process is ``parent_pid``; a child forked by a fork
    server (``toolkit.rank_pool``) is the server's, which ends when
    ``parent_pid`` does: either way the child leaves once the process that
    started it is gone, or ``parent_pid`` is.
    """
    started_by = os.getppid()

    def gone() -> bool:
        if os.getppid() != started_by:
            return True
        try:
            os.kill(parent_pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:  # another user's process under a reused pid
            return True
        return False

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
