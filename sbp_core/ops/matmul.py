"""Matrix products: docs/design.md's MatMul table, for ``mm``, ``addmm`` and ``bmm``.

``Y = X W`` on one mesh axis::

    S(0), B    -> S(0)      rows of X
    B,    S(1) -> S(1)      columns of W
    S(1), S(0) -> P(sum)    the contracted dim: partial sums
    P,    B    -> P         linear in X
    B,    P    -> P         linear in W
    B,    B    -> B

``addmm(bias, X, W)`` adds a bias laid out like one row of Y (``B`` for
``S(0)``, ``S(0)`` for ``S(1)``, and ``P`` — the first rank's copy — for a
partial result). ``bmm`` shifts the table by the batch dim, plus
``S(0), S(0) -> S(0)`` over the batch.
"""
from __future__ import annotations

import torch

from ..sbp import Split
from .common import B, P
from .registry import Sig, register

aten = torch.ops.aten

S0, S1, S2 = Split(0), Split(1), Split(2)


@register(aten.mm.default)
def mm(call):
    return [
        Sig((S0, B), (S0,)), Sig((B, S1), (S1,)), Sig((S1, S0), (P,)),
        Sig((P, B), (P,)), Sig((B, P), (P,)), Sig((B, B), (B,)),
    ]


@register(aten.addmm.default)
def addmm(call):
    bias_nd = call.metas[0].ndim
    col = S1 if bias_nd == 2 else S0  # bias [n] or [m, n] split along n
    row_bias = S0 if bias_nd == 2 and call.metas[0].shape[0] > 1 else B
    return [
        Sig((row_bias, S0, B), (S0,)), Sig((col, B, S1), (S1,)), Sig((P, S1, S0), (P,)),
        Sig((P, P, B), (P,)), Sig((P, B, P), (P,)), Sig((B, B, B), (B,)),
    ]


@register(aten.bmm.default)
def bmm(call):
    return [
        Sig((S0, S0), (S0,)), Sig((S1, B), (S1,)), Sig((B, S2), (S2,)), Sig((S2, S1), (P,)),
        Sig((P, B), (P,)), Sig((B, P), (P,)), Sig((B, B), (B,)),
    ]
