"""Joining and splitting along a dim: ``cat``, ``stack``, ``split``, ``split_with_sizes``, ``unbind``.

The joined or split dim needs the whole dim on each rank (``tensor_split``
pieces of a concatenation are not the concatenation of pieces), so a split
on it is never offered and the dispatcher boxes. On one mesh axis, best first:

- ``cat(tensors, dim)``: all ``B`` -> ``B``; all ``S(i)``, ``i != dim`` ->
  ``S(i)`` (inputs agree in size on ``i``; legacy 1-d empty inputs stay ``B``);
  all ``P(op)`` -> ``P(op)`` when some input is partial on the axis
  (concatenated terms are terms of the concatenation).
- ``stack(tensors, dim)``: ``S(i)`` -> ``S`` on ``i`` shifted past the new dim.
- ``split.Tensor``/``split_with_sizes`` (``chunk`` decomposes to
  ``split``): ``S(i)``, ``i != dim`` -> every piece ``S(i)``; ``B``; partial.
  Their backward is ``cat`` along the same dim.
- ``unbind.int``: ``S(i)`` -> every slice ``S`` on ``i`` shifted past the
  removed dim. Its backward is ``stack``.
"""
from __future__ import annotations

import torch

from ..sbp import Partial, Split
from .common import B
from .per_axis import axis_of
from .registry import Sig, register

aten = torch.ops.aten


def _joined(ax, metas, mapping: dict, n_out: int = 1) -> list:
    """Inputs all ``B``/``S(i)``/``P(op)`` -> outputs ``B``/``S(mapping[i])``/``P(op)``."""
    n_in = len(metas)
    sigs = [Sig((B,) * n_in, (B,) * n_out)]
    sigs += [Sig((Split(i),) * n_in, (Split(o),) * n_out) for i, o in mapping.items()]
    ops = ax.partial_ops(*range(n_in))
    return sigs + [Sig((Partial(op),) * n_in, (Partial(op),) * n_out) for op in ops]


@register(aten.cat.default)
def cat(call):
    ax = axis_of(call)
    metas = call.metas
    real = [m for m in metas if not (m.ndim == 1 and m.shape[0] == 0)] or metas
    nd = real[0].ndim
    dim = call.arg(1, "dim", 0) % max(nd, 1)
    legacy = [m.ndim != nd for m in metas]
    sigs = [Sig((B,) * len(metas), (B,))]
    for i in range(nd):
        if i != dim:
            sigs.append(Sig(tuple(B if old else Split(i) for old in legacy), (Split(i),)))
    ops = ax.partial_ops(*range(len(metas)))
    return sigs + [Sig((Partial(op),) * len(metas), (Partial(op),)) for op in ops]


@register(aten.stack.default)
def stack(call):
    ax = axis_of(call)
    nd = call.metas[0].ndim
    dim = call.arg(1, "dim", 0) % (nd + 1)
    return _joined(ax, call.metas, {i: i + (i >= dim) for i in range(nd)})


def _pieces(call) -> int:
    """How many tensors the split returns (counted on a meta tensor)."""
    x = torch.empty(call.metas[0].shape, device="meta")
    return len(call.func(x, *call.args[1:], **call.kwargs))


@register(aten.split.Tensor, aten.split_with_sizes.default)
def split(call):
    ax = axis_of(call)
    nd = call.metas[0].ndim
    dim = call.arg(2, "dim", 0) % max(nd, 1)
    return _joined(ax, call.metas, {i: i for i in range(nd) if i != dim}, _pieces(call))


@register(aten.unbind.int)
def unbind(call):
    ax = axis_of(call)
    nd = call.metas[0].ndim
    dim = call.arg(1, "dim", 0) % nd
    return _joined(ax, call.metas, {i: i - (i > dim) for i in range(nd) if i != dim}, call.metas[0].shape[dim])
