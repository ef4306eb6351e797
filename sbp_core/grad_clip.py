"""Global-norm gradient clipping that is right for any mix of layouts.

Written with global-tensor ops, so the layouts decide the communication:
a split gradient's squared sum is a partial sum over its shards (one small
all-reduce), a broadcast gradient's is counted once, a sparse row gradient's
comes from its coalesced values, and a partial gradient is first reduced
(reduce-scatter to a split, cheaper than an all-reduce) before squaring. Gradients on different placements send their scalar to
the first gradient's placement. In a pipeline each rank holds only its
stage's parameters: ``stages`` (every stage's placement) makes each stage's
scalar cross to every rank, so all stages clip by the same global norm.
"""
from __future__ import annotations

import torch

from .global_tensor import GlobalTensor
from .layout import Layout
from .placement import placement as make_placement
from .process_groups import world_rank
from .sbp import Broadcast, Split


def _broadcast(placement) -> tuple:
    return tuple(Broadcast() for _ in placement.shape)


def _without_partial(g: GlobalTensor) -> GlobalTensor:
    """Reduce partial axes to a split of the largest dim (or ``B`` for a scalar)."""
    if not any(s.is_partial for s in g.sbp):
        return g
    to = Split(max(range(g.dim()), key=lambda d: g.shape[d])) if g.dim() else Broadcast()
    return g.to_global(sbp=tuple(to if s.is_partial else s for s in g.sbp))


def _across_stages(total: GlobalTensor, stages: list, norm_type) -> GlobalTensor:
    """Combine each stage's scalar into one, broadcast on the union of the stages (every rank calls this)."""
    ranks = sorted({r for p in stages for r in p.ranks})
    union = make_placement(stages[0].device_type, ranks)
    b = (Broadcast(),)
    out = None
    me = world_rank()
    for p in stages:
        term = total if me in p else GlobalTensor(
            torch.empty(0, dtype=total.dtype, device=total.device), Layout(p, _broadcast(p), torch.Size(), total.dtype))
        term = term.to_global(placement=union, sbp=b)
        out = term if out is None else (out + term if norm_type == 2 else torch.maximum(out, term))
    return out


@torch.no_grad()
def clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2.0, stages=None) -> GlobalTensor:
    """Scale gradients in place so their global ``norm_type``-norm is at most ``max_norm``.

    Returns the total norm before clipping, broadcast on the first gradient's placement
    (on the union of ``stages`` when given). ``norm_type`` is 2 or ``inf``. ``stages``:
    every pipeline stage's placement; each rank passes its own stage's parameters
    and every rank of every stage must call.
    """
    if norm_type not in (2, 2.0, float("inf")):
        raise ValueError(f"norm_type {norm_type!r} is not one of (2, inf)")
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        raise ValueError("clip_grad_norm_ got no parameter with a gradient")
    home = grads[0].placement
    total = None
    for g in grads:
        if g.is_sparse:  # a row gradient: its coalesced values hold its norm
            g = g.coalesce().values_global()
        g = _without_partial(g).float()
        term = g.pow(2).sum() if norm_type == 2 else g.abs().amax()
        if term.placement != home:
            term = term.to_global(placement=home, sbp=_broadcast(home))
        if total is None:
            total = term
        else:
            total = total + term if norm_type == 2 else torch.maximum(total, term)
    if stages is not None:
        total = _across_stages(total, list(stages), norm_type)
        home = total.placement
    total = total.sqrt() if norm_type == 2 else total
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for g in grads:
        c = coef if g.placement == home else coef.to_global(placement=g.placement, sbp=_broadcast(g.placement))
        g.mul_(c.to(g.dtype))
    return total
