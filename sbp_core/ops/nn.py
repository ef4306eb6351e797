"""Transformer building blocks: layer norm, dropout, embedding (attention: ``attention.py``).

On one mesh axis, best first (``P`` signatures of backward ops are offered
only when the incoming gradient really is partial on that axis; they are
exact because those ops are linear in the gradient). Nothing here
communicates except the boxing the dispatcher does to reach a signature.

- ``native_layer_norm(x, shape, w, b)`` -> ``(y, mean, rstd)``: ``x`` split
  on a dim that is not normalised, ``w``/``b`` ``B`` -> all three ``S`` on
  that dim; all ``B`` -> ``B``. ``native_layer_norm_backward(g, x, shape,
  mean, rstd, w, b)`` -> ``(dx, dw, db)``: ``S(d)`` everywhere, ``w``/``b``
  ``B`` -> ``(S(d), P, P)``; all ``B`` -> ``B``; ``g`` ``P`` -> ``(P, P, P)``.
- Dropout: ``F.dropout`` on CPU runs ``empty_like``, ``bernoulli_.float``,
  ``div_``, ``mul``; ``native_dropout`` is what fused paths call (CUDA's
  ``F.dropout``). Both are decomposed on *every* rank (inside the placement
  or not): the mask is drawn for the global shape from the default
  generator exactly like single-device aten (``native_dropout``'s by the
  device's own kernel), then each member keeps its piece (``take_local``). So the mask equals
  single-device torch's for any layout, and all ranks' generators stay in
  step. Layouts: the mask takes the input's (``P`` -> ``B``), the output the
  input's (``P`` through the mask-multiply). ``native_dropout_backward(g,
  mask)``: element-wise, plus ``(P, B) -> P``. Costs a full-size draw per rank.
- ``embedding(w, ids)``: ``w`` ``B``, ``ids`` ``S(d)`` -> ``S(d)``; ``w``
  ``S(1)`` (hidden), ``ids`` ``B`` -> ``S(last)``; ``w`` ``S(0)`` (vocab
  rows, Megatron's VocabParallelEmbedding), ``ids`` ``B`` -> ``P(sum)``: each
  rank looks up the ids in its rows (from its mesh coords, any mesh axes
  splitting ``w``'s rows) and writes zeros for the others; ``w`` ``P``, ``ids``
  ``B`` -> ``P``; ``B`` -> ``B``. ``embedding_dense_backward(g, ids)``:
  ``S(d)``, ``S(d)`` -> ``P``; ``B``, ``B`` -> ``S(0)`` (each rank
  accumulates only its vocab rows, ids elsewhere go to a spare row that is
  dropped; offered instead of ``B``, see below); ``S(last)``, ``B`` ->
  ``S(1)``; ``P``, ``B`` -> ``P``.
  With ``scale_grad_by_freq`` ids are never split (counts must be global).

The backward rule cannot see the weight, so ``(B, B)`` gives ``S(0)`` whether
or not the weight is vocab-split: right for vocab-parallel (no full-size
gradient per rank); a replicated weight then gets an ``S(0)`` gradient the
optimizer all-gathers.
"""
from __future__ import annotations

import torch

from ..declare import distribute
from ..layout import local_box, take_local
from ..process_groups import world_rank
from ..sbp import Split
from .common import B, P
from .per_axis import axis_of
from .pointwise import pointwise
from .registry import Call, Sig, register

aten = torch.ops.aten


def _partial_in(call, j: int = 0) -> bool:
    """Is global input ``j`` (e.g. the incoming gradient) partial-sum on the mesh axis being decided?"""
    s = axis_of(call).sbps
    return s is not None and s[j] is not None and s[j].is_partial and s[j].op == "sum"


# -- layer norm --------------------------------------------------------------


@register(aten.native_layer_norm.default)
def layer_norm(call):
    x = call.metas[0]
    kept = x.ndim - len(call.arg(1, "normalized_shape"))
    n_par = len(call.metas) - 1
    sigs = [Sig((Split(d),) + (B,) * n_par, (Split(d),) * 3) for d in range(kept)]
    return sigs + [Sig((B,) * len(call.metas), (B,) * 3)]


@register(aten.native_layer_norm_backward.default)
def layer_norm_backward(call):
    grad_p = _partial_in(call)
    x = call.metas[1]
    kept = x.ndim - len(call.arg(2, "normalized_shape"))
    mask = call.arg(7, "output_mask")
    present = [mask[0], mask[1] and call.arg(5, "weight") is not None, mask[2] and call.arg(6, "bias") is not None]
    n_par = len(call.metas) - 4

    def sig(act, params, outs):
        return Sig(act + (params,) * n_par, tuple(o for o, keep in zip(outs, present) if keep))

    # Split signatures leave weight/bias grads partial (one all-reduce each later), so
    # offer them only where the forward input already was split that way (sequence
    # parallel); otherwise reduce a partial gradient once to B, as Megatron does.
    here = call.actual(1)
    splits = [d for d in range(kept) if not (present[1] or present[2]) or here == Split(d)]
    sigs = [sig((Split(d),) * 4, B, (Split(d), P, P)) for d in splits]
    sigs.append(sig((B,) * 4, B, (B, B, B)))
    if grad_p and not (present[1] or present[2]):
        # With weight/bias gradients, a partial pass-through would leave them partial:
        # one small all-reduce each later, instead of reducing the incoming gradient once.
        sigs.append(sig((P, B, B, B), B, (P, P, P)))
    return sigs


