"""The checkpoint root: ``step_<N>`` directories, the ``latest`` pointer, keep-last-k.

::

    <root>/step_100/            complete: manifest.json written last, then renamed from .tmp
    <root>/step_200.tmp/        being written, or left by a crash (see below)
    <root>/latest               "step_100": replaced atomically after the rename

A checkpoint is complete once its ``manifest.json`` exists: rank 0 writes it
last, after every rank's files and the directory are on disk. It becomes
visible by the rename of its finished directory and then the ``os.replace``
of ``latest``, so a crash at any point leaves the previous checkpoint
complete and ``latest`` naming it, or the new one complete too.
``latest()`` trusts the pointer only when it names a directory with a
manifest; otherwise it takes the most recently completed one, counting a
``step_<N>.tmp`` that holds a manifest while ``step_<N>`` does not (a
finished save whose rename was cut short: the same step saved again moves
the old ``step_<N>`` aside first, and ``latest`` names the missing one).
The next save renames the ``.tmp`` that ``latest()`` returns into place
and removes every other ``.tmp`` (a finished save the pointer never
reached is not what a resume continued from: its run was abandoned).
"""
from __future__ import annotations

import os
import re
import shutil

from . import manifest
from .errors import CheckpointError

LATEST = "latest"
_STEP = re.compile(r"^step_(\d+)$")
_FINISHED = re.compile(r"^(step_\d+)\.tmp$")  # a save's directory before its rename


def step_name(step: int) -> str:
    return f"step_{int(step)}"


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _has_manifest(root: str, name: str) -> bool:
    return os.path.isfile(os.path.join(root, name, manifest.NAME))


def _unrenamed(root: str, names) -> list:
    """The ``step_<N>.tmp`` among ``names`` that are finished saves whose rename was cut short."""
    return [n for n in names if _FINISHED.match(n) and _has_manifest(root, n)
            and not _has_manifest(root, _FINISHED.match(n).group(1))]


def complete_dirs(root: str) -> list:
    """Names of complete checkpoints under ``root``, oldest completion first (a finished save not yet
    renamed by its ``.tmp`` name)."""
    if not os.path.isdir(root):
        return []
    names = os.listdir(root)
    found = [n for n in names if _STEP.match(n) and _has_manifest(root, n)] + _unrenamed(root, names)
    return sorted(found, key=lambda n: (os.path.getmtime(os.path.join(root, n, manifest.NAME)),
                                        int(re.search(r"\d+", n).group()), n))


def latest(root: str) -> str | None:
    """Path of the newest complete checkpoint under ``root``, or ``None`` if there is none."""
    root = os.path.abspath(root)
    try:
        with open(os.path.join(root, LATEST)) as f:
            name = f.read().strip()
    except OSError:
        name = ""
    if _STEP.match(name) and _has_manifest(root, name):
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
    """Finish what interrupted work left: rename the ``step_<N>.tmp`` that ``latest()`` returns (a finished
    save whose rename was cut short) into place, then remove every other ``*.tmp`` directory (saves that
    never finished or were abandoned, a replaced checkpoint moved aside) and ``step_<N>`` directories
    without a manifest (a removal by ``prune`` that never finished)."""
    found = latest(root)
    m = _FINISHED.match(os.path.basename(found or ""))
    if m:
        shutil.rmtree(os.path.join(root, m.group(1)), ignore_errors=True)
        os.rename(found, os.path.join(root, m.group(1)))
    for name in os.listdir(root):
        path = os.path.join(root, name)
        if not os.path.isdir(path):
            continue
        if name.endswith(".tmp") or (_STEP.match(name) and not _has_manifest(root, name)):
            shutil.rmtree(path, ignore_errors=True)
    fsync_dir(root)


def publish(root: str, tmp: str, name: str) -> str:
    """Rename the finished ``tmp`` directory to ``name`` and point ``latest`` at it."""
    final = os.path.join(root, name)
    fsync_dir(tmp)
    if os.path.exists(final):  # the same step saved again (e.g. after a resume): replace it
        old = final + ".replaced.tmp"  # until the next rename, ``tmp`` (finished) is the complete one
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)
    fsync_dir(root)
    pointer = os.path.join(root, LATEST + ".tmp")
    with open(pointer, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(pointer, os.path.join(root, LATEST))
    fsync_dir(root)
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
