"""The global tensor: a ``torch.Tensor`` wrapper holding ``(local, layout)``.

Its shape, dtype and device are the global tensor's; the data lives in the
rank's ``local`` shard (an empty tensor on ranks outside the placement). Op
dispatch with SBP signature rules is layered on ``__torch_dispatch__``; ops
without a rule raise ``NoSbpRule`` naming the op and the input layouts, never
a silently wrong value.
"""
from __future__ import annotations

import torch

from .layout import Layout, strides_in_order
from .process_groups import on_forget_groups
from .sbp import format_sbp, nd_sbp


class NoSbpRule(NotImplementedError):
    """An op was called on global tensors and no SBP signature rule covers it."""


def _global_strides(shape, local: torch.Tensor) -> tuple:
    """Dense strides for ``shape`` in the dim order of ``local``'s memory layout.

    The wrapper reports strides like the local's, so ``is_contiguous`` and
    ``.contiguous()`` on the global tensor mean what they mean for its shards.
    """
    if local.dim() != len(shape) or local.is_contiguous():
        return strides_in_order(shape, range(len(shape)))
    order = sorted(range(len(shape)), key=lambda d: (local.stride(d), local.shape[d]), reverse=True)
    return strides_in_order(shape, order)


class GlobalTensor(torch.Tensor):
    # Slots: the dispatcher sets both on every output, and a slot store skips creating
    # the instance __dict__ (other attributes, e.g. nn.Parameter's, still go there).
    __slots__ = ("_local", "_layout")
    _local: torch.Tensor
    _layout: Layout

    # Everything happens below autograd in __torch_dispatch__; skipping the
    # __torch_function__ layer saves a Python call per op (as DTensor does).
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, local: torch.Tensor, layout: Layout, requires_grad: bool = False, strides=None):
        if strides is None:
            strides = layout.strides if local.is_contiguous() else _global_strides(layout.shape, local)
        out = torch.Tensor._make_wrapper_subclass(
            cls,
            layout.shape,
            strides=strides,
            dtype=layout.dtype,
            device=local.device,
            requires_grad=requires_grad,
        )
        out._local = local
        out._layout = layout
        return out

    # -- layout -----------------------------------------------------------
    @property
    def placement(self):
        return self._layout.placement

    @property
    def sbp(self) -> tuple:
        return self._layout.sbp

    @property
    def layout(self) -> Layout:
        return self._layout

    def __repr__(self, *, tensor_contents=None):
        return (
            f"GlobalTensor(shape={tuple(self.shape)}, dtype={self.dtype}, sbp={format_sbp(self.sbp)}, "
            f"{self.placement}, local={self._local})"
        )

    # -- moving between layouts (differentiable) -----------------------------
    def to_local(self) -> torch.Tensor:
        """This rank's shard; its gradient is taken to be laid out as ``sbp`` with partial as ``B``."""
        return _ToLocal.apply(self)

    def to_global(self, placement=None, sbp=None) -> "GlobalTensor":
        """Box to ``sbp`` on ``placement`` (either defaults to the current one)."""
        src = self._layout
        try:
            dst, steps = _targets[(src, placement, sbp)]
        except (KeyError, TypeError):  # TypeError: an unhashable sbp (a list)
            dst, steps = _target(src, placement, sbp)
        if self.requires_grad and torch.is_grad_enabled():
            return _Boxing.apply(self, dst)
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
        from .sbp import Broadcast

        return self.to_global(sbp=tuple(Broadcast() for _ in self.sbp)).to_local()

    # -- dispatch -----------------------------------------------------------
    # ``__torch_dispatch__`` is ``sbp_core.dispatch.dispatch`` itself (set below, a staticmethod):
    # one Python frame per op, not two, and no bound method object per op.


# (layout, placement arg, sbp arg) -> (the layout to_global boxes to, the planned boxing steps)
_targets: dict = {}
on_forget_groups(_targets.clear)  # the steps hold process groups


def _target(src: Layout, placement, sbp) -> tuple:
    """Validate ``to_global``'s arguments once per (layout, arguments); cache the destination and its steps."""
    pl = src.placement if placement is None else placement
    dst = Layout(pl, src.sbp if sbp is None else nd_sbp(sbp, pl.ndim), src.shape, src.dtype)
    entry = (dst, _planned(src, dst))
    try:
        if len(_targets) >= 1 << 14:
            _targets.clear()
        _targets[(src, placement, sbp)] = entry
    except TypeError:
        pass
    return entry


_make_wrapper = torch.Tensor._make_wrapper_subclass
_strided = torch.strided


def wrap(local: torch.Tensor, layout: Layout, strides) -> GlobalTensor:
    """``GlobalTensor(local, layout, strides=strides)`` for the dispatcher's outputs (no gradient:
    autograd attaches one to op outputs itself). Arguments are positional, (size, strides,
    storage_offset, memory_format, dtype, layout, device): keywords cost 2.7k instructions a call."""
    out = _make_wrapper(GlobalTensor, layout.shape, strides, None, None, layout.dtype, _strided, local.device)
    out._local = local
    out._layout = layout
    return out


from .dispatch import dispatch as _dispatch  # noqa: E402  (dispatch needs GlobalTensor defined)

GlobalTensor.__torch_dispatch__ = staticmethod(_dispatch)

# Bound once here rather than imported inside ``to_global``: an import statement in a
# function costs two importlib frames per call (boxing imports this module, so not at the top).
from .boxing import planned as _planned  # noqa: E402
from .boxing.autograd import Boxing as _Boxing, ToLocal as _ToLocal  # noqa: E402
