"""The checkpoint root: ``step_<N>`` directories, the ``latest`` pointer, keep-last-k.

::

    <root>/step_100/            complete: manifest.json written last, then renamed from .tmp
    <root>/step_200.tmp/        being written (or left by a crash: never read, removed by the next save)
    <root>/latest               "step_100": replaced atomically after the rename

A checkpoint becomes visible only by the rename of its finished directory
and then the ``os.replace`` of ``latest``, so a crash at any point leaves
the previous checkpoint complete and ``latest`` naming it (or, if the crash
fell between the two renames, naming the previous one while the new one is
complete too). ``latest()`` trusts the pointer only when it names a
directory with a manifest; otherwise it takes the most recently completed
one.
"""
from __future__ import annotations

import os
import re
import shutil

from . import manifest
from .errors import CheckpointError

LATEST = "latest"
_STEP = re.compile(r"^step_(\d+)$")


def step_name(step: int) -> str:
    return f"step_{int(step)}"


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def complete_dirs(root: str) -> list:
    """Names of complete checkpoints under ``root``, oldest completion first."""
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        mpath = os.path.join(root, name, manifest.NAME)
        if _STEP.match(name) and os.path.isfile(mpath):
            found.append((os.path.getmtime(mpath), int(_STEP.match(name).group(1)), name))
    return [name for *_, name in sorted(found)]


def latest(root: str) -> str | None:
    """Path of the newest complete checkpoint under ``root``, or ``None`` if there is none."""
    root = os.path.abspath(root)
    try:
        with open(os.path.join(root, LATEST)) as f:
            name = f.read().strip()
    except OSError:
        name = ""
    if _STEP.match(name) and os.path.isfile(os.path.join(root, name, manifest.NAME)):
        return os.path.join(root, name)
    done = complete_dirs(root)
    return os.path.join(root, done[-1]) if done else None


def resolve(path: str) -> str:
    """A checkpoint directory from a checkpoint directory or a root holding ``latest``/``step_*``."""
    path = os.path.abspath(path)
    if os.path.isfile(os.path.join(path, manifest.NAME)):
        return path
    found = latest(path)
    if found is None:
        raise CheckpointError(f"{path}: no complete checkpoint here (neither a checkpoint directory with "
                              f"{manifest.NAME} nor a root with {LATEST} or step_<N> directories)")
    return found


def remove_stale(root: str) -> None:
    """Remove what interrupted work left: ``*.tmp`` directories (saves that never finished) and
    ``step_<N>`` directories without a manifest (a removal by ``prune`` that never finished)."""
    for name in os.listdir(root):
        path = os.path.join(root, name)
        if not os.path.isdir(path):
            continue
        if name.endswith(".tmp") or (_STEP.match(name) and not os.path.isfile(os.path.join(path, manifest.NAME))):
            shutil.rmtree(path, ignore_errors=True)


def publish(root: str, tmp: str, name: str) -> str:
    """Rename the finished ``tmp`` directory to ``name`` and point ``latest`` at it."""
    final = os.path.join(root, name)
    _fsync_dir(tmp)
    if os.path.exists(final):  # the same step saved again (e.g. after a resume): replace it
        old = final + ".replaced.tmp"
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)
    _fsync_dir(root)
    pointer = os.path.join(root, LATEST + ".tmp")
    with open(pointer, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(pointer, os.path.join(root, LATEST))
    _fsync_dir(root)
    return final


def prune(root: str, keep_last: int | None, keep: str) -> list:
    """Remove all but the ``keep_last`` most recently completed checkpoints (never ``keep``); returns the removed."""
    if not keep_last or keep_last < 1:
        return []
    done = complete_dirs(root)
    doomed = [n for n in done[:-keep_last] if n != keep]
    for name in doomed:
        # Drop the manifest first: a crash mid-removal leaves no half checkpoint that looks complete.
        os.remove(os.path.join(root, name, manifest.NAME))
        shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    return doomed
