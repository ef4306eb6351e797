"""Ops indexed by a tensor: ``index``, ``index_put``, ``gather``, ``scatter``, ``index_select``, ``index_add``.

Index tensors are global tensors (or 0-d local ones); they are never
partial. On one mesh axis, best first (``P -> P`` pass-through only when an
input is partial on the axis):

- ``index.Tensor`` (``x[i]``, ``x[:, i]``): ``B`` everywhere -> ``B``;
  ``S`` on a dim no index tensor indexes, indices ``B`` -> ``S`` on where that
  dim lands; ``self`` ``B``, indices ``S`` along one dim of their broadcast
  shape -> ``S`` on where that dim lands; ``P(op)`` self with ``B`` indices.
  Boolean masks have data-dependent shapes and are refused by the meta run.
- ``index_put`` (``x[i] = v``; the backward of ``index``): ``S`` on an
  unindexed dim with ``values`` split alike; with ``accumulate=True``, split
  indices and values on a partial-sum ``self`` -> ``P(sum)`` (each rank adds
  its part); partial ``self`` and ``values`` pass.
- ``gather(self, dim, index)``: ``S(d), S(d) -> S(d)`` for ``d != dim`` when
  both have the same size there; ``B, S(dim) -> S(dim)``; ``S(dim), B ->
  P(sum)``: a rank gathers only the entries whose index falls in its shard
  and puts 0 elsewhere (vocab-parallel style); partial ``self`` passes.
- ``scatter_add``/``scatter`` (``gather``'s backward is ``scatter_add`` into
  ``new_zeros``): ``S(d)`` on ``self``, ``index``, ``src`` for ``d != dim``
  (same sizes); ``scatter_add`` with ``P`` self and ``index``/``src`` split
  along ``dim`` -> ``P(sum)``; partial pass-through (``scatter`` with a scalar:
  ``P(sum)`` only for 0).
- ``index_select(self, dim, index)``: like ``gather`` with a 1-d index
  (``S(d)`` for ``d != dim``; ``B, S(0) -> S(dim)``; ``S(dim), B -> P(sum)``).
- ``index_add(self, dim, index, source)`` (``index_select``'s backward):
  ``S(d)`` on ``self`` and ``source``; ``P, S(0), S(dim) -> P(sum)``.

In-place forms (``index_put_``, ``scatter_``, ``scatter_add_``,
``index_add_``) share the rules; the dispatcher keeps ``self``'s layout.
"""
from __future__ import annotations

import torch

from ..layout import local_box
from ..sbp import Partial, Split
from .common import B, P
from .per_axis import axis_of, local_out_shape
from .registry import Sig, TensorMeta, register

aten = torch.ops.aten


def _partial_sigs(ops, pattern) -> list:
    """One signature per op: ``pattern`` with ``"P"`` replaced by ``P(op)``."""
    return [Sig(tuple(Partial(op) if s == "P" else s for s in pattern), (Partial(op),)) for op in ops]


class _Indexing:
    """Where ``self[indices]`` puts each dim: unindexed ``self`` dims and broadcast index dims."""

    def __init__(self, ndim: int, indices):
        self.tensors = [(d, t) for d, t in enumerate(indices) if t is not None]
        self.globals = [t for _, t in self.tensors if isinstance(t, TensorMeta)]
        dims = [d for d, _ in self.tensors]
        self.indexed = set(dims)
        self.shape = tuple(torch.broadcast_shapes(*(tuple(t.shape) for _, t in self.tensors)))
        adjacent = dims == list(range(dims[0], dims[-1] + 1))
        self.first = dims[0] if adjacent else 0
        nb = len(self.shape)
        self.out_of_self = {}
        for d in range(ndim):
            if d not in self.indexed:
                self.out_of_self[d] = (d if d < dims[0] else d - len(dims) + nb) if adjacent else (
                    nb + sum(1 for e in range(d) if e not in self.indexed))

    def result_shape(self, shape) -> list:
        out = [0] * (len(self.shape) + len(self.out_of_self))
        for d, o in self.out_of_self.items():
            out[o] = shape[d]
        out[self.first:self.first + len(self.shape)] = self.shape
        return out

    def index_splits(self):
        """``(output dim, per-global-index SBP)`` for each broadcast index dim that can be split."""
        nb = len(self.shape)
        for k in range(nb):
            if self.shape[k] == 1:
                continue
            per = []
            for t in self.globals:
                j = k - (nb - t.ndim)
                per.append(Split(j) if j >= 0 and t.shape[j] == self.shape[k] else B)
            yield self.first + k, tuple(per)


@register(aten.index.Tensor)
def index(call):
    ax = axis_of(call)
    m = call.metas[0]
    ix = _Indexing(m.ndim, call.arg(1, "indices"))
    bs = (B,) * len(ix.globals)
    sigs = [Sig((B,) + bs, (B,))]
    sigs += [Sig((Split(d),) + bs, (Split(o),)) for d, o in ix.out_of_self.items()]
    sigs += [Sig((B,) + per, (Split(o),)) for o, per in ix.index_splits()]
    return sigs + [Sig((Partial(op),) + bs, (Partial(op),)) for op in ax.partial_ops(0)]


def _value_sbp(values, result_shape, out_dim: int):
    """The SBP ``values`` (broadcast to ``result_shape``) needs for the result split on ``out_dim``."""
    j = out_dim - (len(result_shape) - values.ndim)
    return Split(j) if j >= 0 and values.shape[j] == result_shape[out_dim] > 1 else B


