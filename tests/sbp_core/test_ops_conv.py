"""Convolution, batch norm, pooling, PReLU and embedding-bag rules reproduce single-device torch.

Values and input gradients to 1e-5 on 2 and 3 ranks (uneven) and a 2x2 mesh;
batch norm's running statistics are compared too (SyncBatchNorm semantics).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sbp_core import GlobalTensor, sbp

from .parity import check_cases as run

R2, R3, M22 = [0, 1], [0, 1, 2], [[0, 1], [2, 3]]
S0, S1, S2 = sbp.split(0), sbp.split(1), sbp.split(2)
B, P = sbp.broadcast, sbp.partial_sum
BB = (B, B)

g = torch.Generator().manual_seed(2)


def rnd(*shape):
    return torch.randn(*shape, generator=g)


# -- convolution -----------------------------------------------------------------


def conv(x, w, b):
    return F.conv2d(x, w, b, padding=1)


def conv_strided_no_bias(x, w):
    return F.conv2d(x, w, stride=2)


def conv_grouped(x, w, b):
    return F.conv2d(x, w, b, padding=1, groups=2)


def conv_transpose(x, w, b):
    return F.conv_transpose2d(x, w, b, stride=2)


def conv_then_column_parallel(x, w, m):
    # conv's output gradient comes back P from the mm with a column-split m.
    return F.conv2d(x, w).flatten(1) @ m


def test_convolution():
    x, w, b = rnd(5, 4, 6, 6), rnd(6, 4, 3, 3), rnd(6)
    wt, bt = rnd(4, 3, 3, 3), rnd(3)
    run([
        (conv, [x, w, b], [S0, B, B], R3, [S0]),
        (conv, [x, w, b], [B, S0, S0], R2, [S1]),
        (conv, [x, w, b], [B, S0, S0], R3, [S1]),
        (conv, [x, w, b], [S1, S1, B], R3, [P]),
        (conv, [x, w, b], [B, B, B], R2, [B]),
        (conv, [x, w, b], [(S0, B), (B, S0), (B, S0)], M22, [(S0, S1)]),
        (conv_strided_no_bias, [x, w], [S0, B], R2, [S0]),
        (conv_strided_no_bias, [x, w], [S1, S1], R2, [P]),
        (conv_grouped, [x, rnd(6, 2, 3, 3), b], [S0, B, B], R3, [S0]),
        (conv_transpose, [x, wt, bt], [S0, B, B], R3, [S0]),
        (conv_transpose, [x, wt, bt], [B, S1, S0], R2, [S1]),
        (conv_transpose, [x, wt, bt], [S1, S0, B], R2, [P]),
        (conv_then_column_parallel, [rnd(3, 2, 5, 5), rnd(4, 2, 3, 3), rnd(36, 5)], [B, B, S1], R3, [S1]),
    ])


# -- batch norm ------------------------------------------------------------------


def batch_norm_train(x, w, b, rm, rv):
    rm, rv = rm.detach(), rv.detach()  # updated in place, like BatchNorm2d's buffers
    out = F.batch_norm(x, rm, rv, w, b, training=True, momentum=0.3)
    return out, rm * 1.0, rv * 1.0


def batch_norm_eval(x, w, b, rm, rv):
    return F.batch_norm(x, rm.detach(), rv.detach(), w, b, training=False)


def batch_norm_no_affine(x):
    return F.batch_norm(x, None, None, training=True)


def batch_norm_as_on_cuda(x, w, b, rm, rv):
    """cuDNN's op, which ``F.batch_norm`` calls on a CUDA input, in training; the single-device reference
    (plain CPU tensors, where cuDNN's op has no kernel) takes the native op it must equal."""
    rm, rv = rm.detach(), rv.detach()
    op = torch.ops.aten.cudnn_batch_norm if isinstance(x, GlobalTensor) else torch.ops.aten.native_batch_norm
    return op(x, w, b, rm, rv, True, 0.3, 1e-5)[0], rm * 1.0, rv * 1.0


def test_batch_norm():
    x, w, b = rnd(7, 3, 4, 5), rnd(3), rnd(3)
    rm, rv = rnd(3), rnd(3).abs() + 0.5
    stats = [x, w, b, rm, rv]
    run([
        (batch_norm_train, stats, [S0, B, B, B, B], R3, [S0, B, B]),
        (batch_norm_train, stats, [S0, B, B, B, B], R2, [S0, B, B]),
        (batch_norm_train, stats, [S2, B, B, B, B], R3, [S2, B, B]),
        (batch_norm_train, stats, [S1, S0, S0, S0, S0], R3, [S1, S0, S0]),
        (batch_norm_train, stats, [B, B, B, B, B], R2, [B, B, B]),
        (batch_norm_train, stats, [(S0, S1)] + [(B, S0)] * 4, M22, [(S0, S1), (B, S0), (B, S0)]),
        (batch_norm_eval, stats, [S0, B, B, B, B], R3, [S0]),
        (batch_norm_eval, stats, [S1, S0, S0, S0, S0], R2, [S1]),
        (batch_norm_no_affine, [x], [S0], R3, [S0]),
        (batch_norm_as_on_cuda, stats, [S0, B, B, B, B], R3, [S0, B, B]),
        (batch_norm_as_on_cuda, stats, [S1, S0, S0, S0, S0], R2, [S1, S0, S0]),
    ])


# -- pooling ---------------------------------------------------------------------


def max_pool(x):
    return F.max_pool2d(x, 2)


def max_pool_padded(x):
    return F.max_pool2d(x, 3, stride=2, padding=1)


def avg_pool(x):
    return F.avg_pool2d(x, 3, stride=2, padding=1)


def adaptive_pool(x):
    return F.adaptive_avg_pool2d(x, (2, 3))


def global_pool(x):
    return F.adaptive_avg_pool2d(x, 1)


def avg_pool_of_partial(x, w):
    return F.avg_pool2d(F.conv2d(x, w), 2)


def test_pooling():
    x = rnd(5, 3, 6, 7)
    run([
        (max_pool, [x], [S0], R3, [S0]),
        (max_pool_padded, [x], [S1], R2, [S1]),
        (max_pool, [x], [(S0, S1)], M22, [(S0, S1)]),
        (avg_pool, [x], [S0], R2, [S0]),
        (avg_pool, [x], [S1], R3, [S1]),
        (adaptive_pool, [x], [S0], R3, [S0]),
        (adaptive_pool, [x], [(S1, S0)], M22, [(S1, S0)]),
        (global_pool, [x], [S1], R3, [S1]),
        (avg_pool_of_partial, [x, rnd(4, 3, 3, 3)], [S1, S1], R3, [P]),
    ])


# -- PReLU ------------------------------------------------------------------------


def prelu(x, w):
    return F.prelu(x, w)


def prelu_then_column_parallel(x, w, m):
    # prelu's output gradient comes back P from the mm with a column-split m.
    return F.prelu(x, w).flatten(1) @ m


def test_prelu():
    x, w = rnd(5, 4, 3, 3), rnd(4).abs() * 0.25
    run([
        (prelu, [x, w], [S0, B], R3, [S0]),
        (prelu, [x, w], [S1, S0], R2, [S1]),
        (prelu, [x, w], [S2, B], R3, [S2]),
        (prelu, [x, w], [B, B], R2, [B]),
        (prelu, [x, w], [(S0, S1), (B, S0)], M22, [(S0, S1)]),
        (prelu_then_column_parallel, [x, w, rnd(36, 6)], [B, B, S1], R3, [S1]),
    ])


# -- embedding bag ---------------------------------------------------------------


def bag_sum(w, i, o):
    return F.embedding_bag(i, w, o, mode="sum")


def bag_mean(w, i, o):
    return F.embedding_bag(i, w, o, mode="mean")


def bag_max(w, i, o):
    return F.embedding_bag(i, w, o, mode="max")


def bag_weighted(w, i, o, psw):
    return F.embedding_bag(i, w, o, mode="sum", per_sample_weights=psw)


def bag_padded(w, i, o):
    return F.embedding_bag(i, w, o, mode="sum", padding_idx=4)


def bag_last_offset(w, i, o):
    return F.embedding_bag(i, w, o, mode="sum", include_last_offset=True)


def test_embedding_bag():
    w = rnd(11, 6)
    i = torch.tensor([1, 4, 10, 4, 7, 0, 9, 4, 5])
    o = torch.tensor([0, 2, 5, 5])  # bag 2 is empty
    psw = rnd(9)
    run([
        (bag_sum, [w, i, o], [S0, B, B], R3, [P]),
        (bag_sum, [w, i, o], [S0, B, B], R2, [P]),
        (bag_sum, [w, i, o], [S1, B, B], R3, [S1]),
        (bag_sum, [w, i, o], [(S1, S0), BB, BB], M22, [(S1, P)]),
        (bag_sum, [w, i, o], [(B, S0), BB, BB], M22, [(B, P)]),
        (bag_sum, [rnd(3, 6), torch.tensor([0, 2, 1, 2]), torch.tensor([0, 1, 3])], [S0, B, B], [0, 1, 2, 3, 4], [P]),
        (bag_mean, [w, i, o], [S1, B, B], R2, [S1]),
        (bag_mean, [w, i, o], [S0, B, B], R3, None),  # not P: boxed, still exact
        (bag_max, [w, i, o], [S1, B, B], R3, [S1]),
        (bag_weighted, [w, i, o, psw], [S0, B, B, B], R3, [P]),
        (bag_weighted, [w, i, o, psw], [S1, B, B, B], R2, [S1]),
        (bag_padded, [w, i, o], [S0, B, B], R3, [P]),
        (bag_last_offset, [w, i, torch.tensor([0, 2, 5, 5, 9])], [S0, B, B], R3, [P]),
    ])


def _batch_norm_on_a_gpu(_):
    """In a 1-rank NCCL job: ``F.batch_norm`` of a global tensor on the GPU (cuDNN's op) against plain tensors,
    training then eval; the largest relative error of outputs, input gradients and running statistics."""
    import sbp_core as sc

    p = sc.placement("cuda", [0])
    gen = torch.Generator(device="cuda").manual_seed(0)
    x, w, b, weights = (torch.randn(*s, device="cuda", generator=gen) for s in ((8, 4, 6, 6), (4,), (4,), (8, 4, 6, 6)))
    errs = []
    for training in (True, False):
        plain = [t.clone().requires_grad_() for t in (x, w, b)]
        glob = [sc.distribute(t, p, s, requires_grad=True) for t, s in zip((x, w, b), (S0, B, B))]
        rm, rv = torch.zeros(4, device="cuda"), torch.ones(4, device="cuda")
        grm, grv = (sc.distribute(t, p, B) for t in (rm, rv))
        out = F.batch_norm(plain[0], rm, rv, plain[1], plain[2], training=training)
        gout = F.batch_norm(glob[0], grm, grv, glob[1], glob[2], training=training)
        (out * weights).sum().backward()
        (gout * sc.distribute(weights, p, S0)).sum().backward()
        pairs = [(gout, out), (grm, rm), (grv, rv)] + [(g.grad, t.grad) for g, t in zip(glob, plain)]
        errs += [float((a.full_tensor() - r).abs().max() / r.abs().max().clamp_min(1e-12)) for a, r in pairs]
    return max(errs)


@pytest.mark.cuda
def test_batch_norm_of_a_global_tensor_on_a_gpu_takes_cudnns_op_and_equals_plain_tensors():
    from toolkit.launcher import launch

    assert launch(_batch_norm_on_a_gpu, None, 1, device="cuda") <= 1e-5