# -- dropout -----------------------------------------------------------------


def _no_partial(sbp) -> tuple:
    return tuple(B if s.is_partial else s for s in sbp)


def _draw(shape, stride, dtype, device, p, generator=None) -> torch.Tensor:
    """The single-device draw: ``bernoulli_(p)`` into a tensor of the global shape and strides."""
    full = torch.empty_strided(shape, stride, dtype=dtype, device=device)
    return full.bernoulli_(p, generator=generator)


def _bernoulli_(self, p=0.5, *, generator=None):
    full = _draw(self.shape, self.stride(), self.dtype, self.device, p, generator)
    me = world_rank()
    if me in self.placement:
        self._local.copy_(take_local(full, self.placement.shape, self.sbp, self.placement.coords(me)))
    return self


def _native_dropout(x, p, train):
    """The mask is the device's own ``native_dropout`` kernel's, run on a contiguous tensor of the global shape:
    CPU's draws ``bernoulli_``; CUDA's fused kernel maps its random numbers to elements (and advances the
    generator) its own way, which ``bernoulli_`` would not reproduce. So the mask is one device's for a
    contiguous input (CUDA's kernel maps a strided one otherwise)."""
    if train is not None and not train:
        return x.clone(), torch.ones_like(x, dtype=torch.bool)
    keep = 1.0 - p
    scale = 0.0 if keep == 0 else 1.0 / keep
    _, full = torch.ops.aten.native_dropout(torch.empty(x.shape, dtype=x.dtype, device=x.device), p, True)
    sbp = _no_partial(x.sbp)
    out = (x * distribute(full.to(x.dtype), x.placement, sbp)).mul_(scale)
    return out, distribute(full, x.placement, sbp)


def _always(call) -> bool:
    return True


def _never_decided(call):
    raise AssertionError(f"{call.func} is always decomposed")


register(aten.bernoulli_.float, decompose=_bernoulli_, decompose_when=_always)(_never_decided)
register(aten.native_dropout.default, decompose=_native_dropout, decompose_when=_always)(_never_decided)


@register(aten.native_dropout_backward.default)
def dropout_backward(call):
    sigs = pointwise(call)
    return sigs + ([Sig((P, B), (P,))] if _partial_in(call) else [])


# -- embedding ---------------------------------------------------------------


def _rows(layout, coords) -> tuple:
    """``(start, length)`` of the global rows (dim 0) this rank holds of ``layout``."""
    return local_box(layout.shape, layout.placement.shape, layout.sbp, coords)[0]


def _embedding_local(func, args, kwargs, ctx):
    weight, ids = args[0], args[1]
    start, n = _rows(ctx.in_layouts[0], ctx.coords)
    if n == ctx.in_layouts[0].shape[0]:
        return func(*args, **kwargs)
    if n == 0:
        return weight.new_zeros(*ids.shape, weight.shape[1])
    hit = (ids >= start) & (ids < start + n)
    out = func(weight, torch.where(hit, ids - start, 0), *args[2:], **kwargs)
    return out.masked_fill_(~hit.unsqueeze(-1), 0)


@register(aten.embedding.default, local=_embedding_local)
def embedding(call):
    w, ids = call.metas[:2]
    sigs = [Sig((B, Split(d)), (Split(d),)) for d in range(ids.ndim)]
    sigs += [Sig((Split(1), B), (Split(ids.ndim),)), Sig((Split(0), B), (P,)), Sig((B, B), (B,))]
    if _partial_in(call):
        sigs.append(Sig((P, B), (P,)))
    return sigs


def _embedding_backward_local(func, args, kwargs, ctx):
    start, n = _rows(ctx.out_layouts[0], ctx.coords)
    if n == ctx.out_layouts[0].shape[0]:
        return func(*args, **kwargs)
    call = Call(func, args, kwargs, [])
    grad, ids, padding_idx, by_freq = args[0], args[1], call.arg(3, "padding_idx"), call.arg(4, "scale_grad_by_freq")
    # Ids outside this rank's rows go to a spare row n, dropped afterwards.
    local_ids = torch.where((ids >= start) & (ids < start + n), ids - start, n)
    pad = padding_idx - start if 0 <= padding_idx - start < n else -1
    return func(grad, local_ids, n + 1, pad, by_freq)[:n]


@register(aten.embedding_dense_backward.default, local=_embedding_backward_local)
def embedding_backward(call):
    g, ids = call.metas[:2]
    by_freq = call.arg(4, "scale_grad_by_freq", False)
    sigs = [] if by_freq else [Sig((Split(d), Split(d)), (P,)) for d in range(ids.ndim)]
    sigs += [Sig((B, B), (Split(0),)), Sig((Split(g.ndim - 1), B), (Split(1),))]
    if _partial_in(call):
        sigs.append(Sig((P, B), (P,)))
    return sigs
