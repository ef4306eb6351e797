"""Reductions over dims: a sum over a split dim leaves a partial sum.

- ``sum``/``mean``: ``S(d)`` on a reduced dim -> ``P(sum)``; ``S(d)`` on a
  kept dim -> ``S`` on its new index; ``B -> B``; ``P(sum) -> P(sum)``.
  ``mean`` runs locally as a sum divided by the *global* count, so shards
  of uneven size stay exact.
- ``amax``/``amin`` and the whole-tensor ``max()``/``min()``: a reduced
  split dim -> ``P(max)``/``P(min)``; partial max stays partial max.
- ``any``/``all``: a reduced split dim -> ``P(max)``/``P(min)`` of the
  bool result (or, and); a kept split dim -> ``S`` on its new index. A
  partial input is boxed first: ``any`` of a sum is not the or of the terms'.
- ``argmax``/``argmin`` over ``dim``: a split kept dim -> ``S`` on its new
  index, else ``B -> B`` (an index over a split dim is global: the input is
  boxed, by an all-to-all where another dim can be split instead).
- ``cumsum`` along ``dim``: a split other dim -> ``S``; ``P(sum)`` stays
  ``P(sum)`` (a prefix sum is linear); along a split dim the input is boxed.
- ``max``/``min`` over ``dim`` (values and indices), ``topk``, ``sort``,
  ``median``/``nanmedian`` over ``dim``, ``kthvalue``, ``mode``: a split
  kept dim -> ``S``; ``B -> B``; a split reduced or sorted dim is boxed
  (an order statistic has no partial form). Their backward scatters into
  ``grad.new_zeros`` from torch 2.13; torch 2.11 scatters into a plain
  ``torch.zeros``, which the dispatcher refuses to mix with a global
  gradient (``sbp_core.torch_compat`` installs 2.13's kernel there).
  ``median()``/``nanmedian()`` of the whole tensor: ``B -> B``.
- ``logcumsumexp`` along ``dim``: a split other dim -> ``S``; along a split
  dim, or of a partial input (not linear), the input is boxed.
- ``count_nonzero``: a reduced split dim -> ``P(sum)``.
- No rule for ``prod``, ``cumprod``, ``cummax``/``cummin`` or ``trace``:
  their backward formulas (torch 2.13) build a plain ``ones``/``zeros``
  tensor, which the dispatcher refuses to mix with a global gradient; they
  raise ``NoSbpRule`` naming the op.
- ``var``/``std``/``logsumexp``: a split kept dim -> ``S``; over a split
  reduced dim they are *decomposed*. ``var``: the global mean (a ``P(sum)``
  row sum boxed to ``B``, divided by the global count), then the squared
  deviations summed to ``P(sum)`` (``std`` boxes that for its square root).
  ``logsumexp``: like log-softmax, the row max (``P(max)``) and exp-sum
  (``P(sum)``) each boxed to ``B``; infinite maxima shift by 0, as torch does.
- vector norms (``norm.ScalarOpt_dim``, what ``F.normalize`` reaches, and
  ``linalg_vector_norm``): ``S(d)`` on a kept dim -> ``S`` on its new index;
  ``B -> B`` (a partial input is boxed first: a norm is not linear). Over a
  split reduced dim the norm is *decomposed* into ``|x|^p`` summed to
  ``P(sum)`` then the ``1/p`` power (which boxes the partial sum: one
  reduction of the output's size); ``p = inf`` into ``|x|`` reduced by ``amax``. Their
  backward is autograd's element-wise formula.
"""
from __future__ import annotations

import math

import torch

from ..sbp import Split
from .common import B, P, PMAX, PMIN
from .loss import _row_stat
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


def _rule(partial, partial_in: bool = True):
    """Reduce over ``_reduced_dims``: a reduced split dim -> ``partial``; with ``partial_in``, a ``partial``
    input stays ``partial``."""

    def rule(call):
        m = call.metas[0]
        dims = _reduced_dims(call, m.ndim)
        keep = _keepdim(call)
        sigs = [Sig((B,), (B,))] + ([Sig((partial,), (partial,))] if partial_in else [])
        for d in range(m.ndim):
            if d in dims:
                sigs.append(Sig((Split(d),), (partial,)))
            else:
                new = d if keep else d - sum(1 for r in dims if r < d)
                sigs.append(Sig((Split(d),), (Split(new),)))
        return sigs

    return rule


register(aten.sum.default, aten.sum.dim_IntList)(_rule(P))
register(aten.amax.default, aten.max.default)(_rule(PMAX))
register(aten.amin.default, aten.min.default)(_rule(PMIN))
register(aten.any.default, aten.any.dim, aten.any.dims)(_rule(PMAX, partial_in=False))
register(aten.all.default, aten.all.dim, aten.all.dims)(_rule(PMIN, partial_in=False))


def _kept_only(call, dims, keep: bool, n_out: int = 1) -> list:
    """``B -> B`` and ``S(d) -> S(d')`` for each dim ``d`` not in ``dims`` (``n_out`` outputs laid out alike)."""
    nd = call.metas[0].ndim
    sigs = [Sig((B,), (B,) * n_out)]
    for d in range(nd):
        if d not in dims:
            new = d if keep else d - sum(1 for r in dims if r < d)
            sigs.append(Sig((Split(d),), (Split(new),) * n_out))
    return sigs


def _dim(call, index: int, default=None):
    """The op's one ``dim`` argument, non-negative (``None`` when absent and no default)."""
    dim = call.arg(index, "dim", default)
    return None if dim is None else dim % max(call.metas[0].ndim, 1)


@register(aten.argmax.default, aten.argmin.default)
def _arg_extremum_rule(call):
    dim = _dim(call, 1)
    if dim is None:  # an index into the flattened tensor
        return [Sig((B,), (B,))]
    return _kept_only(call, (dim,), bool(call.arg(2, "keepdim", False)))


