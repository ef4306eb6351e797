"""Softmax and cross-entropy, including over a split class axis (model-parallel softmax).

``F.cross_entropy`` reaches dispatch as ``_log_softmax`` + ``nll_loss_forward``
(``[N, C]``, e.g. GPT's ``[B*T, V]`` logits) or ``nll_loss2d_forward``
(``[N, C, d1, ...]``), and their backwards ``_log_softmax_backward_data`` and
``nll_loss_backward``/``nll_loss2d_backward``. On one mesh axis:

- ``_log_softmax``/``_softmax``/``_safe_softmax`` (and their backwards):
  ``S(d)`` on a dim other than the softmax dim -> ``S(d)``; ``B`` -> ``B``;
  backwards also ``(P, B) -> P`` (linear in the gradient). When the softmax
  dim is split on some mesh axis the op is *decomposed* into global ops:
  local max -> ``P(max)`` -> boxed to ``B``, local exp-sum -> ``P(sum)`` ->
  boxed to ``B`` (backward: one ``P(sum)`` row sum). Only ``[N, 1]``-sized
  reductions are communicated, never the logits; this is GPT's
  vocab-parallel loss and InsightFace's partial FC.
- ``nll_loss*_forward(x, t, w)`` -> ``(loss, total_weight)``: rows split
  (``x`` ``S`` on a batch dim, ``t`` ``S`` on the matching dim, ``w`` ``B``)
  -> loss ``S`` (reduction none) or ``P`` (sum), total_weight ``P``; classes
  split (``x`` ``S(class)``, ``t`` ``B``, ``w`` ``S(0)``) -> ``P``, ``P``: each
  rank picks the target logits in its class range (from its mesh coords) and
  treats other targets as ignored; ``x`` ``P`` (``t``, ``w`` ``B``) -> ``P``,
  ``B``; ``B`` -> ``B``. Reduction *mean* over any split or partial input is
  decomposed: the sum-reduction (``P``) divided by total_weight (``P`` ->
  boxed to ``B``, one scalar), so the divisor is the *global* weight of the
  non-ignored targets.
- ``nll_loss*_backward(g, x, t, w, total_weight)``: the same row / class
  splits -> ``grad_input`` laid out like ``x`` (``g`` ``B`` unless it is
  per-row; mean needs total_weight ``B``); ``g`` ``P`` -> ``P``; ``B`` -> ``B``.
- ``mse_loss``, ``smooth_l1_loss``, ``huber_loss`` and their backwards:
  element-wise signatures; with reduction sum or mean the loss is ``P``
  (mean: the local sum over the *global* element count, and the backward
  divides by that count too).
- ``binary_cross_entropy_with_logits(x, t, w, pos_weight)`` (Wide&Deep):
  element-wise signatures (``S(d)`` with broadcast operands ``B``; ``B``)
  whose output is the same for reduction none and ``P`` for sum and mean
  (mean: the local sum over the *global* element count). Its backward is
  element-wise ops autograd already divides by the global count, plus
  ``log_sigmoid_forward``/``_backward`` with ``pos_weight``: ``S(d)``, ``B``.
"""
from __future__ import annotations

import torch

from ..boxing import box
from ..global_tensor import GlobalTensor
from ..layout import local_box
from ..sbp import Split
from .common import B, P, split_or_broadcast
from .nn import _partial_in
from .pointwise import pointwise
from .registry import Call, Sig, register

aten = torch.ops.aten

NONE, MEAN, SUM = 0, 1, 2
_LOCAL_IGNORE = -1  # never a local class index


def _split_on(call, j: int, dim: int) -> bool:
    return any(s.is_split and s.axis == dim for s in call.sbps[j])


# -- softmax family -----------------------------------------------------------


_BACKWARDS = (aten._log_softmax_backward_data.default, aten._softmax_backward_data.default)


def _softmax_dim(call) -> int:
    dim = call.arg(2, "dim") if call.func in _BACKWARDS else call.arg(1, "dim")
    return dim % max(call.metas[0].ndim, 1)


def _softmax_rule(call):
    dim, nd = _softmax_dim(call), call.metas[0].ndim
    return [Sig((Split(d),), (Split(d),)) for d in range(nd) if d != dim] + [Sig((B,), (B,))]


def _softmax_backward_rule(call):
    grad_p = _partial_in(call)
    dim, nd = _softmax_dim(call), call.metas[0].ndim
    sigs = [Sig((Split(d),) * 2, (Split(d),)) for d in range(nd) if d != dim] + [Sig((B, B), (B,))]
    return sigs + ([Sig((P, B), (P,))] if grad_p else [])


def _class_split(call) -> bool:
    dim = _softmax_dim(call)
    return any(_split_on(call, j, dim) for j in range(len(call.metas)))


