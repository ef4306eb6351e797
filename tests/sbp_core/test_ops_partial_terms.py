"""A partial value's terms, and the partial products of a contraction over a split dim, count once.

Ops that add something to such a value (a bias after a row-parallel
matmul, a scalar, a non-zero fill) must add it to one term only, or box
first; ops that read a ``P(max)`` value's terms (``any``) must not see the
identity the other ranks hold (``-inf``, which is non-zero). Values and
gradients against one device, and the layouts that keep partial values
lazy where that is exact. 2 and 3 ranks.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from sbp_core import sbp

from .parity import check_cases as run

R2, R3 = [0, 1], [0, 1, 2]
S0, S1, S2 = sbp.split(0), sbp.split(1), sbp.split(2)
B, P, PMAX = sbp.broadcast, sbp.partial_sum, sbp.partial_max

g = torch.Generator().manual_seed(17)


def row_parallel_linear(x, w, b):
    return F.linear(x, w, b)


def batched_contraction(a, b):
    return torch.bmm(a, b)


def shifted(x):
    return x + 2, x - 1, 3 - x


def filled(x, m):
    return x.masked_fill(m, 1.5), x.masked_fill(m, 0.0)


def any_nonzero(x):
    return x.any(1), x.any()


def test_partial_terms_count_once():
    x, w, b = torch.randn(6, 4, generator=g), torch.randn(5, 4, generator=g), torch.randn(5, generator=g)
    a, c = torch.randn(3, 4, 6, generator=g), torch.randn(3, 6, 2, generator=g)
    v = torch.randn(5, 4, generator=g)
    mask = torch.rand(5, 4, generator=g) > 0.5
    zeros_in_rows = torch.tensor([[0.0, 0.0, 0.0], [0.0, -2.0, 0.0], [0.0, 0.0, 0.0]])
    run([
        (row_parallel_linear, [x, w, b], [S1, S1, B], R2, [P]),  # Megatron's row-parallel layer: bias added once
        (row_parallel_linear, [x, w, b], [S1, S1, B], R3, None),
        (batched_contraction, [a, c], [S2, S1], R2, [P]),
        (batched_contraction, [a, c], [S2, S1], R3, None),
        (shifted, [v], [P], R2),
        (shifted, [v], [P], R3),
        (filled, [v, mask], [P, B], R2, [None, P]),  # a zero fill keeps the terms: still partial
        (filled, [v, mask], [P, B], R3),
        (any_nonzero, [zeros_in_rows], [PMAX], R2, None, False),
        (any_nonzero, [zeros_in_rows], [PMAX], R3, None, False),
    ])