@register(aten.index_put.default, aten.index_put_.default)
def index_put(call):
    ax = axis_of(call)
    m = call.metas[0]
    values = call.arg(2, "values")
    accumulate = call.arg(3, "accumulate", False)
    ix = _Indexing(m.ndim, call.arg(1, "indices"))
    vglobal = isinstance(values, TensorMeta)
    bs = (B,) * len(ix.globals)
    vb = (B,) if vglobal else ()
    result = ix.result_shape(m.shape)
    sigs = [Sig((B,) + bs + vb, (B,))]
    for d, o in ix.out_of_self.items():
        v = (_value_sbp(values, result, o),) if vglobal else ()
        sigs.append(Sig((Split(d),) + bs + v, (Split(d),)))
    if accumulate and vglobal:
        sigs += [Sig((P,) + per + (_value_sbp(values, result, o),), (P,)) for o, per in ix.index_splits()]
    if vglobal:
        ops = ax.partial_ops(0, len(call.metas) - 1)
        sigs += _partial_sigs([op for op in ops if op == "sum" or not accumulate], ("P",) + bs + ("P",))
    return sigs


def _masked_take(func, args, kwargs, ctx):
    """``gather``/``index_select`` on a shard of ``self`` split along ``dim``.

    Indices outside this rank's rows ``[start, start + n)`` take 0, so the
    ranks' results are partial sums of the global one.
    """
    lay = ctx.in_layouts[0]
    if len(lay.shape) == 0:
        return func(*args, **kwargs)
    x, dim, idx = args[0], args[1] % len(lay.shape), args[2]
    start, n = local_box(lay.shape, lay.placement.shape, lay.sbp, ctx.coords)[dim]
    if n == lay.shape[dim]:
        return func(*args, **kwargs)
    if n == 0:
        return x.new_zeros(local_out_shape(ctx))
    idx = idx - start
    outside = (idx < 0) | (idx >= n)
    out = func(x, dim, idx.masked_fill(outside, 0), *args[3:], **kwargs)
    if func is aten.index_select.default:
        outside = outside.reshape([-1 if d == dim else 1 for d in range(out.dim())])
    return out.masked_fill(outside, 0)


@register(aten.gather.default, local=_masked_take)
def gather(call):
    ax = axis_of(call)
    x, index = call.metas[0], call.metas[1]
    dim = call.arg(1, "dim") % max(x.ndim, 1)
    sigs = [Sig((B, B), (B,))]
    sigs += [Sig((Split(d), Split(d)), (Split(d),)) for d in range(x.ndim) if d != dim and x.shape[d] == index.shape[d]]
    if x.ndim:
        sigs.append(Sig((B, Split(dim)), (Split(dim),)))
        if x.dtype != torch.bool:
            sigs.append(Sig((Split(dim), B), (P,)))
    return sigs + _partial_sigs(ax.partial_ops(0), ("P", B))


@register(aten.index_select.default, local=_masked_take)
def index_select(call):
    ax = axis_of(call)
    x, index = call.metas[0], call.metas[1]
    dim = call.arg(1, "dim") % max(x.ndim, 1)
    sigs = [Sig((B, B), (B,))] + [Sig((Split(d), B), (Split(d),)) for d in range(x.ndim) if d != dim]
    if x.ndim and index.ndim == 1:
        sigs.append(Sig((B, Split(0)), (Split(dim),)))
    if x.ndim and x.dtype != torch.bool:
        sigs.append(Sig((Split(dim), B), (P,)))
    return sigs + _partial_sigs(ax.partial_ops(0), ("P", B))


def _scatter_rule(accumulate: bool):
    def rule(call):
        ax = axis_of(call)
        x, index = call.metas[0], call.metas[1]
        src = call.metas[2] if len(call.metas) > 2 else None
        dim = call.arg(1, "dim") % max(x.ndim, 1)
        tail = (B,) if src else ()
        sigs = [Sig((B, B) + tail, (B,))]
        for d in range(x.ndim):
            if d != dim and x.shape[d] == index.shape[d] and (src is None or src.shape[d] == index.shape[d]):
                sigs.append(Sig((Split(d), Split(d)) + ((Split(d),) if src else ()), (Split(d),)))
        if accumulate and x.ndim and index.shape[dim] == src.shape[dim]:
            sigs.append(Sig((P, Split(dim), Split(dim)), (P,)))
        if src is not None:
            ops = ax.partial_ops(0, 2)
            if accumulate:
                ops = [op for op in ops if op == "sum"]
            return sigs + _partial_sigs(ops, ("P", B, "P"))
        value = call.arg(3, "value")
        return sigs + _partial_sigs([op for op in ax.partial_ops(0) if op != "sum" or value == 0], ("P", B))

    return rule


register(aten.scatter_add.default, aten.scatter_add_.default)(_scatter_rule(True))
register(aten.scatter.src, aten.scatter_.src, aten.scatter.value, aten.scatter_.value)(_scatter_rule(False))


@register(aten.index_add.default, aten.index_add_.default)
def index_add(call):
    ax = axis_of(call)
    x = call.metas[0]
    dim = call.arg(1, "dim") % max(x.ndim, 1)
    sigs = [Sig((B, B, B), (B,))] + [Sig((Split(d), B, Split(d)), (Split(d),)) for d in range(x.ndim) if d != dim]
    if x.ndim and call.metas[1].ndim == 1:
        sigs.append(Sig((P, Split(0), Split(dim)), (P,)))
    return sigs + _partial_sigs([op for op in ax.partial_ops(0, 2) if op == "sum"], ("P", B, "P"))
