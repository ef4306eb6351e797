"""Element-wise ops (``torch.Tag.pointwise``), with broadcasting.

On each mesh axis:

- ``S(d)`` on the output dim ``d``: inputs that have that dim (size > 1)
  are ``S`` on it, inputs broadcast along it are ``B``;
- all ``B`` -> ``B``;
- partial sums pass through ops that are linear in their partial inputs
  (offered only where an input is partial on that axis):
  ``P + P``, ``P - P``, ``P * B``, ``B * P``, ``P / B``, ``-P``, ``lerp(P, P)``,
  ``where(B, P, P)``, casts and copies. An op with a plain number added to
  a partial value is not linear that way and gets no ``P`` signature.
- ``masked_fill(x, mask, value)`` (and in place; untagged in aten, reached by
  norm backwards): element-wise with ``mask`` broadcast; ``(P, B) -> P`` when
  ``value`` is 0.
"""
from __future__ import annotations

import torch

from ..sbp import Split
from .common import B, P
from .registry import Sig, register, register_tag

aten = torch.ops.aten

# Ops linear in all their (global) inputs at once.
_ALL_PARTIAL = {
    aten.add.Tensor, aten.add_.Tensor, aten.sub.Tensor, aten.sub_.Tensor,
    aten.neg.default, aten.neg_.default, aten.lerp.Scalar, aten.lerp_.Scalar,
    aten.mul.Scalar, aten.mul_.Scalar, aten.div.Scalar, aten.div_.Scalar,
    aten.clone.default, aten.alias.default, aten.detach.default, aten._to_copy.default,
}
# Binary ops whose P signature needs both operands global: ``P + 2`` would add 2 on every rank.
_BINARY = {aten.add.Tensor, aten.add_.Tensor, aten.sub.Tensor, aten.sub_.Tensor, aten.lerp.Scalar, aten.lerp_.Scalar}
_ONE_PARTIAL = {aten.mul.Tensor, aten.mul_.Tensor}  # P * B, B * P
_FIRST_PARTIAL = {aten.div.Tensor, aten.div_.Tensor}  # P / B
_WHERE = {aten.where.self}  # where(B, P, P)


def pointwise(call) -> list:
    metas = call.metas
    out_nd = max(m.ndim for m in metas)
    out_shape = torch.broadcast_shapes(*(m.shape for m in metas))
    sigs = []
    for d in range(out_nd):
        if out_shape[d] == 1:
            continue
        ins = []
        for m in metas:
            k = d - (out_nd - m.ndim)
            ins.append(Split(k) if k >= 0 and m.shape[k] == out_shape[d] else B)
        sigs.append(Sig(tuple(ins), (Split(d),)))
    sigs.append(Sig((B,) * len(metas), (B,)))
    f = call.func
    if not call.partial_here():
        # S -> P and B -> P are free, so an unneeded P signature would win ties and
        # leave the result partial; offer P only where an input already is.
        return sigs
    if f in _ALL_PARTIAL and (f not in _BINARY or len(metas) == 2):
        sigs.append(Sig((P,) * len(metas), (P,)))
    elif f in _ONE_PARTIAL:
        if len(metas) == 2:
            sigs += [Sig((P, B), (P,)), Sig((B, P), (P,))]
        else:
            sigs.append(Sig((P,), (P,)))  # times a plain number
    elif f in _FIRST_PARTIAL:
        sigs.append(Sig((P, B), (P,)) if len(metas) == 2 else Sig((P,), (P,)))
    elif f in _WHERE and len(metas) == 3:
        sigs.append(Sig((B, P, P), (P,)))
    return sigs


register_tag(torch.Tag.pointwise, pointwise)
register(aten.clone.default, aten.alias.default, aten.detach.default, aten._to_copy.default,
         aten.where.ScalarSelf, aten.where.ScalarOther)(pointwise)


@register(aten.masked_fill.Scalar, aten.masked_fill_.Scalar)
def _masked_fill(call):
    sigs = pointwise(call)
    if call.partial_here(0) and not call.partial_here(1) and call.arg(2, "value") == 0:
        sigs.append(Sig((P, B), (P,)))
    return sigs
