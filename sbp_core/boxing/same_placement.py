"""N-d boxing on one placement: the planner's 1-d steps, executed.

One step changes mesh axis ``axis`` from ``old`` to ``new`` among the ranks
along that axis (every other coordinate fixed):

====================  =========================================
S(i) -> S(j)          all-to-all
S -> B                all-gather
S -> P(op)            own piece in place, ``op``'s identity elsewhere
B -> S                a slice, a view (no communication, no copy)
B -> P(op)            first rank keeps the value, the others ``op``'s identity
P(op) -> S            reduce-scatter with ``op``
P(op) -> B            all-reduce with ``op``
P(op) -> P(op2)       reduce with ``op`` onto the first rank, ``op2``'s identity elsewhere
====================  =========================================
"""
from __future__ import annotations

from operator import itemgetter

import torch

from ..layout import reduce_identity, shard_bounds, view_shape
from ..process_groups import world_rank
from . import collective_plans, nd_plan


def axis_step(placement, state: tuple, axis: int, new, shape):
    """One planner step on this rank as a function ``local -> local``, its geometry computed now.

    ``state`` is the N-d SBP before the step. Local steps are views where
    torch allows (``B -> S`` is a slice, no copy; the shard may then be
    non-contiguous, which every consumer handles).
    """
    old = state[axis]
    me = world_rank()
    coords = placement.coords(me)
    ranks = placement.axis_ranks(axis, me)
    index = coords[axis]
    p = len(ranks)
    if p == 1:  # one device on this axis: every layout is its whole (local) tensor
        return None
    view = view_shape(shape, placement.shape, state, coords, axis)
    if old.is_split:
        start, length = shard_bounds(view[old.axis], p, index)
        mine = view[: old.axis] + (length,) + view[old.axis + 1 :]  # this rank's local
        if new.is_split:
            return collective_plans.plan_all_to_all(ranks, new.axis, old.axis, mine, view[old.axis])
        if new.is_broadcast:
            return collective_plans.plan_all_gather(ranks, old.axis, mine, view[old.axis])

        def place(local):  # S -> P: own piece in place, the identity elsewhere
            out = torch.full(view, reduce_identity(new.op, local.dtype), dtype=local.dtype, device=local.device)
            out.narrow(old.axis, start, length).copy_(local)
            return out

        return place
    if old.is_broadcast:
        if new.is_split:
            start, length = shard_bounds(view[new.axis], p, index)
            # Basic slicing gives the view ``narrow`` gives, ~0.8 us cheaper a call (no schema
            # argument parsing; a bare slice for dim 0, where a one-element tuple index costs
            # ~0.25 us more); an itemgetter is C-level: no Python frame per call.
            piece = slice(start, start + length)
            return itemgetter(piece if new.axis == 0 else (slice(None),) * new.axis + (piece,))
        if index == 0:
            return None
        return lambda local: torch.full_like(local, reduce_identity(new.op, local.dtype))
    if new.is_split:
        return collective_plans.plan_reduce_scatter(ranks, new.axis, view, old.op)
    if new.is_partial:
        reduce = collective_plans.plan_reduce(ranks, view, old.op)
        if index == 0:
            return reduce

        def reduce_away(local):
            # What the reduce sent from is a fresh copy of ours and means nothing afterwards:
            # refill it with the identity instead of allocating another (at 4 MiB a malloc whose
            # pages fault in again).
            return reduce(local).fill_(reduce_identity(new.op, local.dtype))

        return reduce_away
    return collective_plans.plan_all_reduce(ranks, view, old.op)


def compile_same_placement(placement, src: tuple, dst: tuple, shape, itemsize: int) -> list:
    """This rank's steps (functions ``local -> local``) boxing ``src`` to ``dst`` N-d SBP on ``placement``."""
    steps, _ = nd_plan.plan(src, dst, placement.shape, tuple(shape), itemsize)
    state, out = src, []
    for axis, new in steps:
        fn = axis_step(placement, state, axis, new, shape)
        if fn is not None:
            out.append(fn)
        state = state[:axis] + (new,) + state[axis + 1 :]
    return out


def box_same_placement(local: torch.Tensor, placement, src: tuple, dst: tuple, shape) -> torch.Tensor:
    """Box this rank's ``local`` from ``src`` to ``dst`` N-d SBP on ``placement``."""
    for step in compile_same_placement(placement, src, dst, shape, local.element_size()):
        local = step(local)
    return local
