"""Convolutional-net ops: convolution, batch norm, pooling, and embedding bags.

On one mesh axis, best first (backward ``P`` signatures, exact because the
op is linear in the gradient, are offered only when the gradient really is
partial there). Nothing is communicated except the dispatcher's boxing and
batch norm's statistics.

- ``convolution(x, w, b)``: ``x`` ``S(0)`` (batch), ``w``/``b`` ``B`` ->
  ``S(0)``; out-channel split (``x`` ``B``, ``w`` ``S(0)``, or ``S(1)``
  transposed, ``b`` ``S(0)``) -> ``S(1)``; in-channel split (``x`` ``S(1)``,
  ``w`` ``S(1)``/``S(0)`` transposed, ``b`` ``P``) -> ``P``; linear in ``x``
  or ``w``: ``P`` -> ``P`` (``b`` ``P``); ``B`` -> ``B``. Channel splits need
  ``groups == 1``. ``convolution_backward(g, x, w)`` -> ``(dx, dw, db)``:
  batch ``(S(0), S(0), B)`` -> ``(S(0), P, P)``; out-channel
  ``(S(1), B, S(o))`` -> ``(P, S(o), S(0))``; in-channel ``(B, S(1), S(i))``
  -> ``(S(1), S(i), B)``; ``g`` ``P`` -> ``P``; ``B`` -> ``B``.
- ``native_batch_norm`` in training with the input split on a batch or
  spatial dim is *decomposed* into global ops (SyncBatchNorm semantics):
  per-channel sums -> ``P`` -> boxed to ``B`` (an all-reduce of ``C`` values
  for the mean, another for the variance), so the statistics and the
  running-stat updates equal single-device ones. Its backward likewise
  all-reduces the two per-channel gradient sums, stacked into one ``[2, C]``
  all-reduce (they then are ``dw``/``db``, ``B``). Otherwise by rule:
  channel split (``x`` ``S(1)``, parameters and statistics ``S(0)``) ->
  ``(S(1), S(0), S(0))``; in eval mode also batch /
  spatial ``S(d)`` with ``B`` parameters; ``B`` -> ``B``. In training the
  running stats are updated in place, so they must already be laid out as
  the signature needs (no boxed copy is updated).
- ``cudnn_batch_norm`` and its backward (what ``F.batch_norm`` calls on
  CUDA) run as ``native_batch_norm`` and its backward on the global tensors.
- ``max_pool2d_with_indices``, ``avg_pool2d``, ``_adaptive_avg_pool2d`` and
  backwards: ``S`` on a batch or channel dim -> same; ``B`` -> ``B``; the
  linear ones (average pools, every backward in its gradient) ``P`` -> ``P``.
- ``_prelu_kernel(x, w)`` (``F.prelu``, ``w`` reshaped to broadcast over the
  channel dim): element-wise (``S(d)`` with ``w`` ``S`` or ``B`` as it
  broadcasts; ``B``). ``_prelu_kernel_backward(g, x, w)`` -> ``(dx, dw)``,
  both of ``x``'s shape (autograd then sums ``dw`` to ``w``'s shape): the same
  element-wise signatures for both outputs; ``g`` ``P`` -> ``(P, P)`` (linear in
  the gradient).
- ``_embedding_bag`` (Wide&Deep; ids and offsets ``B``; splitting the bags
  is not offered, a split would cut bags): ``w`` ``S(1)`` -> ``S(1)`` (any
  mode); ``w`` ``S(0)`` (vocab rows) -> ``P`` for mode sum: each rank sums
  the ids in its rows, the others weighted 0; ``w`` ``P`` -> ``P`` (sum,
  mean); ``B`` -> ``B``. Backward: ``(S(1), ...)`` -> ``S(1)``; all ``B`` ->
  ``S(0)`` (sum, mean: each rank accumulates its rows, other ids go to a
  spare row that is dropped); ``P`` -> ``P``; ``B`` -> ``B``.
"""
from __future__ import annotations

import torch

from ..global_tensor import GlobalTensor
from ..layout import Layout
from ..sbp import Split
from .common import B, P
from .loss import _row_stat
from .nn import _always, _never_decided, _rows
from .per_axis import axis_of
from .pointwise import pointwise
from .registry import Call, Sig, register

aten = torch.ops.aten

S0, S1 = Split(0), Split(1)
SUM_MODE, MAX_MODE = 0, 2


def _partial_axis(call) -> list:
    """Which global inputs are partial-sum on the mesh axis being decided."""
    return [s is not None and s.is_partial and s.op == "sum" for s in axis_of(call).sbps]


def _sig(call, params, ins, outs, present=None) -> Sig:
    """A Sig over the optional tensor arguments ``params`` (``(index, name)``) that were passed."""
    got = tuple(s for (i, name), s in zip(params, ins) if call.arg(i, name) is not None)
    return Sig(got, tuple(o for k, o in enumerate(outs) if present is None or present[k]))


