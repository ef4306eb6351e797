"""Global-norm gradient clipping that is right for any mix of layouts.

Written with global-tensor ops, so the layouts decide the communication:
a split gradient's squared sum is a partial sum over its shards (one small
all-reduce), a broadcast gradient's is counted once, and a partial gradient
is first reduced (reduce-scatter to a split, cheaper than an all-reduce)
before squaring. Gradients on different placements (pipeline stages) send
their scalar to the first gradient's placement.
"""
from __future__ import annotations

import torch

from .global_tensor import GlobalTensor
from .sbp import Broadcast, Split


def _broadcast(placement) -> tuple:
    return tuple(Broadcast() for _ in placement.shape)


def _without_partial(g: GlobalTensor) -> GlobalTensor:
    """Reduce partial axes to a split of the largest dim (or ``B`` for a scalar)."""
    if not any(s.is_partial for s in g.sbp):
        return g
    to = Split(max(range(g.dim()), key=lambda d: g.shape[d])) if g.dim() else Broadcast()
    return g.to_global(sbp=tuple(to if s.is_partial else s for s in g.sbp))


@torch.no_grad()
def clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2.0) -> GlobalTensor:
    """Scale gradients in place so their global ``norm_type``-norm is at most ``max_norm``.

    Returns the total norm before clipping, broadcast on the first gradient's placement.
    ``norm_type`` is 2 or ``inf``.
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
        g = _without_partial(g).float()
        term = g.pow(2).sum() if norm_type == 2 else g.abs().amax()
        if term.placement != home:
            term = term.to_global(placement=home, sbp=_broadcast(home))
        if total is None:
            total = term
        else:
            total = total + term if norm_type == 2 else torch.maximum(total, term)
    total = total.sqrt() if norm_type == 2 else total
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for g in grads:
        c = coef if g.placement == home else coef.to_global(placement=g.placement, sbp=_broadcast(g.placement))
        g.mul_(c.to(g.dtype))
    return total
