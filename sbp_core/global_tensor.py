"""The global tensor: a ``torch.Tensor`` wrapper holding ``(local, layout)``.

Its shape, dtype and device are the global tensor's; the data lives in the
rank's ``local`` shard (an empty tensor on ranks outside the placement). Op
dispatch with SBP signature rules is layered on ``__torch_dispatch__``; ops
without a rule raise ``NoSbpRule`` naming the op and the input layouts, never
a silently wrong value.

This module is the type alone, below everything that computes with it: the
dispatcher (``sbp_core.dispatch``) sets ``__torch_dispatch__`` and the
boxing (``sbp_core.boxing.methods``) sets ``to_local``, ``to_global`` and
``full_tensor`` on the class when they are imported (``import sbp_core``
imports both), so no module imports one that imports it back.
"""
from __future__ import annotations

import torch

from .layout import Layout, strides_in_order
from .sbp import format_sbp


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

    # -- moving between layouts (differentiable): ``to_local``, ``to_global``, ``full_tensor`` ----------
    # defined with the boxing they run, in ``sbp_core.boxing.methods``, which sets them on this class.

    # -- dispatch -----------------------------------------------------------
    # ``__torch_dispatch__`` is ``sbp_core.dispatch.dispatch`` itself (set there, a staticmethod):
    # one Python frame per op, not two, and no bound method object per op.


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
