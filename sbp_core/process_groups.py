"""Process groups for sets of ranks, built once per rank set and cached.

Groups are built *collectively*: every rank of the world calls ``ensure`` with
the same rank sets in the same order (placements do so when they are
constructed, and every rank constructs every placement, SPMD style). Lazily
building a group among its members only (``use_local_synchronization``)
deadlocks gloo when overlapping groups are built by different subsets, so we
do not. Every group gets the same timeout, so a collective that one member
never joins ends with an error instead of a hang. Point-to-point traffic uses
the default (world) group and needs no group of its own.
"""
from __future__ import annotations

import datetime
import os

import torch.distributed as dist

_groups: dict = {}
_timeout_s: float = float(os.environ.get("SBP_TIMEOUT", "300"))


def set_timeout(seconds: float) -> None:
    """Timeout of every collective on groups created after this call."""
    global _timeout_s
    if seconds <= 0:
        raise ValueError(f"timeout must be positive seconds, got {seconds}")
    _timeout_s = float(seconds)


def get_timeout() -> float:
    return _timeout_s


def world_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def ensure(rank_sets) -> None:
    """Build the groups for ``rank_sets`` that do not exist yet; collective over the world."""
    missing = sorted({tuple(sorted(r)) for r in rank_sets if len(r) > 1} - set(_groups))
    if missing and not dist.is_initialized():
        raise RuntimeError(
            f"groups of ranks {[list(m) for m in missing]} need torch.distributed to be initialised "
            "(launch one process per device)"
        )
    for key in missing:
        if len(key) == world_size():
            _groups[key] = dist.group.WORLD
        else:
            _groups[key] = dist.new_group(list(key), timeout=datetime.timedelta(seconds=_timeout_s))


def group_of(ranks) -> "dist.ProcessGroup | None":
    """The process group whose members are ``ranks`` (any order); ``None`` for one rank.

    Group rank order is the sorted order of the global ranks.
    """
    key = tuple(sorted(ranks))
    if len(key) == 1:
        return None
    if len(key) == world_size():
        return dist.group.WORLD
    g = _groups.get(key)
    if g is None:
        raise RuntimeError(
            f"no process group for ranks {list(key)}: groups are built when a placement is constructed, "
            "so construct every placement on every rank"
        )
    return g


def channel_group(name, ranks):
    """A group of its own for one point-to-point channel (``name`` unique per channel).

    Collective over the world like ``ensure``: every rank asks for the same
    channels in the same order. Separate groups keep traffic of different
    threads apart, so gloo never sees two threads' messages on one group.
    """
    key = ("channel", name, tuple(sorted(ranks)))
    g = _groups.get(key)
    if g is None:
        g = dist.new_group(sorted(ranks), timeout=datetime.timedelta(seconds=_timeout_s))
        _groups[key] = g
    return g


_forget_hooks: list = []  # callables run by forget_groups: caches of plans that hold groups


def on_forget_groups(hook) -> None:
    """Run ``hook()`` whenever ``forget_groups`` drops the groups (boxing plans hold them)."""
    _forget_hooks.append(hook)


def forget_groups() -> None:
    """Drop every cached group: call after destroying the default group (e.g. leaving a rehearsal's fake world)."""
    _groups.clear()
    for hook in _forget_hooks:
        hook()
