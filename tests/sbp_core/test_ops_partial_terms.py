"""A partial value's terms, and the partial products of a contraction over a split dim, count once.

Ops that add something to such a value (a bias after a row-parallel
matmul, a scalar, a non-zero fill) must add it to one term only, or box
first; ops that read a ``P(max)`` value's terms (``any``) must not see the
identity the other ranks hold (``-inf``, which is non-zero). Values and
gradients against one device, and the layouts that keep partial values
lazy where that is exact. Partial inputs made inside the function (a sum
over a split dim) give every rank a real term, where ``distribute``'s
partial inputs leave zeros (or ``-inf``) beside the value. 2 and 3 ranks.
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


def made_from(x):
    return x + x.new_ones(x.shape) + x.new_full(x.shape, 0.5)  # new tensors of a partial value are not partial


def zeros_like_split(x):
    return x.new_zeros(x.shape)


def joined_with_legacy_empty(x, e):
    return torch.cat([x, e], 0)


def joined_with_partial(a, b):
    return torch.cat([a, b], 1)


def index_add_of_maxima(a, i, s):
    return a.amax(2).index_add(0, i, s.amax(2))  # P(max) terms that are not the identity elsewhere


def scattered_fill(x, idx):
    return x.scatter(1, idx, 1.5)


def pooled_sum(a):
    return F.max_pool2d(a.sum(0), 2)  # every rank's term is non-zero


def test_new_tensors_joins_scatters_and_pools_of_partial_values():
    x = torch.randn(4, 6, generator=g)
    idx = torch.stack([torch.randperm(6, generator=g)[:3] for _ in range(4)])
    run([
        (made_from, [torch.randn(4, 3, generator=g)], [P], R2, None, False),
        (zeros_like_split, [torch.randn(4, 3, generator=g)], [S0], R3, [S0], False),  # autograd's buffers stay split
        (joined_with_legacy_empty, [torch.randn(3, 4, generator=g), torch.empty(0)], [S1, B], R2, [S1], False),
        (joined_with_partial, [torch.randn(3, 4, generator=g), torch.randn(3, 2, generator=g)], [B, P], R2, [P]),
        (index_add_of_maxima, [torch.randn(5, 4, 3, generator=g), torch.tensor([4, 0, 2]),
                               torch.randn(3, 4, 3, generator=g)], [S2, B, S2], R3, None, False),
        (scattered_fill, [x, idx], [P, B], R2, None, False),
        (pooled_sum, [torch.randn(3, 2, 2, 4, 4, generator=g)], [S0], R3, None, False),
    ])


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
