"""``GlobalTensor``'s boxing methods: ``to_local``, ``to_global`` and ``full_tensor``, set on the class here.

They live with the boxing they run (``planned`` steps; the differentiable
``Boxing`` and ``ToLocal``), so ``sbp_core.global_tensor`` is the type
alone and imports none of this; ``import sbp_core`` imports this module.
"""
from __future__ import annotations

import torch

from ..global_tensor import GlobalTensor, _global_strides, _make_wrapper, _strided
from ..layout import Layout
from ..process_groups import on_forget_groups
from ..sbp import Broadcast, nd_sbp
from . import planned
from .autograd import Boxing, ToLocal

# (layout, placement arg, sbp arg) -> (the layout to_global boxes to, the planned boxing steps)
_targets: dict = {}
on_forget_groups(_targets.clear)  # the steps hold process groups


def _target(src: Layout, placement, sbp) -> tuple:
    """Validate ``to_global``'s arguments once per (layout, arguments); cache the destination and its steps."""
    pl = src.placement if placement is None else placement
    dst = Layout(pl, src.sbp if sbp is None else nd_sbp(sbp, pl.ndim), src.shape, src.dtype)
    entry = (dst, planned(src, dst))
    try:
        if len(_targets) >= 1 << 14:
            _targets.clear()
        _targets[(src, placement, sbp)] = entry
    except TypeError:
        pass
    return entry


def to_local(self) -> torch.Tensor:
    """This rank's shard; its gradient is taken to be laid out as ``sbp`` with partial as ``B``."""
    return ToLocal.apply(self)


def to_global(self, placement=None, sbp=None) -> GlobalTensor:
    """Box to ``sbp`` on ``placement`` (either defaults to the current one)."""
    src = self._layout
    try:
        dst, steps = _targets[(src, placement, sbp)]
    except (KeyError, TypeError):  # TypeError: an unhashable sbp (a list)
        dst, steps = _target(src, placement, sbp)
    if self.requires_grad and torch.is_grad_enabled():
        return Boxing.apply(self, dst)
    # box(...) and wrap(...) inlined: a local-only boxing (B -> S is a view) is mostly this call's frames.
    local = self._local
    for step in steps:
        local = step(local)
    # Dense strides go as None (the constructor derives them; cheaper than parsing a tuple).
    strides = None if local.is_contiguous() else _global_strides(dst.shape, local)
    out = _make_wrapper(GlobalTensor, dst.shape, strides, None, None, dst.dtype, _strided, local.device)
    out._local = local
    out._layout = dst
    return out


def full_tensor(self) -> torch.Tensor:
    """The whole global tensor on every member rank (all-gather / all-reduce as needed)."""
    return self.to_global(sbp=tuple(Broadcast() for _ in self.sbp)).to_local()


GlobalTensor.to_local = to_local
GlobalTensor.to_global = to_global
GlobalTensor.full_tensor = full_tensor