CONV = ((0, "input"), (1, "weight"), (2, "bias"))
CONV_BW = ((0, "grad_output"), (1, "input"), (2, "weight"))
BN = ((0, "input"), (1, "weight"), (2, "bias"), (3, "running_mean"), (4, "running_var"))
BN_BW = ((0, "grad_out"), (1, "input"), (2, "weight"), (3, "running_mean"), (4, "running_var"),
         (5, "save_mean"), (6, "save_invstd"))
BAG = ((0, "weight"), (1, "indices"), (2, "offsets"), (6, "per_sample_weights"))
BAG_BW = ((0, "grad"), (1, "indices"), (2, "offsets"), (3, "offset2bag"), (4, "bag_size"),
          (5, "maximum_indices"), (10, "per_sample_weights"))


# -- convolution ---------------------------------------------------------------


def _channel_dims(call, transposed_at: int, groups_at: int):
    """``(out-channel dim, in-channel dim)`` of the weight, or ``None`` if channels cannot split."""
    if call.arg(groups_at, "groups") != 1:
        return None
    return (1, 0) if call.arg(transposed_at, "transposed") else (0, 1)


@register(aten.convolution.default)
def convolution(call):
    part = _partial_axis(call)
    sigs = [_sig(call, CONV, (S0, B, B), (S0,))]
    ch = _channel_dims(call, 6, 8)
    if ch is not None:
        sigs.append(_sig(call, CONV, (B, Split(ch[0]), S0), (S1,)))
        sigs.append(_sig(call, CONV, (S1, Split(ch[1]), P), (P,)))
    sigs.append(_sig(call, CONV, (B, B, B), (B,)))
    if part[0]:
        sigs.append(_sig(call, CONV, (P, B, P), (P,)))
    if part[1]:
        sigs.append(_sig(call, CONV, (B, P, P), (P,)))
    return sigs


@register(aten.convolution_backward.default)
def convolution_backward(call):
    part = _partial_axis(call)
    mask = call.arg(10, "output_mask")
    sigs = [_sig(call, CONV_BW, (S0, S0, B), (S0, P, P), mask)]
    ch = _channel_dims(call, 7, 9)
    if ch is not None:
        o, i = Split(ch[0]), Split(ch[1])
        sigs.append(_sig(call, CONV_BW, (S1, B, o), (P, o, S0), mask))
        sigs.append(_sig(call, CONV_BW, (B, S1, i), (S1, i, B), mask))
    sigs.append(_sig(call, CONV_BW, (B, B, B), (B, B, B), mask))
    if part[0]:
        sigs.append(_sig(call, CONV_BW, (P, B, B), (P, P, P), mask))
    return sigs


# -- batch norm ----------------------------------------------------------------


def _bn_geometry(x):
    dims = [0] + list(range(2, x.ndim))
    return dims, x.numel() // x.shape[1], [1, -1] + [1] * (x.ndim - 2)


def _stat_split(call, j: int) -> bool:
    """Is global input ``j`` (the activation) split on a batch or spatial dim on some mesh axis?"""
    return any(s.is_split and s.axis != 1 for s in call.sbps[j])


def _batch_norm_train(x, weight, bias, running_mean, running_var, training, momentum, eps):
    dims, n, shape = _bn_geometry(x)
    mean = _row_stat(x.sum(dims) / n)
    xc = x - mean.view(shape)
    var = _row_stat((xc * xc).sum(dims) / n)
    invstd = (var + eps).rsqrt()
    out = xc * invstd.view(shape)
    if weight is not None:
        out = out * weight.view(shape)
    if bias is not None:
        out = out + bias.view(shape)
    if running_mean is not None:
        running_mean.mul_(1 - momentum).add_(mean * momentum)
        running_var.mul_(1 - momentum).add_(var * (momentum * n / max(n - 1, 1)))
    return out, mean, invstd


def _batch_norm_train_backward(g, x, weight, running_mean, running_var, save_mean, save_invstd, train, eps, mask):
    dims, n, shape = _bn_geometry(x)
    xhat = (x - save_mean.view(shape)) * save_invstd.view(shape)
    sums = torch.stack([g.sum(dims), (g * xhat).sum(dims)])
    if mask[0]:  # dx needs both sums whole: one all-reduce of [2, C], not two of [C]
        sums = _row_stat(sums)
    sum_g, sum_gx = sums[0], sums[1]
    dx = None
    if mask[0]:
        scale = save_invstd if weight is None else save_invstd * weight
        dx = (g - (sum_g / n).view(shape) - xhat * (sum_gx / n).view(shape)) * scale.view(shape)
    return dx, sum_gx if mask[1] else None, sum_g if mask[2] else None


