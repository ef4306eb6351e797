"""Reduction rules (``sbp_core/ops/reductions.py``) reproduce single-device torch.

Values (exactly for bool and integer results: ``parity`` compares dtypes and
values), input gradients to 1e-5 where the op has one, and the output
layout each signature promises: reduced split dims become partial values,
kept ones stay split. 2 and 3 ranks (uneven shards) and a 2x2 mesh.
"""
from __future__ import annotations

import torch

from sbp_core import sbp

from .parity import check_cases as run

R2, R3, M22 = [0, 1], [0, 1, 2], [[0, 1], [2, 3]]
S0, S1 = sbp.split(0), sbp.split(1)
B = sbp.broadcast

g = torch.Generator().manual_seed(5)


def total(x):
    return x.sum(), x.mean(1)


def maximum(x):
    return x.max()


def minimum_cols(x):
    return x.amin(0)


def any_positive(x):
    return (x > 0.5).any(), (x > 0.5).any(1)


def all_positive(x):
    return (x > -2).all(), (x > -0.5).all(0, keepdim=True)


def argmax_rows(x):
    return x.argmax(1), x.argmin(0)


def running_sum_rows(x):
    return x.cumsum(1)


def running_sum_of_partial(a, m):
    return (a @ m).cumsum(1)


def count_over_rows(i):
    return i.cumsum(0), (i == 2).sum(), i.amax()


def test_reductions_match_one_device():
    x = torch.randn(7, 5, generator=g)
    a, m = torch.randn(6, 4, generator=g), torch.randn(4, 5, generator=g)
    ints = torch.randint(0, 4, (7, 5), generator=g, dtype=torch.int16)
    pmax = sbp.partial_max
    run([
        (total, [x], [S0], R3, [sbp.partial_sum, S0]),
        (maximum, [x], [S1], R3, [pmax]),
        (maximum, [x], [(S0, S1)], M22, [(pmax, pmax)]),
        (minimum_cols, [x], [S0], R2, [sbp.partial_min]),
        (any_positive, [x], [S0], R3, [pmax, S0], False),
        (any_positive, [x], [S1], R3, [pmax, pmax], False),
        (all_positive, [x], [S1], R2, [sbp.partial_min, S1], False),
        (all_positive, [x], [(S0, S1)], M22, None, False),
        (argmax_rows, [x], [S0], R3, [S0, None], False),  # argmin over the split dim: boxed first
        (argmax_rows, [x], [S1], R3, None, False),
        (argmax_rows, [x], [B], R2, [B, B], False),
        (running_sum_rows, [x], [S0], R3, [S0]),
        (running_sum_rows, [x], [S1], R3, None),  # along the split dim: boxed first
        (running_sum_of_partial, [a, m], [S1, S0], R2, [sbp.partial_sum]),
        (count_over_rows, [ints], [S1], R3, [S1, sbp.partial_sum, pmax], False),
        (count_over_rows, [ints], [S0], R3, None, False),
    ])