@register(aten.cumsum.default)
def _cumsum_rule(call):
    return _kept_only(call, (_dim(call, 1),), True) + [Sig((P,), (P,))]


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


# -- vector norms ------------------------------------------------------------------------


def _norm_args(call) -> tuple:
    """``(p, reduced dims, keepdim)`` of ``norm.ScalarOpt_dim(x, p, dim, keepdim)`` / ``linalg_vector_norm(x, ord, dim, keepdim)``."""
    p = call.arg(1, "ord" if call.func is aten.linalg_vector_norm.default else "p", 2)
    dims = _reduced_dims(Call(call.func, (None, call.arg(2, "dim", None)), {}, []), call.metas[0].ndim)
    return (2 if p is None else p), dims, bool(call.arg(3, "keepdim", False))


def _norm_rule(call):
    m = call.metas[0]
    _, dims, keep = _norm_args(call)
    sigs = [Sig((B,), (B,))]
    for d in range(m.ndim):
        if d not in dims:
            sigs.append(Sig((Split(d),), (Split(d if keep else d - sum(1 for r in dims if r < d)),)))
    return sigs


def _norm_over_split(call) -> bool:
    _, dims, _ = _norm_args(call)
    return any(s.is_split and s.axis in dims for s in call.sbps[0])


def _vector_norm(x, p=2, dim=None, keepdim=False, dtype=None):
    p = 2.0 if p is None else float(p)
    dims = list(range(x.dim())) if dim is None or (isinstance(dim, (list, tuple)) and not dim) else dim
    a = x.abs() if dtype is None else x.abs().to(dtype)
    if p == math.inf:
        return a.amax(dims, keepdim)
    if p <= 0:
        raise NotImplementedError(f"a norm of order {p} over a split dim has no decomposition; use p > 0 or inf")
    return a.pow(p).sum(dims, keepdim=keepdim).pow(1.0 / p)


register(aten.norm.ScalarOpt_dim, aten.linalg_vector_norm.default, decompose=_vector_norm,
         decompose_when=_norm_over_split)(_norm_rule)


@register(aten.max.dim, aten.min.dim)
def _extremum_dim_rule(call):
    return _kept_only(call, (_dim(call, 1),), bool(call.arg(2, "keepdim", False)), n_out=2)


@register(aten.topk.default)
def _topk_rule(call):
    return _kept_only(call, (_dim(call, 2, -1),), True, n_out=2)


@register(aten.sort.default, aten.sort.stable)
def _sort_rule(call):  # sort.stable's dim is keyword-only: _dim finds it there
    return _kept_only(call, (_dim(call, 1, -1),), True, n_out=2)


@register(aten.median.dim, aten.nanmedian.dim)
def _median_dim_rule(call):
    return _kept_only(call, (_dim(call, 1),), bool(call.arg(2, "keepdim", False)), n_out=2)


@register(aten.kthvalue.default)
def _kthvalue_rule(call):
    return _kept_only(call, (_dim(call, 2, -1),), bool(call.arg(3, "keepdim", False)), n_out=2)


@register(aten.mode.default)
def _mode_rule(call):
    return _kept_only(call, (_dim(call, 1, -1),), bool(call.arg(2, "keepdim", False)), n_out=2)


@register(aten.median.default, aten.nanmedian.default)
def _whole_median_rule(call):
    return [Sig((B,), (B,))]


@register(aten.logcumsumexp.default)
def _logcumsumexp_rule(call):
    return _kept_only(call, (_dim(call, 1),), True)


register(aten.count_nonzero.default, aten.count_nonzero.dim_IntList)(_rule(P, partial_in=False))


def _dims_of(x, dim) -> list:
    """``dim`` (an int, a list, or ``None``/empty for every dim) as non-negative dims of ``x``."""
    if dim is None or (isinstance(dim, (list, tuple)) and not dim):
        return list(range(x.dim()))
    return [d % x.dim() for d in ([dim] if isinstance(dim, int) else dim)]


def _var(x, dim=None, *, correction=None, keepdim=False):
    """Variance over ``dim`` from global sums: the mean is boxed to ``B`` (one row per kept index), the
    squared deviations' sum is left ``P(sum)``."""
    dims = _dims_of(x, dim)
    n = math.prod(x.shape[d] for d in dims)
    mean = _row_stat(x.sum(dims, keepdim=True)) / n
    return (x - mean).square().sum(dims, keepdim=keepdim) / max(n - (1 if correction is None else correction), 0)


def _std(x, dim=None, *, correction=None, keepdim=False):
    return _var(x, dim, correction=correction, keepdim=keepdim).sqrt()


def _logsumexp(x, dim, keepdim=False):
    dims = _dims_of(x, dim)
    m = _row_stat(x.amax(dims, keepdim=True))
    m = m.masked_fill(m.abs() == float("inf"), 0.0)
    out = _row_stat((x - m).exp().sum(dims, keepdim=True)).log() + m
    return out if keepdim else out.squeeze(dims)


def _kept_dims_rule(call):
    return _kept_only(call, _reduced_dims(call, call.metas[0].ndim), bool(call.arg(2, "keepdim", False)))


def _reduces_split(call) -> bool:
    dims = _reduced_dims(call, call.metas[0].ndim)
    return any(s.is_split and s.axis in dims for s in call.sbps[0])


register(aten.var.correction, decompose=_var, decompose_when=_reduces_split)(_kept_dims_rule)
register(aten.std.correction, decompose=_std, decompose_when=_reduces_split)(_kept_dims_rule)
register(aten.logsumexp.default, decompose=_logsumexp, decompose_when=_reduces_split)(_kept_dims_rule)
