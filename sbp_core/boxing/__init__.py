"""Boxing: turning a global tensor's layout into another, with exact communication.

``box`` is the non-differentiable core (same placement: planned 1-d steps;
different placements: point-to-point transfers); ``autograd`` wraps it so
``to_global`` is differentiable. All communication goes through
``collectives``, the one place that calls ``torch.distributed``.
"""
from __future__ import annotations

import torch

from ..layout import Layout
from ..process_groups import world_rank
from .cross_placement import box_cross_placement
from .same_placement import box_same_placement


def box(local: torch.Tensor, src: Layout, dst: Layout) -> torch.Tensor:
    """This rank's local of the same global value laid out as ``dst`` instead of ``src``."""
    if src.shape != dst.shape or src.dtype != dst.dtype:
        raise ValueError(f"boxing keeps shape and dtype: {src.shape}/{src.dtype} -> {dst.shape}/{dst.dtype}")
    if src.placement == dst.placement:
        if world_rank() not in src.placement:
            return local
        if src.sbp == dst.sbp:
            return local
        return box_same_placement(local, src.placement, src.sbp, dst.sbp, src.shape)
    return box_cross_placement(local, src.placement, src.sbp, dst.placement, dst.sbp, src.shape, src.dtype)
