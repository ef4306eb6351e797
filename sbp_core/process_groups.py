"""Process groups for sets of ranks, built once per rank set and cached.

Groups are built *collectively*: every rank of the world calls ``ensure`` with
the same rank sets in the same order (placements do so when they are
constructed, and every rank constructs every placement, SPMD style). Lazily
building a group among its members only (``use_local_synchronization``)
deadlocks gloo when overlapping groups are built by different subsets, so we
do not. Every group gets the same timeout, so a collective that one member
never joins ends with an error instead of a hang. Point-to-point traffic uses
the default (world) group and needs no group of its own.

Two timeouts, as torchtitan's ``init_timeout_seconds`` and
``train_timeout_seconds``: ``SBP_TIMEOUT`` (300 s) bounds every wait of a
training job's steady state, and ``SBP_INIT_TIMEOUT`` (900 s, never less)
every wait inside ``initialising()``: one-time work that one rank may do
while its peers wait, such as building the model, loading a checkpoint, and
a plan's first runs (compiling each stage, one after another along the
pipeline; building communicators; the first reads of data).

Under NCCL a group carries tensors on this rank's CUDA device only
(``tensor_device``). Small host-side messages (a channel's header, a
pickled object, a gang's pick, a layout check) go over the group's
*control twin* instead: a gloo group of the same ranks, built with it, so
they never cost a device round trip (the world's, where no placement spans
the world, on its first use: ``control_group``). Under any other backend a
group is its own twin.
"""
from __future__ import annotations

import datetime
import os
from contextlib import contextmanager

import torch
import torch.distributed as dist

_groups: dict = {}
_twins: dict = {}  # id(group) -> (group, its gloo control twin), where the group itself is not gloo
_twinned: set = set()  # the keys of the groups whose twins exist (a rank outside a group builds its twin too)


def _environment_timeouts() -> tuple:
    """``(SBP_TIMEOUT, SBP_INIT_TIMEOUT)`` in seconds, from the environment (300 and 900 where unset)."""
    return float(os.environ.get("SBP_TIMEOUT", "300")), float(os.environ.get("SBP_INIT_TIMEOUT", "900"))


_timeout_s, _init_timeout_s = _environment_timeouts()
_initialising = 0  # depth of ``initialising`` blocks


def _positive(seconds: float) -> float:
    if not seconds > 0:
        raise ValueError(f"timeout must be positive seconds, got {seconds}")
    return float(seconds)


def set_timeout(seconds: float) -> None:
    """Steady-state timeout of every wait on every group, built or to be built (``SBP_TIMEOUT``)."""
    global _timeout_s
    _timeout_s = _positive(seconds)
    _apply()


def set_init_timeout(seconds: float) -> None:
    """Timeout of every wait inside ``initialising()`` (``SBP_INIT_TIMEOUT``); never below ``set_timeout``'s."""
    global _init_timeout_s
    _init_timeout_s = _positive(seconds)
    _apply()


def read_environment() -> None:
    """Take both timeouts from the environment as it is now, as the import did: for a process whose
    environment was installed after sbp_core was imported (a rank forked from a fork server,
    ``toolkit.child``)."""
    steady, init = _environment_timeouts()
    set_timeout(steady)
    set_init_timeout(init)


def get_timeout() -> float:
    """The bound on a wait that starts now: the init timeout inside ``initialising()``, else the steady one."""
    return max(_timeout_s, _init_timeout_s) if _initialising else _timeout_s


@contextmanager
def initialising():
    """Every wait that starts inside the block (on any group, any thread) may take ``SBP_INIT_TIMEOUT``.

    For one-time work whose length one rank cannot bound for its peers
    (building, loading, a plan's first runs). Every rank enters and leaves
    its blocks at the same points of the job; a wait under way when the
    block ends keeps the bound it started with.
    """
    global _initialising
    _initialising += 1
    try:
        _apply()
        yield
    finally:
        _initialising -= 1
        _apply()


def _apply() -> None:
    """Give every built group of this rank the current timeout. Gloo's collectives and NCCL's watchdog
    read it when an operation starts; gloo's sends and receives keep their group's first one, so sbp_core
    waits for those itself (``collectives._wait``)."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    timeout = datetime.timedelta(seconds=get_timeout())
    mine = {id(g): g for g in [dist.group.WORLD, *_groups.values(), *(twin for _, twin in _twins.values())]
            if g is not None and not dist.distributed_c10d._rank_not_in_group(g)}
    for g in mine.values():
        if dist.get_backend(g) in ("gloo", "nccl"):
            dist.distributed_c10d._set_pg_timeout(timeout, g)


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
            _add_twin(dist.group.WORLD, key, key)
        else:
            _groups[key] = _new_group(key, key)


def _new_group(ranks, key):
    """A group of ``ranks`` (collective over the world) and, off gloo, its control twin; ``key``: the group's
    key in ``_groups``."""
    group = dist.new_group(list(ranks), timeout=datetime.timedelta(seconds=get_timeout()))
    _add_twin(group, ranks, key)
    return group


def _add_twin(group, ranks, key) -> None:
    """Build the control twin of the group ``key`` once, on every rank of the world.

    Every rank outside a group gets torch's one ``NON_GROUP_MEMBER`` object
    for it, so whether a twin exists is kept by the group's key, never by the
    group object: a rank that skipped a twin's ``new_group`` because it is
    outside an earlier group too would build every later group out of step
    with the world. Only NCCL needs twins (gloo carries host tensors itself;
    a rehearsal's "fake" world sends nothing)."""
    if key in _twinned or dist.get_backend() != "nccl":
        return
    twin = dist.new_group(list(ranks), timeout=datetime.timedelta(seconds=get_timeout()), backend="gloo")
    _twinned.add(key)
    if not dist.distributed_c10d._rank_not_in_group(group):
        _twins[id(group)] = (group, twin)


def _twin(group):
    entry = _twins.get(id(group))
    return entry[1] if entry is not None and entry[0] is group else None


def control_group(group):
    """The gloo group of ``group``'s ranks for host-side messages; ``group`` itself under gloo.

    Under NCCL the world's twin, where no placement spans the world, is
    built here on first use: every use of the world's group is collective
    over the world, as building a group is.
    """
    twin = _twin(group)
    if twin is None and group is dist.group.WORLD and world_size() > 1 and dist.get_backend() == "nccl":
        ensure([tuple(range(world_size()))])
        twin = _twin(group)
    return group if twin is None else twin


def tensor_device(group) -> torch.device:
    """Where tensors sent on ``group`` must live: this rank's CUDA device under NCCL, else the host."""
    if group is not None and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def world_device() -> torch.device:
    """This rank's device for the job: its CUDA device where the world group runs NCCL, else the host (a
    gloo job computes on CPU on a machine with GPUs too)."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


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
        g = _new_group(sorted(ranks), key)
        _groups[key] = g
    return g


_forget_hooks: list = []  # callables run by forget_groups: caches of plans that hold groups


def on_forget_groups(hook) -> None:
    """Run ``hook()`` whenever ``forget_groups`` drops the groups (boxing plans hold them)."""
    _forget_hooks.append(hook)


def forget_groups() -> None:
    """Drop every cached group: call after destroying the default group (e.g. leaving a rehearsal's fake world)."""
    _groups.clear()
    _twins.clear()
    _twinned.clear()
    for hook in _forget_hooks:
        hook()