def _actual(call, params) -> list:
    """Actual 1-d SBP on this axis of each of ``params`` (``None`` where not passed)."""
    sbps = axis_of(call).sbps
    out, k = [], 0
    for i, name in params:
        present = call.arg(i, name) is not None
        out.append(sbps[k] if present else None)
        k += present
    return out


@register(aten.native_batch_norm.default, decompose=_batch_norm_train,
          decompose_when=lambda call: call.arg(5, "training") and _stat_split(call, 0))
def batch_norm(call):
    training = call.arg(5, "training")
    x = call.metas[0]
    rm, rv = _actual(call, BN)[3:]
    stat = S0 if training else B
    sigs = []
    if not training:
        sigs += [_sig(call, BN, (Split(d), B, B, B, B), (Split(d), B, B)) for d in range(x.ndim) if d != 1]
    # Training updates the running stats in place: offer only what they already are.
    if not training or all(s in (None, S0) for s in (rm, rv)):
        sigs.append(_sig(call, BN, (S1, S0, S0, S0, S0), (S1, stat, stat)))
    if not training or all(s in (None, B) for s in (rm, rv)):
        sigs.append(_sig(call, BN, (B,) * 5, (B, B, B)))
    return sigs


@register(aten.native_batch_norm_backward.default, decompose=_batch_norm_train_backward,
          decompose_when=lambda call: call.arg(7, "train") and _stat_split(call, 1))
def batch_norm_backward(call):
    part = _partial_axis(call)
    train = call.arg(7, "train")
    mask = call.arg(9, "output_mask")
    x = call.metas[1]
    saved, saved_b = (S0, B) if train else (None, None)  # eval: empty save_mean/save_invstd
    sigs = []
    if not train:
        sigs += [_sig(call, BN_BW, (Split(d),) * 2 + (B,) * 3 + (None,) * 2, (Split(d), P, P), mask)
                 for d in range(x.ndim) if d != 1]
    sigs.append(_sig(call, BN_BW, (S1, S1, S0, S0, S0, saved, saved), (S1, S0, S0), mask))
    sigs.append(_sig(call, BN_BW, (B,) * 5 + (saved_b,) * 2, (B, B, B), mask))
    if part[0]:
        sigs.append(_sig(call, BN_BW, (P,) + (B,) * 4 + (saved_b,) * 2, (P, P, P), mask))
    return sigs


def _cudnn_batch_norm(x, weight, bias, running_mean, running_var, training, momentum, eps):
    """cuDNN's batch norm as ``native_batch_norm`` on the global tensors, its reserve space empty (``B``)."""
    out, mean, invstd = aten.native_batch_norm.default(x, weight, bias, running_mean, running_var, training,
                                                       momentum, eps)
    empty = Layout(x.placement, tuple(B for _ in x.placement.shape), torch.Size([0]), torch.uint8)
    return out, mean, invstd, GlobalTensor(torch.empty(0, dtype=torch.uint8, device=x.device), empty)


def _cudnn_batch_norm_backward(x, g, weight, running_mean, running_var, save_mean, save_invstd, eps, reserve):
    """cuDNN's backward (autograd takes it in training only) as ``native_batch_norm_backward``'s, all outputs."""
    return aten.native_batch_norm_backward.default(g, x, weight, running_mean, running_var, save_mean, save_invstd,
                                                   True, eps, [True, True, True])


# ``F.batch_norm`` takes cuDNN's op for a CUDA input (the global tensor reports its local's device), and
# autograd then its backward. Both run as the native ops above, so every layout and decomposition of
# those applies; the local kernel is ATen's native one, not cuDNN's.
register(aten.cudnn_batch_norm.default, decompose=_cudnn_batch_norm, decompose_when=_always)(_never_decided)
register(aten.cudnn_batch_norm_backward.default, decompose=_cudnn_batch_norm_backward,
         decompose_when=_always)(_never_decided)


# -- pooling -------------------------------------------------------------------


def _pool(n_in: int, n_out: int, linear: bool):
    """``S(d) -> S(d)`` on batch/channel dims, ``B -> B``, and ``P`` in input 0 when ``linear``."""

    def rule(call):
        part = _partial_axis(call)
        nd = call.metas[0].ndim
        sigs = [Sig((Split(d),) * n_in, (Split(d),) * n_out) for d in range(nd - 2)]
        sigs.append(Sig((B,) * n_in, (B,) * n_out))
        if linear and part[0]:
            sigs.append(Sig((P,) + (B,) * (n_in - 1), (P,) * n_out))
        return sigs

    return rule


register(aten.max_pool2d_with_indices.default)(_pool(1, 2, False))
register(aten.max_pool2d_with_indices_backward.default)(_pool(3, 1, True))
register(aten.avg_pool2d.default, aten._adaptive_avg_pool2d.default)(_pool(1, 1, True))
register(aten.avg_pool2d_backward.default, aten._adaptive_avg_pool2d_backward.default)(_pool(2, 1, True))