def _row_stat(t):
    """A reduction over the split dim, its partial axes boxed to ``B`` (an all-reduce of ``[N, 1]``).

    Boxed here rather than left to the consumer: ``S - P`` has a free ``P``
    signature (``S -> P`` costs nothing) that would leave the logits partial.
    """
    sbp = tuple(B if s.is_partial else s for s in t.sbp)
    if sbp == t.sbp:
        return t
    return GlobalTensor(box(t._local, t.layout, t.layout.with_sbp(sbp)), t.layout.with_sbp(sbp))


def _log_softmax(x, dim, half_to_float=False):
    x = x.float() if half_to_float else x
    shifted = x - _row_stat(x.amax(dim, keepdim=True))
    return shifted - _row_stat(shifted.exp().sum(dim, keepdim=True)).log()


def _log_softmax_backward(grad, out, dim, input_dtype):
    return grad - out.exp() * _row_stat(grad.sum(dim, keepdim=True))


def _softmax(x, dim, half_to_float=False):
    x = x.float() if half_to_float else x
    e = (x - _row_stat(x.amax(dim, keepdim=True))).exp()
    return e / _row_stat(e.sum(dim, keepdim=True))


def _safe_softmax(x, dim, dtype=None):
    """Softmax whose rows of all ``-inf`` give zeros instead of NaN."""
    x = x if dtype is None else x.to(dtype)
    m = _row_stat(x.amax(dim, keepdim=True))
    e = (x - m.masked_fill(m == float("-inf"), 0.0)).exp()
    s = _row_stat(e.sum(dim, keepdim=True))
    return (e / s).masked_fill(s == 0, 0.0)


def _softmax_backward(grad, out, dim, input_dtype):
    return out * (grad - _row_stat((grad * out).sum(dim, keepdim=True)))


register(aten._log_softmax.default, decompose=_log_softmax, decompose_when=_class_split)(_softmax_rule)
register(aten._softmax.default, decompose=_softmax, decompose_when=_class_split)(_softmax_rule)
register(aten._safe_softmax.default, decompose=_safe_softmax, decompose_when=_class_split)(_softmax_rule)
register(aten._log_softmax_backward_data.default, decompose=_log_softmax_backward,
         decompose_when=_class_split)(_softmax_backward_rule)
register(aten._softmax_backward_data.default, decompose=_softmax_backward,
         decompose_when=_class_split)(_softmax_backward_rule)


# -- negative log-likelihood ----------------------------------------------------


def _geometry(x_ndim: int) -> tuple:
    """``(class dim of x, [(target dim, x dim)] for the batch dims)``."""
    c = 1 if x_ndim >= 2 else 0
    return c, [(j, j if j < c else j + 1) for j in range(max(x_ndim - 1, 0))]


def _nll_rule(call):
    x_p = _partial_in(call)
    x, t = call.metas[:2]
    has_w = len(call.metas) == 3
    reduction = call.arg(3, "reduction")
    c, rows = _geometry(x.ndim)
    w = (B,) if has_w else ()
    if reduction == MEAN:  # only reached with every input B; splits are decomposed
        return [Sig((B, B) + w, (B, B))]
    sigs = [
        Sig((Split(xd), Split(j)) + w, (Split(j) if reduction == NONE else P, P)) for j, xd in rows
    ]
    sigs.append(Sig((Split(c), B) + ((Split(0),) if has_w else ()), (P, P)))
    sigs.append(Sig((B, B) + w, (B, B)))
    if x_p:
        sigs.append(Sig((P, B) + w, (P, B)))
    return sigs


def _nll_backward_rule(call):
    grad_p = _partial_in(call)
    g, x, t = call.metas[:3]
    has_w = len(call.metas) == 5
    reduction = call.arg(4, "reduction")
    c, rows = _geometry(x.ndim)
    w = (B,) if has_w else ()
    tw = B if reduction == MEAN else None
    sigs = [
        Sig((Split(j) if reduction == NONE else B, Split(xd), Split(j)) + w + (tw,), (Split(xd),))
        for j, xd in rows
    ]
    sigs.append(Sig((B, Split(c), B) + ((Split(0),) if has_w else ()) + (tw,), (Split(c),)))
    sigs.append(Sig((B, B, B) + w + (tw,), (B,)))
    if grad_p:
        sigs.append(Sig((P, B, B) + w + (tw,), (P,)))
    return sigs


def _local_targets(target, ignore_index, ctx, x_index: int):
    """Targets in this rank's class range shifted to local indices; others ignored (or ``None``: no split)."""
    lay = ctx.in_layouts[x_index]
    c, _ = _geometry(len(lay.shape))
    start, n = local_box(lay.shape, lay.placement.shape, lay.sbp, ctx.coords)[c]
    if n == lay.shape[c]:
        return None
    mine = (target >= start) & (target < start + n) & (target != ignore_index)
    return torch.where(mine, target - start, _LOCAL_IGNORE)


