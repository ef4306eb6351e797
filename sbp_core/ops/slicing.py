"""Slices, selects, pads and triangular masks: ops that cut or pad along dims.

On one mesh axis, best first (``P(op) -> P(op)`` pass-through only for inputs
partial on the axis):

- ``slice.Tensor``: ``S(i)`` on another dim stays; ``S`` on the sliced dim
  stays only when the slice is the whole dim with step 1 (any other slice
  needs rows from other ranks, so the dispatcher boxes). All partial ops pass.
- ``select.int``: ``S(i)`` on another dim shifts past the removed dim.
- ``slice_backward``/``select_backward`` (zeros with the gradient written
  in): the gradient's ``S(i)`` on a dim other than the sliced/selected one
  stays (runs with this rank's local size); partial passes (the zero fill is
  a zero in every term, so sum, max and min are exact).
- ``constant_pad_nd``: ``S`` on an unpadded dim stays; ``P(max)``/``P(min)``
  pass for any fill value (every term holds it), ``P(sum)`` only for 0.
- ``tril``/``triu``: every split stays; a rank whose rows start at ``r0``
  and columns at ``c0`` masks its shard with diagonal ``k + r0 - c0``.
  Partial passes (masked entries are 0 in every term).
- ``masked_fill.Tensor`` (value given as a tensor) follows the element-wise
  rule, like ``masked_fill.Scalar``.
- ``flip`` (``cumsum``'s backward) and ``roll``: ``S`` on a dim not flipped
  or rolled stays; partial passes (a permutation of the entries). A flipped
  or rolled split dim is boxed first, and so is every split for a roll of
  the flattened tensor.
- ``repeat``: ``S`` on a dim repeated once stays (on its index among the
  output's dims); partial passes (each term is repeated alike).
- ``diagonal``/``diagonal_copy`` (``torch.diag`` of a matrix, ``einsum("ii->i")``)
  and their backward ``diagonal_backward``: ``S`` on a dim other than the two
  the diagonal runs across stays, on its index among the others (the output
  puts the diagonal last); partial passes (entries are picked, or zeros
  filled in). A split diagonal dim is boxed first: its shards' diagonals are
  not ``tensor_split`` pieces of the global one.
- ``diag_embed`` (``torch.diag`` of a vector): the reverse, ``S`` on a dim
  other than the last stays, on its index among the output's other dims.
"""
from __future__ import annotations

import torch

from ..layout import local_box
from ..sbp import Partial, Split
from .common import B
from .per_axis import axis_of, sized_local
from .pointwise import pointwise
from .registry import Sig, register
from .views import passthrough

aten = torch.ops.aten

register(aten.masked_fill.Tensor)(pointwise)


def _whole(size: int, start, end, step) -> bool:
    start = 0 if start is None else start + size if start < 0 else start
    end = size if end is None else end + size if end < 0 else end
    return step == 1 and start <= 0 and end >= size


def _keep_others(ax, nd: int, cut: int, shift: int, keep_cut: bool = False) -> list:
    """``B``, ``S(i) -> S(i ± shift)`` for ``i != cut`` (``S(cut)`` too when ``keep_cut``), partial."""
    sigs = [Sig((B,), (B,))]
    for i in range(nd):
        if i != cut or keep_cut:
            sigs.append(Sig((Split(i),), (Split(i + shift if i > cut else i),)))
    return sigs + passthrough(ax, 0)


@register(aten.slice.Tensor)
def slice_(call):
    ax = axis_of(call)
    shape = call.metas[0].shape
    dim = call.arg(1, "dim", 0) % len(shape)
    whole = _whole(shape[dim], call.arg(2, "start"), call.arg(3, "end"), call.arg(4, "step", 1))
    return _keep_others(ax, len(shape), dim, 0, keep_cut=whole)


@register(aten.select.int)
def select(call):
    ax = axis_of(call)
    nd = call.metas[0].ndim
    return _keep_others(ax, nd, call.arg(1, "dim") % nd, -1)


def _moved_along(call, dims) -> list:
    """``B``; ``S(i) -> S(i)`` for each dim ``i`` the op does not move entries along; partial passes."""
    nd = call.metas[0].ndim
    moved = {d % nd for d in dims}
    kept = [Sig((Split(i),), (Split(i),)) for i in range(nd) if i not in moved]
    return [Sig((B,), (B,))] + kept + passthrough(axis_of(call), 0)


@register(aten.flip.default)
def flip(call):
    return _moved_along(call, call.arg(1, "dims"))


