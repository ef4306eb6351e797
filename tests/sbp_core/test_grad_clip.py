"""Global-norm clipping over gradients of mixed layouts equals torch's on one device."""
from __future__ import annotations

import pytest
import torch

import sbp_core as sc
from sbp_core import sbp
from toolkit.rank_pool import get_pool

WORLD = 5


def _clip(norm_type):
    p = sc.placement("cpu", [[0, 1], [2, 3]])
    torch.manual_seed(0)
    values = [torch.randn(6, 5) for _ in range(4)]
    grads = [torch.randn(6, 5) * (k + 1) for k in range(4)]
    layouts = [(sbp.split(0), sbp.split(1)), (sbp.broadcast, sbp.broadcast), (sbp.partial_sum, sbp.split(0)), (sbp.split(1), sbp.partial_sum)]
    ref = [torch.nn.Parameter(v.clone()) for v in values]
    for r, g in zip(ref, grads):
        r.grad = g.clone()
    want_norm = torch.nn.utils.clip_grad_norm_(ref, max_norm=1.0, norm_type=norm_type)
    params = []
    for v, g, s in zip(values, grads, layouts):
        q = torch.nn.Parameter(sc.distribute(v, p, s))
        q.grad = sc.distribute(g, p, s)
        params.append(q)
    norm = sc.clip_grad_norm_(params, max_norm=1.0, norm_type=norm_type)
    got = [q.grad.full_tensor() for q in params]
    n = norm.full_tensor()
    if torch.distributed.get_rank() not in p:
        return None
    return (n - want_norm).abs().item() / want_norm.item(), max((a - r.grad).abs().max().item() for a, r in zip(got, ref))


@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
def test_clip_grad_norm_mixed_layouts(norm_type):
    for res in get_pool(WORLD).run(_clip, norm_type)[:4]:
        norm_err, grad_err = res
        assert norm_err < 1e-6 and grad_err < 1e-6
