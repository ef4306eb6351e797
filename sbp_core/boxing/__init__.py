"""Boxing: turning a global tensor's layout into another, with exact communication.

``box`` is the non-differentiable core (same placement: planned 1-d steps;
different placements: point-to-point transfers); ``autograd`` wraps it so
``to_global`` is differentiable. All communication goes through
``collectives``, the one place that calls ``torch.distributed``.
"""
from __future__ import annotations

import torch

from ..layout import Layout
from ..process_groups import on_forget_groups, world_rank
from .cross_placement import box_cross_placement
from .same_placement import compile_same_placement


_compiled: dict = {}  # (src layout, dst layout) -> this rank's steps; layouts are interned
_COMPILED_LIMIT = 1 << 14
on_forget_groups(_compiled.clear)  # planned steps hold their process groups


def _compile(src: Layout, dst: Layout):
    if src.shape != dst.shape or src.dtype != dst.dtype:
        raise ValueError(f"boxing keeps shape and dtype: {src.shape}/{src.dtype} -> {dst.shape}/{dst.dtype}")
    if src.placement == dst.placement:
        if world_rank() not in src.placement or src.sbp == dst.sbp:
            return []
        itemsize = src.dtype.itemsize
        return compile_same_placement(src.placement, src.sbp, dst.sbp, src.shape, itemsize)
    return [lambda local: box_cross_placement(local, src.placement, src.sbp, dst.placement, dst.sbp, src.shape, src.dtype)]


def planned(src: Layout, dst: Layout) -> list:
    """This rank's steps (functions ``local -> local``) boxing ``src`` to ``dst``, planned once per process
    (geometry, ranks, slice bounds, groups). Whoever keeps them must drop them when the groups are
    forgotten (``process_groups.on_forget_groups``)."""
    key = (src, dst)
    steps = _compiled.get(key)
    if steps is None:
        steps = _compile(src, dst)
        if len(_compiled) >= _COMPILED_LIMIT:
            _compiled.clear()
        _compiled[key] = steps
    return steps


def box(local: torch.Tensor, src: Layout, dst: Layout) -> torch.Tensor:
    """This rank's local of the same global value laid out as ``dst`` instead of ``src``.

    Runs the ``planned`` steps; every collective still goes through
    ``collectives`` and so into the ledger.
    """
    steps = _compiled.get((src, dst))
    if steps is None:
        steps = planned(src, dst)
    for step in steps:
        local = step(local)
    return local
