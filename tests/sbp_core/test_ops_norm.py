"""Vector-norm rules (``F.normalize``, ``torch.linalg.vector_norm``) reproduce single-device torch.

Values and input gradients to 1e-5: kept dims split, the reduced dim split
(decomposed into a partial sum of powers), 2 and 3 ranks (uneven) and a 2x2 mesh;
``masked_fill`` (their backward's op), also on a partial sum.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from sbp_core import sbp

from .parity import check_cases as run

R2, R3, M22 = [0, 1], [0, 1, 2], [[0, 1], [2, 3]]
S0, S1 = sbp.split(0), sbp.split(1)
B = sbp.broadcast

g = torch.Generator().manual_seed(3)


def normalize(x):
    return F.normalize(x)


def norm_rows(x):
    return x.norm(2, 1, keepdim=False)


def norm3_all(x):
    return torch.linalg.vector_norm(x, 3)


def masked_fill_of_partial(a, m, mask):
    return (a @ m).masked_fill(mask, 0.0)


def norm_inf_cols(x):
    return torch.linalg.vector_norm(x, float("inf"), dim=0)


def test_vector_norms():
    x = torch.randn(7, 5, generator=g)
    run([
        (normalize, [x], [S0], R3, [S0]),
        (normalize, [x], [B], R2, [B]),
        (normalize, [x], [S1], R3, None),
        (normalize, [x], [(S0, S1)], M22, None),
        (norm_rows, [x], [S0], R2, [S0]),
        (norm_rows, [x], [S1], R2, None),
        (norm3_all, [x], [S1], R3, [B]),
        (norm_inf_cols, [x], [S0], R3, None),
        (norm_inf_cols, [x], [S1], R2, [S0]),
        (masked_fill_of_partial, [x, torch.randn(5, 4, generator=g), torch.rand(7, 1, generator=g) > 0.5],
         [S1, S0, B], R3, [sbp.partial_sum]),
    ])