@register(aten.roll.default)
def roll(call):
    dims = call.arg(2, "dims", [])
    return _moved_along(call, dims or range(call.metas[0].ndim))  # no dims: the flattened tensor rolls


@register(aten.repeat.default)
def repeat(call):
    ax = axis_of(call)
    nd = call.metas[0].ndim
    repeats = list(call.arg(1, "repeats"))
    lead = len(repeats) - nd
    kept = [Sig((Split(i),), (Split(i + lead),)) for i in range(nd) if repeats[i + lead] == 1]
    return [Sig((B,), (B,))] + kept + passthrough(ax, 0)


@register(aten.slice_backward.default, local=sized_local)
def slice_backward(call):
    ax = axis_of(call)
    sizes = call.arg(1, "input_sizes")
    dim = call.arg(2, "dim") % len(sizes)
    whole = call.metas[0].shape[dim] == sizes[dim]
    return _keep_others(ax, len(sizes), dim, 0, keep_cut=whole and call.arg(5, "step") == 1)


@register(aten.select_backward.default, local=sized_local)
def select_backward(call):
    ax = axis_of(call)
    sizes = call.arg(1, "input_sizes")
    dim = call.arg(2, "dim") % len(sizes)
    # The gradient lacks ``dim``: its dim i is the output's i + (i >= dim).
    sigs = [Sig((B,), (B,))]
    sigs += [Sig((Split(i),), (Split(i + (i >= dim)),)) for i in range(len(sizes) - 1)]
    return sigs + passthrough(ax, 0)


@register(aten.constant_pad_nd.default)
def constant_pad_nd(call):
    ax = axis_of(call)
    nd = call.metas[0].ndim
    pad = call.arg(1, "pad")
    value = call.arg(2, "value", 0)
    padded = {nd - 1 - k // 2 for k, n in enumerate(pad) if n != 0}
    sigs = [Sig((B,), (B,))] + [Sig((Split(i),), (Split(i),)) for i in range(nd) if i not in padded]
    ops = [op for op in ax.partial_ops(0) if op != "sum" or value == 0]
    return sigs + [Sig((Partial(op),), (Partial(op),)) for op in ops]


def _triangle_local(func, args, kwargs, ctx):
    lay = ctx.in_layouts[0]
    box = local_box(lay.shape, lay.placement.shape, lay.sbp, ctx.coords)
    diagonal = args[1] if len(args) > 1 else kwargs.get("diagonal", 0)
    return func(args[0], diagonal + box[-2][0] - box[-1][0])


@register(aten.tril.default, aten.triu.default, local=_triangle_local)
def triangle(call):
    ax = axis_of(call)
    nd = call.metas[0].ndim
    return [Sig((B,), (B,))] + [Sig((Split(i),), (Split(i),)) for i in range(nd)] + passthrough(ax, 0)


def _diagonal_dims(nd: int, dim1: int, dim2: int) -> list:
    """The dims of an ``nd``-dim tensor other than the diagonal's two, in order (the output's leading dims)."""
    across = {dim1 % nd, dim2 % nd}
    return [i for i in range(nd) if i not in across]


def _across_diagonal(ax, others: list, leading_to_full: bool) -> list:
    """``B``; ``S`` between a dim in ``others`` and its index among them; partial passes."""
    sigs = [Sig((B,), (B,))]
    for k, i in enumerate(others):
        sigs.append(Sig((Split(k),), (Split(i),)) if leading_to_full else Sig((Split(i),), (Split(k),)))
    return sigs + passthrough(ax, 0)


@register(aten.diagonal.default, aten.diagonal_copy.default)
def diagonal(call):
    nd = call.metas[0].ndim
    others = _diagonal_dims(nd, call.arg(2, "dim1", 0), call.arg(3, "dim2", 1))
    return _across_diagonal(axis_of(call), others, leading_to_full=False)


@register(aten.diagonal_backward.default, local=sized_local)
def diagonal_backward(call):
    nd = len(call.arg(1, "input_sizes"))
    others = _diagonal_dims(nd, call.arg(3, "dim1"), call.arg(4, "dim2"))
    return _across_diagonal(axis_of(call), others, leading_to_full=True)


@register(aten.diag_embed.default)
def diag_embed(call):
    nd = call.metas[0].ndim + 1
    others = _diagonal_dims(nd, call.arg(2, "dim1", -2), call.arg(3, "dim2", -1))
    return _across_diagonal(axis_of(call), others, leading_to_full=True)
