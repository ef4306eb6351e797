"""The few world-level collectives a checkpoint needs, and their one-process fallbacks.

``save`` and ``load`` are collective over the default (world) group. Without
``torch.distributed`` initialised they run as a world of one, so scripts
(``convert_hf.py``) need no process group. Object collectives here carry
our own small Python values between live processes; nothing read from disk
is ever unpickled. They go over ``group()``, the world's gloo group (its
control twin under NCCL; a world of one rank has none), as
``torch.distributed.checkpoint``'s own planning messages do: on the host,
off the GPUs' streams.
"""
from __future__ import annotations

import warnings
from contextlib import contextmanager

import torch.distributed as dist

from sbp_core.process_groups import control_group
from sbp_core.process_groups import world_rank as rank  # noqa: F401  (this rank; 0 without a process group)

from .errors import CheckpointError

# Errors that every rank re-raises as themselves when one rank hit them (the
# caller's mistake, reported the same way on every rank); anything else
# becomes a CheckpointError.
_PASS_THROUGH = (CheckpointError, TypeError, ValueError, KeyError)


def initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def world_size() -> int:
    return dist.get_world_size() if initialized() else 1


def group():
    """The world's group for host messages (``None`` without a process group)."""
    return control_group(dist.group.WORLD) if initialized() else None


def all_gather_object(obj) -> list:
    if not initialized():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj, group=group())
    return out


def agree(fn, *args):
    """Run ``fn(*args)`` on every rank; if any rank raised, raise on every rank.

    Returns the list of every rank's value. A rank's exception is re-raised
    as its own class when that is a caller error (``TypeError``,
    ``ValueError``, ``KeyError``, ``CheckpointError``), else as
    ``CheckpointError``; the message names the rank. This keeps ranks in step:
    no rank enters the next collective while another has given up.
    """
    try:
        mine = (True, fn(*args))
    except Exception as exc:  # reported to every rank below
        mine = (False, (type(exc), f"rank {rank()}: {type(exc).__name__}: {exc}"))
    gathered = all_gather_object(mine)
    for ok, value in gathered:
        if not ok:
            cls, message = value
            raise (cls if issubclass(cls, _PASS_THROUGH) else CheckpointError)(message)
    return [value for _, value in gathered]


@contextmanager
def single_process_quiet():
    """DCP warns on every call without a process group; a world of one is intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield
