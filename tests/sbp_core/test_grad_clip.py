"""Global-norm clipping over gradients of mixed layouts equals torch's on one device."""
from __future__ import annotations

import pytest
import torch

import sbp_core as sc
from sbp_core import sbp
from toolkit.rank_pool import get_pool

WORLD = 5


def _clip(norm_type, max_norm=1.0):
    p = sc.placement("cpu", [[0, 1], [2, 3]])
    torch.manual_seed(0)
    values = [torch.randn(6, 5) for _ in range(4)]
    grads = [torch.randn(6, 5) * (k + 1) for k in range(4)]
    layouts = [(sbp.split(0), sbp.split(1)), (sbp.broadcast, sbp.broadcast), (sbp.partial_sum, sbp.split(0)), (sbp.split(1), sbp.partial_sum)]
    ref = [torch.nn.Parameter(v.clone()) for v in values]
    for r, g in zip(ref, grads):
        r.grad = g.clone()
    want_norm = torch.nn.utils.clip_grad_norm_(ref, max_norm=max_norm, norm_type=norm_type)
    params = []
    for v, g, s in zip(values, grads, layouts):
        q = torch.nn.Parameter(sc.distribute(v, p, s))
        q.grad = sc.distribute(g, p, s)
        params.append(q)
    norm = sc.clip_grad_norm_(params, max_norm=max_norm, norm_type=norm_type)
    got = [q.grad.full_tensor() for q in params]
    n = norm.full_tensor()
    if torch.distributed.get_rank() not in p:
        return None
    return (n - want_norm).abs().item() / want_norm.item(), max((a - r.grad).abs().max().item() for a, r in zip(got, ref))


@pytest.mark.parametrize("max_norm", [1.0, 1e6])  # 1e6: above the norm, the gradients stay as they are
@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
def test_clip_grad_norm_mixed_layouts(norm_type, max_norm):
    for res in get_pool(WORLD).run(_clip, norm_type, max_norm)[:4]:
        norm_err, grad_err = res
        assert norm_err < 1e-6 and grad_err < 1e-6


def _clip_two_stages(norm_type):
    """Stage 0's gradients on ranks 0-1, stage 1's on 2-3: every rank clips by the norm over both."""
    stages = [sc.placement("cpu", [0, 1]), sc.placement("cpu", [2, 3])]
    torch.manual_seed(1)
    grads = [torch.randn(4, 3) * 3, torch.randn(5) * 4]  # one per stage
    ref = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for r, g in zip(ref, grads):
        r.grad = g.clone()
    want = torch.nn.utils.clip_grad_norm_(ref, max_norm=1.0, norm_type=norm_type)
    me = torch.distributed.get_rank()
    if me > 3:
        return None
    k = me // 2
    q = torch.nn.Parameter(sc.distribute(torch.zeros_like(grads[k]), stages[k], sbp.split(0)))
    q.grad = sc.distribute(grads[k].clone(), stages[k], sbp.split(0))
    norm = sc.clip_grad_norm_([q], max_norm=1.0, norm_type=norm_type, stages=stages)
    return norm.full_tensor().item(), want.item(), (q.grad.full_tensor() - ref[k].grad).abs().max().item()


@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
def test_clip_grad_norm_over_pipeline_stages(norm_type):
    for got, want, grad_err in get_pool(WORLD).run(_clip_two_stages, norm_type)[:4]:
        assert abs(got - want) <= 1e-6 * want and grad_err < 1e-6


@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
def test_clip_grad_norm_on_one_device_equals_torch(norm_type):
    """One device, any SBP, mixed dtypes, the pipeline's ``stages``: torch's norm and clipped gradients
    (torch's in float32 on the same values: a half gradient's squared sum accumulates in float32)."""
    p = sc.placement("cpu", [0])
    torch.manual_seed(0)
    grads = [torch.randn(6, 5) * 3, torch.randn(7).to(torch.bfloat16), torch.randn(4, 4) * 2]
    ref = [torch.nn.Parameter(torch.zeros_like(g, dtype=torch.float32)) for g in grads]
    for r, g in zip(ref, grads):
        r.grad = g.float().clone()  # torch scales it in place
    want = torch.nn.utils.clip_grad_norm_(ref, max_norm=1.0, norm_type=norm_type)
    params = []
    for g, s in zip(grads, [(sbp.split(0),), (sbp.broadcast,), (sbp.split(1),)]):
        q = torch.nn.Parameter(sc.distribute(torch.zeros_like(g), p, s))
        q.grad = sc.distribute(g.clone(), p, s)
        params.append(q)
    norm = sc.clip_grad_norm_(params, max_norm=1.0, norm_type=norm_type, stages=[p])
    assert norm.placement == p and norm.sbp == (sbp.broadcast,)
    torch.testing.assert_close(norm.full_tensor(), want, rtol=1e-6, atol=0)
    for q, r in zip(params, ref):
        half = q.dtype == torch.bfloat16
        torch.testing.assert_close(q.grad.full_tensor().float(), r.grad, rtol=1e-2 if half else 1e-6, atol=0)
