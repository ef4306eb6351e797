"""Ops that make a tensor like another, copy into one, or fill one.

- ``*_like``: the input's layout, with partial replaced by ``B`` (ones,
  a fill value or noise are not partial terms of anything).
- ``zero_`` keeps any layout; ``fill_`` keeps split/broadcast ones.
- ``copy_(self, src)``: ``src`` is boxed to ``self``'s layout.
"""
from __future__ import annotations

import torch

from ..sbp import Split
from .common import B, P, every_sbp
from .registry import Sig, register

aten = torch.ops.aten


@register(aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default,
          aten.full_like.default, aten.rand_like.default, aten.randn_like.default)
def like(call):
    nd = call.metas[0].ndim
    return [Sig((Split(d),), (Split(d),)) for d in range(nd)] + [Sig((B,), (B,)), Sig((P,), (B,))]


@register(aten.zero_.default)
def zero_(call):
    return [Sig((s,), (s,)) for s in every_sbp(call.metas[0].ndim)]


@register(aten.fill_.Scalar)
def fill_(call):
    nd = call.metas[0].ndim
    return [Sig((Split(d),), (Split(d),)) for d in range(nd)] + [Sig((B,), (B,))]


@register(aten.copy_.default)
def copy_(call):
    return [Sig((s, s), (s,)) for s in every_sbp(call.metas[0].ndim)]