# -- embedding bag -------------------------------------------------------------


def _bag_local(func, args, kwargs, ctx):
    c = Call(func, args, kwargs, [])
    start, n = _rows(ctx.in_layouts[0], ctx.coords)
    if n == ctx.in_layouts[0].shape[0]:
        return func(*args, **kwargs)
    w, ids, offsets = args[:3]
    psw, pad = c.arg(6, "per_sample_weights"), c.arg(8, "padding_idx", -1)
    mine = (ids >= start) & (ids < start + n) & (ids != pad)
    weights = mine.to(w.dtype) if psw is None else psw * mine
    if n == 0:  # no rows here: look up a zero row
        w = w.new_zeros(1, w.shape[1])
    return func(w, torch.where(mine, ids - start, 0), offsets, c.arg(3, "scale_grad_by_freq", False),
                SUM_MODE, c.arg(5, "sparse", False), weights, c.arg(7, "include_last_offset", False), -1)


@register(aten._embedding_bag.default, aten._embedding_bag_forward_only.default, local=_bag_local)
def embedding_bag(call):
    part = _partial_axis(call)
    mode = call.arg(4, "mode", SUM_MODE)
    maxi = S1 if mode == MAX_MODE else B
    sigs = [_sig(call, BAG, (S1, B, B, B), (S1, B, B, maxi))]
    if mode == SUM_MODE:
        sigs.append(_sig(call, BAG, (S0, B, B, B), (P, B, B, B)))
    sigs.append(_sig(call, BAG, (B,) * 4, (B,) * 4))
    if part[0] and mode != MAX_MODE:
        sigs.append(_sig(call, BAG, (P, B, B, B), (P, B, B, B)))
    return sigs


def _bag_backward_local(func, args, kwargs, ctx):
    c = Call(func, args, kwargs, [])
    start, n = _rows(ctx.out_layouts[0], ctx.coords)
    if n == ctx.out_layouts[0].shape[0]:
        return func(*args, **kwargs)
    ids, pad = args[1], c.arg(11, "padding_idx", -1)
    local = torch.where((ids >= start) & (ids < start + n), ids - start, n)
    pad = pad - start if 0 <= pad - start < n else -1
    rest = [c.arg(i, name) for i, name in enumerate(
        ("scale_grad_by_freq", "mode", "sparse", "per_sample_weights"), start=7)]
    return func(args[0], local, *args[2:6], n + 1, *rest, pad)[:n]


@register(aten._embedding_bag_backward.default, local=_bag_backward_local)
def embedding_bag_backward(call):
    part = _partial_axis(call)
    if call.arg(9, "sparse", False):
        raise ValueError("_embedding_bag_backward with sparse=True: sparse gradients of global tensors are not supported")
    mode = call.arg(8, "mode", SUM_MODE)
    maxi = S1 if mode == MAX_MODE else B
    sigs = [_sig(call, BAG_BW, (S1, B, B, B, B, maxi, B), (S1,))]
    if mode != MAX_MODE:
        sigs.append(_sig(call, BAG_BW, (B,) * 7, (S0,)))
    sigs.append(_sig(call, BAG_BW, (B,) * 7, (B,)))
    if part[0]:
        sigs.append(_sig(call, BAG_BW, (P,) + (B,) * 6, (P,)))
    return sigs


def _psw_backward_local(func, args, kwargs, ctx):
    start, n = _rows(ctx.in_layouts[1], ctx.coords)
    if n == ctx.in_layouts[1].shape[0]:
        return func(*args, **kwargs)
    g, w, ids = args[:3]
    pad = Call(func, args, kwargs, []).arg(6, "padding_idx", -1)
    mine = (ids >= start) & (ids < start + n) & (ids != pad)
    if n == 0:
        return g.new_zeros(ids.shape[0])
    out = func(g, w, torch.where(mine, ids - start, 0), *args[3:6], -1)
    return out * mine.to(out.dtype)


@register(aten._embedding_bag_per_sample_weights_backward.default, local=_psw_backward_local)
def embedding_bag_psw_backward(call):
    # (grad, weight, indices, offsets, offset2bag): dot products over D, or over this rank's rows.
    return [Sig((S1, S1, B, B, B), (P,)), Sig((B, S0, B, B, B), (P,)), Sig((B,) * 5, (B,))]


# -- PReLU ---------------------------------------------------------------------------------


register(aten._prelu_kernel.default)(pointwise)


@register(aten._prelu_kernel_backward.default)
def _prelu_backward(call):
    sigs = [Sig(s.inputs, s.outputs * 2) for s in pointwise(call)]
    if call.partial_here(0):
        sigs.append(Sig((P, B, B), (P, P)))
    return sigs
