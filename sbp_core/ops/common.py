"""Building blocks shared by the rule files."""
from __future__ import annotations

from ..sbp import Broadcast, Partial, Split
from .registry import Sig

B = Broadcast()
P = Partial("sum")
PMAX = Partial("max")
PMIN = Partial("min")


def every_sbp(ndim: int) -> list:
    """All 1-d SBPs a tensor of ``ndim`` dims can have."""
    return [Split(d) for d in range(ndim)] + [B, P, PMAX, PMIN]


def split_or_broadcast(call, n_out: int = 1) -> list:
    """``S(d) -> S(d)`` for every dim and ``B -> B`` (ops that act row by row on any dim)."""
    nd = call.metas[0].ndim
    return [Sig((Split(d),) * len(call.metas), (Split(d),) * n_out) for d in range(nd)] + [
        Sig((B,) * len(call.metas), (B,) * n_out)
    ]
