"""Differentiable boxing: ``to_global``, ``to_local`` and layout changes in autograd.

The gradient of a boxing is the gradient boxed back, from the layout it
actually arrives in to the gradient layout of the input:

- input ``S(d)``: ``S(d)`` (from ``B`` a slice, from ``P`` a reduce-scatter);
- input ``B``: kept lazy: ``P(sum)`` when the gradient arrives split or
  partial on that axis (a slice's gradient pads with zeros, no traffic),
  ``B`` when it arrives broadcast; across placements always ``P(sum)`` (the
  cheaper transfer);
- input ``P(sum)``: ``B`` (every term's gradient is the whole gradient);
- input ``P(max)``/``P(min)``: ``P(sum)`` whose terms are the gradient
  masked to where the term attained the extremum, ties sharing equally
  (what ``torch.amax`` does), so the terms sum to the whole gradient.

A local leaf declared with ``to_global`` receives its gradient in the
layout it was declared with (partial as ``B``): its shard for ``S``, the
whole gradient for ``B``.
"""
from __future__ import annotations

import functools

import torch

from ..global_tensor import GlobalTensor
from ..layout import Layout
from ..process_groups import world_rank
from ..sbp import Broadcast, Partial
from . import box

_B = Broadcast()
_PSUM = Partial("sum")


def _extremum_axes(sbp) -> list:
    return [i for i, s in enumerate(sbp) if s.is_partial and s.op != "sum"]


@functools.lru_cache(maxsize=None)
def _has_extremum(sbp: tuple) -> bool:
    """Per (interned) N-d SBP, once: the forward of every boxing asks (a C-level cache hit)."""
    return bool(_extremum_axes(sbp))


def grad_sbp(src: Layout, grad: Layout) -> tuple:
    """Gradient layout for an input laid out as ``src`` (see the module docstring)."""
    same = src.placement == grad.placement
    out = []
    for i, a in enumerate(src.sbp):
        if a.is_split:
            out.append(a)
        elif a.is_broadcast:
            g = grad.sbp[i] if same else None
            lazy = g is None or g.is_split or (g.is_partial and g.op == "sum")
            out.append(_PSUM if lazy else _B)
        elif a.op == "sum":
            out.append(_B)
        else:
            out.append(_PSUM)
    return tuple(out)


def _replace(sbp, axes, value) -> tuple:
    return tuple(value if i in axes else s for i, s in enumerate(sbp))


def _boxed_grad(grad: GlobalTensor, src: Layout, x_local, target: tuple) -> torch.Tensor:
    """Local of the input's gradient laid out as ``target`` on ``src``'s placement."""
    ext = _extremum_axes(src.sbp)
    if not ext:
        return box(grad._local, grad.layout, src.with_sbp(target))
    if len({src.sbp[i].op for i in ext}) > 1 or any(s.is_partial and s.op == "sum" for s in src.sbp):
        raise ValueError(
            f"the gradient through {src.sbp}, which mixes partial reductions, is not defined: "
            "box it to B or S first"
        )
    g = box(grad._local, grad.layout, src.with_sbp(_replace(target, ext, _B)))
    if world_rank() not in src.placement:
        return g
    reduced = src.with_sbp(_replace(src.sbp, ext, _B))
    hit = (x_local == box(x_local, src, reduced)).to(g.dtype)
    count = box(
        hit,
        Layout(src.placement, _replace(src.sbp, ext, _PSUM), src.shape, g.dtype),
        Layout(src.placement, reduced.sbp, src.shape, g.dtype),
    )
    return g * hit / count


class Boxing(torch.autograd.Function):
    """``GlobalTensor -> GlobalTensor`` with the same value in another layout."""

    @staticmethod
    def forward(ctx, x: GlobalTensor, dst: Layout):
        src = x._layout
        ctx.src = src
        ctx.set_materialize_grads(False)
        ctx.x_local = x._local if _has_extremum(src.sbp) else None
        return GlobalTensor(box(x._local, src, dst), dst)

    @staticmethod
    def backward(ctx, grad):
        if grad is None:
            return None, None
        src = ctx.src
        target = grad_sbp(src, grad.layout)
        local = _boxed_grad(grad, src, ctx.x_local, target)
        return GlobalTensor(local, src.with_sbp(target)), None


class FromLocal(torch.autograd.Function):
    """Local shard -> ``GlobalTensor``; the leaf's gradient comes back in the declared layout."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, layout: Layout):
        ctx.layout = layout
        ctx.set_materialize_grads(False)
        ctx.x_local = local if _has_extremum(layout.sbp) else None
        return GlobalTensor(local.view_as(local), layout)

    @staticmethod
    def backward(ctx, grad):
        if grad is None:
            return None, None
        declared = ctx.layout
        target = tuple(_B if s.is_partial and s.op == "sum" else _PSUM if s.is_partial else s for s in declared.sbp)
        return _boxed_grad(grad, declared, ctx.x_local, target), None


class ToLocal(torch.autograd.Function):
    """``GlobalTensor -> `` this rank's shard (a view; no communication)."""

    @staticmethod
    def forward(ctx, x: GlobalTensor):
        ctx.layout = x._layout
        ctx.set_materialize_grads(False)
        return x._local.view_as(x._local)

    @staticmethod
    def backward(ctx, grad):
        if grad is None:
            return None
        layout = ctx.layout
        sbp = tuple(_B if s.is_partial else s for s in layout.sbp)
        return GlobalTensor(grad, layout.with_sbp(sbp))
