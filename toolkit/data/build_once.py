"""Build a cache directory exactly once, even when several processes ask at once.

``build_once(final_dir, build)`` makes ``final_dir`` exist with the files
``build(tmp_dir)`` writes. A directory that exists at ``final_dir`` is always
complete, because it only ever appears there by an atomic ``os.rename`` of a
finished temporary directory. Concurrent callers (the ranks of one job, or
two jobs sharing a cache) serialize on an OS file lock next to it
(``final_dir + ".lock"``, ``filelock.FileLock``: ``flock`` on POSIX, released
by the kernel if the holder dies), so one builds and the others wait and
then reuse its result. Where the lock does not exclude (some network file
systems), two builders may both build; the first rename wins and the loser
discards its copy, so readers still never see a partial directory.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
from typing import Callable

from filelock import FileLock


def content_key(fields: dict) -> str:
    """A short stable hex digest of a JSON-serializable ``fields`` dict (sorted keys)."""
    text = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:20]


def build_once(final_dir: str, build: Callable[[str], None]) -> bool:
    """Ensure ``final_dir`` holds what ``build(tmp_dir)`` writes; True iff this call built it.

    ``build`` receives an empty directory on the same file system and must
    fill it completely; if it raises, the temporary directory is removed,
    ``final_dir`` is left absent and the exception propagates (the next
    caller builds again). The fast path, ``final_dir`` already present,
    takes no lock.
    """
    if os.path.isdir(final_dir):
        return False
    parent = os.path.dirname(os.path.abspath(final_dir))
    os.makedirs(parent, exist_ok=True)
    with FileLock(final_dir + ".lock"):
        if os.path.isdir(final_dir):
            return False
        tmp = f"{final_dir}.tmp-{socket.gethostname()}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        try:
            build(tmp)
            os.rename(tmp, final_dir)
        except OSError:
            if os.path.isdir(final_dir) and os.path.isdir(tmp):
                shutil.rmtree(tmp, ignore_errors=True)  # another builder's rename won
                return False
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return True
