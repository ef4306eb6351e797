"""Reduction rules (``sbp_core/ops/reductions.py``) and ``roll``/``repeat``/``flip`` reproduce single-device torch.

Values (exactly for bool and integer results: ``parity`` compares dtypes and
values), input gradients to 1e-5 where the op has one, and the output
layout each signature promises: reduced split dims become partial values,
kept ones stay split. 2 and 3 ranks (uneven shards) and a 2x2 mesh.
The gradients of ``max``/``min`` over a dim, ``topk`` and ``sort`` rely,
before torch 2.13, on ``sbp_core.torch_compat``'s replacement of their
backward kernel.
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


def variance(x):
    return x.var(0), x.std(1, correction=0, keepdim=True), x.var()


def extremum_rows(x):
    values, indices = x.max(1)
    low, where = x.min(0, keepdim=True)
    return values, indices, low, where


def top_and_sorted(x):
    top, at = x.topk(2, dim=1)
    ordered, order = x.sort(0, descending=True)
    return top, at, ordered, order


def order_statistics(x):  # median and nanmedian over a dim, kthvalue, mode: values and indices
    mid, at = x.median(1)
    nan_mid, nan_at = x.nanmedian(0, keepdim=True)
    second, where = x.kthvalue(2, 1)
    return mid, at, nan_mid, nan_at, second, where, x.median() * 2


def most_common(i):  # integer rows with repeats, so that ``mode`` has a choice to make
    return i.mode(1)


def log_running_sum(x):
    return x.logcumsumexp(1)


def counts(x):
    return torch.count_nonzero(x > 0, 0), torch.count_nonzero(x > 0)


def rolled_and_repeated(x):
    return x.roll(2, 1), x.roll(1), x.repeat(2, 1, 1), x.repeat(1, 3)


def rolled_partial(a, m):
    return (a @ m).roll(1, 0).repeat(2, 1)


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


def test_variance_extrema_sorting_and_moves_match_one_device():
    x = torch.randn(7, 5, generator=g)
    a, m = torch.randn(6, 4, generator=g), torch.randn(4, 5, generator=g)
    ints = torch.randint(0, 3, (7, 5), generator=g)
    part = sbp.partial_sum
    run([
        (variance, [x], [S1], R3, [S0, None, part]),  # var over the split dim 0: decomposed, P(sum) left
        (variance, [x], [S0], R3, None),  # std over rows of a split batch: S(0) kept
        (variance, [x], [(S0, S1)], M22, None),
        (extremum_rows, [x], [S0], R3, [S0, S0, None, None]),
        (extremum_rows, [x], [S1], R2, None),
        (top_and_sorted, [x], [S0], R3, [S0, S0, None, None]),
        (top_and_sorted, [x], [S1], R3, None),
        (order_statistics, [x], [S0], R3, [S0, S0, None, None, S0, S0, B]),
        (order_statistics, [x], [S1], R3, [None, None, S1, S1, None, None, B]),
        (order_statistics, [x], [(S0, S1)], M22, None),
        (most_common, [ints], [S0], R3, [S0, S0], False),
        (most_common, [ints], [S1], R2, None, False),
        (log_running_sum, [x], [S0], R3, [S0]),
        (log_running_sum, [x], [S1], R2, None),  # along the split dim: boxed first
        (log_running_sum, [a @ m], [part], R2, None),
        (counts, [x], [S0], R3, [part, part], False),
        (counts, [x], [S1], R2, [sbp.split(0), part], False),
        (rolled_and_repeated, [x], [S0], R3, [S0, None, sbp.split(1), None]),
        (rolled_and_repeated, [x], [S1], R2, [None, None, None, None]),
        (rolled_partial, [a, m], [S1, S0], R2, [part]),
    ])
