"""Reductions over dims: a sum over a split dim leaves a partial sum.

- ``sum``/``mean``: ``S(d)`` on a reduced dim -> ``P(sum)``; ``S(d)`` on a
  kept dim -> ``S`` on its new index; ``B -> B``; ``P(sum) -> P(sum)``.
  ``mean`` runs locally as a sum divided by the *global* count, so shards
  of uneven size stay exact.
- ``amax``/``amin``: a reduced split dim -> ``P(max)``/``P(min)``; partial
  max stays partial max.
"""
from __future__ import annotations

import math

import torch

from ..sbp import Split
from .common import B, P, PMAX, PMIN
from .registry import Call, Sig, register

aten = torch.ops.aten


def _reduced_dims(call, ndim: int) -> tuple:
    dims = call.arg(1, "dim", None)
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return tuple(range(ndim))
    if isinstance(dims, int):
        dims = [dims]
    return tuple(sorted(d % ndim for d in dims)) if ndim else ()


def _keepdim(call) -> bool:
    if call.func in (aten.sum.default, aten.mean.default):
        return False
    return bool(call.arg(2, "keepdim", False))


def _rule(partial):
    def rule(call):
        m = call.metas[0]
        dims = _reduced_dims(call, m.ndim)
        keep = _keepdim(call)
        sigs = [Sig((B,), (B,)), Sig((partial,), (partial,))]
        for d in range(m.ndim):
            if d in dims:
                sigs.append(Sig((Split(d),), (partial,)))
            else:
                new = d if keep else d - sum(1 for r in dims if r < d)
                sigs.append(Sig((Split(d),), (Split(new),)))
        return sigs

    return rule


register(aten.sum.default, aten.sum.dim_IntList)(_rule(P))
register(aten.amax.default)(_rule(PMAX))
register(aten.amin.default)(_rule(PMIN))


def _mean_local(func, args, kwargs, ctx):
    x = args[0]
    layout = ctx.in_layouts[0]
    call = Call(func, args, kwargs, [])
    dims = _reduced_dims(call, x.dim())
    count = math.prod(layout.shape[d] for d in dims)
    keep = _keepdim(call)
    dtype = call.arg(3, "dtype", None)
    total = torch.sum(x, dim=list(dims), keepdim=keep, dtype=dtype)
    return total / count


register(aten.mean.default, aten.mean.dim, local=_mean_local)(_rule(P))
