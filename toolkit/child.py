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
    """Start a daemon thread that ends this process when its parent dies.

    A rank blocked in a collective never reads its pipe, so it would not notice
    the parent's death by EOF; the thread polls the parent instead and leaves hard.
    """
    def watch() -> None:
        while True:
            time.sleep(PARENT_POLL_S)
            if os.getppid() != parent_pid:
                os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def send(conn, message, unpicklable: Callable[[Exception], object]) -> None:
    """Send ``message`` pickled on ``conn``; if it does not pickle, send ``unpicklable(exc)`` instead."""
    try:
        payload = pickle.dumps(message)
    except Exception as exc:
        payload = pickle.dumps(unpicklable(exc))
    conn.send_bytes(payload)
