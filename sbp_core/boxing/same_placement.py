"""N-d boxing on one placement: the planner's 1-d steps, executed.

One step changes mesh axis ``axis`` from ``old`` to ``new`` among the ranks
along that axis (every other coordinate fixed):

====================  =========================================
S(i) -> S(j)          all-to-all
S -> B                all-gather
S -> P(op)            own piece in place, ``op``'s identity elsewhere
B -> S                slice (no communication)
B -> P(op)            first rank keeps the value, the others ``op``'s identity
P(op) -> S            reduce-scatter with ``op``
P(op) -> B            all-reduce with ``op``
P(op) -> P(op2)       reduce with ``op`` onto the first rank, ``op2``'s identity elsewhere
====================  =========================================
"""
from __future__ import annotations

import torch

from ..layout import reduce_identity, shard_bounds, view_shape
from ..process_groups import world_rank
from . import collectives, nd_plan


def box_axis(local: torch.Tensor, placement, state: tuple, axis: int, new, shape) -> torch.Tensor:
    """Apply one planner step on this rank; ``state`` is the N-d SBP before it."""
    old = state[axis]
    me = world_rank()
    coords = placement.coords(me)
    ranks = placement.axis_ranks(axis, me)
    index = coords[axis]
    p = len(ranks)
    if p == 1:  # one device on this axis: every layout is its whole (local) tensor
        return local
    view = view_shape(shape, placement.shape, state, coords, axis)
    if old.is_split:
        if new.is_split:
            return collectives.all_to_all(local, ranks, new.axis, old.axis, view[old.axis])
        if new.is_broadcast:
            return collectives.all_gather(local, ranks, old.axis, view[old.axis])
        out = torch.full(view, reduce_identity(new.op, local.dtype), dtype=local.dtype, device=local.device)
        start, length = shard_bounds(view[old.axis], p, index)
        out.narrow(old.axis, start, length).copy_(local)
        return out
    if old.is_broadcast:
        if new.is_split:
            start, length = shard_bounds(view[new.axis], p, index)
            return local.narrow(new.axis, start, length).contiguous()
        if index == 0:
            return local
        return torch.full_like(local, reduce_identity(new.op, local.dtype))
    if new.is_split:
        return collectives.reduce_scatter(local, ranks, new.axis, old.op)
    if new.is_partial:
        out = collectives.reduce(local, ranks, old.op)
        return out if index == 0 else torch.full_like(local, reduce_identity(new.op, local.dtype))
    return collectives.all_reduce(local, ranks, old.op)


def box_same_placement(local: torch.Tensor, placement, src: tuple, dst: tuple, shape) -> torch.Tensor:
    """Box this rank's ``local`` from ``src`` to ``dst`` N-d SBP on ``placement``."""
    steps, _ = nd_plan.plan(src, dst, placement.shape, tuple(shape), local.element_size())
    state = src
    for axis, new in steps:
        local = box_axis(local, placement, state, axis, new, shape)
        state = state[:axis] + (new,) + state[axis + 1 :]
    return local
