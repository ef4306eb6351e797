"""Softmax and cross-entropy rules, incl. over a split class axis, reproduce single-device torch.

Forward and input gradients to 1e-5 on 2 and 3 ranks (uneven) and a 2x2
mesh with ``(S(0) batch, S(1) vocab)`` logits; plus the model-parallel
loss's traffic: only ``[N, 1]``-sized reductions, never the logits.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

import sbp_core as sc
from sbp_core import sbp
from toolkit.rank_pool import get_pool

from . import parity
from .parity import check_cases as run

R2, R3, M22 = [0, 1], [0, 1, 2], [[0, 1], [2, 3]]
S0, S1, S2 = sbp.split(0), sbp.split(1), sbp.split(2)
B, P = sbp.broadcast, sbp.partial_sum
BB = (B, B)

g = torch.Generator().manual_seed(1)


def rnd(*shape):
    return torch.randn(*shape, generator=g)


def targets(high, *shape):
    return torch.randint(0, high, shape, generator=g)


# -- softmax ---------------------------------------------------------------------


def log_softmax(x):
    return F.log_softmax(x, dim=-1)


def softmax(x):
    return F.softmax(x, dim=1)


def softmax_dim0(x):
    return torch.softmax(x, 0)


def safe_softmax(x):
    return torch.ops.aten._safe_softmax(x, -1)


def test_softmax():
    x = rnd(7, 10)
    masked = x.clone()
    masked[2] = float("-inf")  # a fully masked row gives zeros
    masked[4, :6] = float("-inf")
    run([
        (log_softmax, [x], [S1], R2, [S1]),
        (log_softmax, [x], [S1], R3, [S1]),
        (log_softmax, [x], [S0], R3, [S0]),
        (log_softmax, [x], [(S0, S1)], M22, [(S0, S1)]),
        (softmax, [x], [S1], R3, [S1]),
        (softmax, [x], [B], R2, [B]),
        (softmax_dim0, [x], [S0], R3, [S0]),
        (softmax_dim0, [x], [(S1, S0)], M22, [(S1, S0)]),
        (safe_softmax, [masked], [S1], R3, [S1]),
        (safe_softmax, [masked], [S0], R2, [S0]),
    ])


# -- cross-entropy / nll -----------------------------------------------------------


def cross_entropy(x, t):
    return F.cross_entropy(x, t)


def cross_entropy_sum(x, t):
    return F.cross_entropy(x, t, reduction="sum")


def cross_entropy_none(x, t):
    return F.cross_entropy(x, t, reduction="none")


def cross_entropy_ignore2(x, t):
    return F.cross_entropy(x, t, ignore_index=2)


def cross_entropy_weighted(x, t, w):
    return F.cross_entropy(x, t, weight=w.detach())


def cross_entropy_weighted_none(x, t, w):
    return F.cross_entropy(x, t, weight=w.detach(), reduction="none")


def gpt_loss(x, t):  # [B, T, V] logits flattened like HF's GPT-2
    return F.cross_entropy(x.view(-1, x.shape[-1]), t.view(-1))


def cross_entropy_nd(x, t):  # [N, C, d] -> nll_loss2d
    return F.cross_entropy(x, t)


def nll_of_partial(a, m, t):
    return F.nll_loss(a @ m, t, reduction="sum")


def test_cross_entropy():
    x, t, w = rnd(7, 10), targets(10, 7), rnd(10).abs()
    t_ign = t.clone()
    t_ign[[1, 5]] = -100
    t_ign[3] = 2
    t_ign2 = t.clone()
    t_ign2[[0, 3, 6]] = 2
    run([
        (cross_entropy, [x, t], [S0, S0], R3, [P]),
        (cross_entropy, [x, t_ign], [S0, S0], R2, [P]),
        (cross_entropy, [x, t], [S1, B], R2, [P]),
        (cross_entropy, [x, t_ign], [S1, B], R3, [P]),
        (cross_entropy, [x, t], [B, B], R2, [B]),
        (cross_entropy_ignore2, [x, t_ign2], [S1, B], R3, [P]),
        (cross_entropy_ignore2, [x, t_ign2], [S0, S0], R3, [P]),
        (cross_entropy_sum, [x, t_ign], [S1, B], R3, [P]),
        (cross_entropy_none, [x, t_ign], [S0, S0], R3, [S0]),
        (cross_entropy_none, [x, t_ign], [S1, B], R2, [P]),
        (cross_entropy_weighted, [x, t_ign, w], [S1, B, S0], R3, [P]),
        (cross_entropy_weighted, [x, t_ign, w], [S0, S0, B], R2, [P]),
        (cross_entropy_weighted_none, [x, t_ign, w], [S1, B, S0], R3, [P]),
        # dp x tp: batch split on mesh axis 0, vocab split on axis 1.
        (cross_entropy, [x, t_ign], [(S0, S1), (S0, B)], M22, [(P, P)]),
        (cross_entropy_none, [x, t_ign], [(S0, S1), (S0, B)], M22, [(S0, P)]),
        (gpt_loss, [rnd(2, 4, 10), targets(10, 2, 4)], [S2, B], R3, [P]),
        (gpt_loss, [rnd(2, 4, 10), targets(10, 2, 4)], [(S0, S2), (S0, B)], M22, [(P, P)]),
        (cross_entropy_nd, [rnd(4, 10, 3), targets(10, 4, 3)], [S0, S0], R3, None),
        (cross_entropy_nd, [rnd(4, 10, 3), targets(10, 4, 3)], [S1, B], R2, None),
        (nll_of_partial, [rnd(7, 5), rnd(5, 10), t_ign], [S1, S0, B], R3, None),
    ])


def bce(x, y):
    return F.binary_cross_entropy_with_logits(x, y)


def bce_sum_weighted(x, y, w, pw):
    return F.binary_cross_entropy_with_logits(x, y, weight=w.detach(), pos_weight=pw.detach(), reduction="sum")


def bce_none(x, y):
    return F.binary_cross_entropy_with_logits(x, y, reduction="none")


def test_binary_cross_entropy_with_logits():
    x, y = rnd(7, 3), torch.rand(7, 3, generator=g)
    w, pw = rnd(7, 1).abs(), rnd(3).abs()
    run([
        (bce, [x, y], [S0, S0], R3, [P]),
        (bce, [x, y], [S1, S1], R2, [P]),
        (bce, [x, y], [B, B], R2, [B]),
        (bce, [x, y], [(S0, S1), (S0, S1)], M22, [(P, P)]),
        (bce_sum_weighted, [x, y, w, pw], [S0, S0, S0, B], R3, [P]),
        (bce_sum_weighted, [x, y, w, pw], [S1, S1, B, S0], R2, [P]),
        (bce_none, [x, y], [S0, S0], R3, [S0]),
    ])


def mse(x, y):
    return F.mse_loss(x, y)


def mse_sum(x, y):
    return F.mse_loss(x, y, reduction="sum")


def smooth_l1(x, y):
    return F.smooth_l1_loss(x, y, beta=0.5)


def huber_none(x, y):
    return F.huber_loss(x, y, reduction="none", delta=0.7)


def logsumexp_rows(x):
    return torch.logsumexp(x, 1), torch.logsumexp(x, (0, 1), keepdim=True)


def logsumexp_of_partial(a, m):
    return torch.logsumexp(a @ m, 0)


def test_regression_losses_and_logsumexp():
    x, y = rnd(7, 3), rnd(7, 3)
    with_inf = rnd(7, 5)
    with_inf[2] = float("-inf")  # a row whose max is infinite: shifted by 0, as torch shifts it
    with_inf[4, 1] = float("-inf")
    run([
        (mse, [x, y], [S0, S0], R3, [P]),
        (mse, [x, y], [(S0, S1), (S0, S1)], M22, [(P, P)]),
        (mse_sum, [x, y], [S1, S1], R2, [P]),
        (mse, [x, y], [B, B], R2, [B]),
        (smooth_l1, [x, y], [S0, S0], R3, [P]),
        (smooth_l1, [x, y], [S1, B], R2, None),
        (huber_none, [x, y], [S0, S0], R3, [S0]),
        (logsumexp_rows, [rnd(7, 5)], [S0], R3, [S0, B]),  # over every dim: decomposed
        (logsumexp_rows, [rnd(7, 5)], [S1], R3, [B, B]),  # over the split dim: decomposed
        (logsumexp_rows, [rnd(7, 5)], [(S0, S1)], M22, None),
        (logsumexp_rows, [with_inf], [S1], R2, None, False),
        (logsumexp_of_partial, [rnd(6, 4), rnd(4, 5)], [S1, S0], R2, None),
    ])


def _vocab_parallel_traffic(n, v):
    p = sc.placement("cpu", [0, 1, 2])
    torch.manual_seed(0)
    logits = sc.randn(n, v, placement=p, sbp=S1, requires_grad=True)
    t = sc.distribute(torch.randint(0, v, (n,)), p, B)
    with sc.comm_ledger() as ledger:
        loss = F.cross_entropy(logits, t)
        loss.backward()
    if torch.distributed.get_rank() not in p:
        return None
    return [(r.op, r.bytes) for r in ledger.records], logits.grad.sbp


def test_vocab_parallel_loss_communicates_only_row_reductions():
    n, v = 16, 3000
    out = get_pool(parity.WORLD).run(_vocab_parallel_traffic, n, v)
    for rank in range(3):
        records, grad_sbp = out[rank]
        assert grad_sbp == (S1,)
        assert records, "the loss must reduce across the vocab shards"
        row = n * 4  # one fp32 value per row: [N, 1]
        assert all(nbytes <= 2 * row for _, nbytes in records), records
        assert sum(nbytes for _, nbytes in records) < n * v * 4 / 50, records


def _one_device_axis():
    """Cross-entropy with the class dim split over a mesh axis of one device, rows over two."""
    p = sc.placement("cpu", [[0], [1]])  # mesh (2, 1)
    x, t = rnd(6, 10), targets(10, 6)
    gx = sc.distribute(x, p, (S0, S1)).requires_grad_(True)
    gt = sc.distribute(t, p, (S0, B))
    with sc.explain() as steps:
        loss = F.cross_entropy(gx, gt)
        loss.backward()
    want = x.clone().requires_grad_(True)
    ref = F.cross_entropy(want, t)
    ref.backward()
    if torch.distributed.get_rank() not in p:
        return None
    return ([s[0] for s in steps if s[2] == "decomposed"], (loss.full_tensor() - ref).abs().item(),
            (gx.grad.full_tensor() - want.grad).abs().max().item())


def test_a_split_over_one_device_is_no_model_parallel_loss():
    """S on a mesh axis of one device is the whole tensor: the plain log-softmax, no decomposition."""
    for res in get_pool(parity.WORLD).run(_one_device_axis)[:2]:
        decomposed, loss_err, grad_err = res
        assert not any("softmax" in op for op in decomposed), decomposed
        assert loss_err < 1e-6 and grad_err < 1e-6, (loss_err, grad_err)