def _nll_local(func, args, kwargs, ctx):
    call = Call(func, args, kwargs, [])
    t = _local_targets(args[1], call.arg(4, "ignore_index"), ctx, 0)
    if t is None:
        return func(*args, **kwargs)
    return func(args[0], t, call.arg(2, "weight"), call.arg(3, "reduction"), _LOCAL_IGNORE)


def _nll_backward_local(func, args, kwargs, ctx):
    call = Call(func, args, kwargs, [])
    t = _local_targets(args[2], call.arg(5, "ignore_index"), ctx, 1)
    if t is None:
        return func(*args, **kwargs)
    g, x, w, reduction, tw = args[0], args[1], call.arg(3, "weight"), call.arg(4, "reduction"), call.arg(6, "total_weight")
    return func(g, x, t, w, reduction, _LOCAL_IGNORE, tw)


def _mean_needs_global_count(call) -> bool:
    return call.arg(3, "reduction") == MEAN and any(s != B for sbp in call.sbps for s in sbp)


def _nll_decompose(func):
    def mean_of_sum(x, target, weight, reduction, ignore_index):
        total, count = func(x, target, weight, SUM, ignore_index)
        count = _row_stat(count)  # boxed once, reused by the backward
        return total / count, count

    return mean_of_sum


for _fwd, _bwd in [(aten.nll_loss_forward.default, aten.nll_loss_backward.default),
                   (aten.nll_loss2d_forward.default, aten.nll_loss2d_backward.default)]:
    register(_fwd, local=_nll_local, decompose=_nll_decompose(_fwd), decompose_when=_mean_needs_global_count)(_nll_rule)
    register(_bwd, local=_nll_backward_local)(_nll_backward_rule)


# -- binary cross-entropy with logits --------------------------------------------


def _bce_rule(call):
    sigs = pointwise(call)  # the element-wise loss
    if call.arg(4, "reduction", MEAN) == NONE:
        return sigs
    return [Sig(s.inputs, (B if s.outputs[0] == B else P,)) for s in sigs]


def _bce_local(func, args, kwargs, ctx):
    call = Call(func, args, kwargs, [])
    if call.arg(4, "reduction", MEAN) != MEAN:
        return func(*args, **kwargs)
    total = func(args[0], args[1], call.arg(2, "weight"), call.arg(3, "pos_weight"), SUM)
    return total / ctx.in_layouts[0].shape.numel()


register(aten.binary_cross_entropy_with_logits.default, local=_bce_local)(_bce_rule)


@register(aten.log_sigmoid_forward.default)
def _log_sigmoid(call):  # (out, buffer), reached by the pos_weight gradient and F.logsigmoid
    return split_or_broadcast(call, n_out=2)


@register(aten.log_sigmoid_backward.default)
def _log_sigmoid_backward(call):
    grad_p = _partial_in(call)
    return split_or_broadcast(call) + ([Sig((P, B, B), (P,))] if grad_p else [])


# -- regression losses ---------------------------------------------------------------


def _with_sum(args, kwargs, at: int) -> tuple:
    """``args``/``kwargs`` with the reduction (positional ``at`` or keyword) set to sum."""
    if len(args) > at:
        return args[:at] + (SUM,) + args[at + 1:], kwargs
    return args, {**kwargs, "reduction": SUM}


def _regression_rule(at: int, reduces: bool):
    """Element-wise signatures; with ``reduces`` (a forward) and reduction sum or mean, a split input gives ``P``."""

    def rule(call):
        sigs = pointwise(call)
        if not reduces or call.arg(at, "reduction", MEAN) == NONE:
            return sigs
        return [Sig(s.inputs, (B if s.outputs[0] == B else P,)) for s in sigs]

    return rule


def _regression_local(at: int, counted: int):
    """Reduction mean: the op with reduction sum over input ``counted``'s *global* element count."""

    def local(func, args, kwargs, ctx):
        if Call(func, args, kwargs, []).arg(at, "reduction", MEAN) != MEAN:
            return func(*args, **kwargs)
        summed_args, summed_kwargs = _with_sum(tuple(args), dict(kwargs), at)
        return func(*summed_args, **summed_kwargs) / ctx.in_layouts[counted].shape.numel()

    return local


for _fwd, _bwd in [(aten.mse_loss.default, aten.mse_loss_backward.default),
                   (aten.smooth_l1_loss.default, aten.smooth_l1_loss_backward.default),
                   (aten.huber_loss.default, aten.huber_loss_backward.default)]:
    register(_fwd, local=_regression_local(2, 0))(_regression_rule(2, True))
    register(_bwd, local=_regression_local(3, 1))(_regression_rule(3, False))
