"""Layer norm, attention, dropout, GELU and embedding rules reproduce single-device torch.

Cases run through ``parity._worker`` (values and input gradients to 1e-5) on
2 ranks, 3 ranks (uneven splits) and a 2x2 mesh; one pool call per test.
Where a rule's point is a layout (vocab-parallel embedding -> ``P``), the
case names the output SBP it expects.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import sbp_core as sc
from sbp_core import sbp
from toolkit.rank_pool import get_pool

from . import parity

R2, R3, M22 = [0, 1], [0, 1, 2], [[0, 1], [2, 3]]
S0, S1, S2 = sbp.split(0), sbp.split(1), sbp.split(2)
B, P = sbp.broadcast, sbp.partial_sum
BB = (B, B)


run = parity.check_cases


g = torch.Generator().manual_seed(0)


def rnd(*shape):
    return torch.randn(*shape, generator=g)


def ids(high, *shape):
    return torch.randint(0, high, shape, generator=g)


# -- layer norm ------------------------------------------------------------------


def layer_norm(x, w, b):
    return F.layer_norm(x, (8,), w, b)


def layer_norm_2d(x, w, b):
    return F.layer_norm(x, (3, 8), w, b)


def layer_norm_then_column_parallel(x, w, b, m):
    # The layer norm's output gradient comes back P from the mm with a split m.
    return F.layer_norm(x, (8,), w, b) @ m


def test_layer_norm():
    x, w, b = rnd(5, 3, 8), rnd(8), rnd(8)
    w2, b2 = rnd(3, 8), rnd(3, 8)
    run([
        (layer_norm, [x, w, b], [S0, B, B], R2, [S0]),
        (layer_norm, [x, w, b], [S1, B, B], R3, [S1]),
        (layer_norm, [x, w, b], [B, B, B], R3, [B]),
        (layer_norm, [x, w, b], [(S0, S1), BB, BB], M22, [(S0, S1)]),
        (layer_norm_2d, [x, w2, b2], [S0, B, B], R3, [S0]),
        (layer_norm_then_column_parallel, [rnd(5, 8), w, b, rnd(8, 6)], [B, B, B, S1], R3, [S1]),
    ])


# -- attention -------------------------------------------------------------------


def attention(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def attention_masked(q, k, v, m):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=m)


def test_attention():
    q, k, v = rnd(4, 3, 5, 8), rnd(4, 3, 5, 8), rnd(4, 3, 5, 8)
    # A mask that needs no gradient keeps the fused CPU kernel (one that does takes the math path).
    mask = (rnd(4, 1, 5, 5) > 0) | torch.eye(5, dtype=torch.bool)
    run([
        (attention, [q, k, v], [S0, S0, S0], R3, [S0]),
        (attention, [q, k, v], [S1, S1, S1], R2, [S1]),
        (attention, [q, k, v], [S1, S1, S1], R3, [S1]),
        (attention, [q, k, v], [B, B, B], R2, [B]),
        (attention, [q, k, v], [(S0, S1)] * 3, M22, [(S0, S1)]),
        (attention_masked, [q, k, v, mask], [S1, S1, S1, B], R2, [S1]),
        (attention_masked, [q, k, v, mask], [(S0, S1)] * 3 + [(S0, B)], M22, [(S0, S1)]),
        (attention_masked, [q, k, v, mask], [S0, S0, S0, S0], R3, [S0]),
    ])


# -- dropout and GELU ------------------------------------------------------------


def dropout(x):
    torch.manual_seed(11)
    return F.dropout(x, 0.3)


def native_dropout(x):
    torch.manual_seed(12)
    out, mask = torch.ops.aten.native_dropout(x, 0.4, True)
    return out, mask.float()


def dropout_of_partial(x, m):
    torch.manual_seed(13)
    return F.dropout(x @ m, 0.5)


def gelu_tanh(x):
    return F.gelu(x, approximate="tanh") + F.gelu(x)


def test_dropout_and_gelu():
    x = rnd(7, 9)
    run([
        (dropout, [x], [S0], R2, [S0]),
        (dropout, [x], [S1], R3, [S1]),
        (dropout, [x], [B], R3, [B]),
        (dropout, [x], [(S1, S0)], M22, [(S1, S0)]),
        (native_dropout, [x], [S0], R3, [S0, S0]),
        (native_dropout, [x], [(S0, S1)], M22, [(S0, S1), (S0, S1)]),
        (dropout_of_partial, [x, rnd(9, 5)], [S1, S0], R3, [P]),
        (gelu_tanh, [x], [S1], R3, [S1]),
    ])


def _dropout_exact(ranks, layout):
    """Bit-exact mask and output vs one device, and every rank's generator in step afterwards."""
    x = torch.randn(7, 9, generator=torch.Generator().manual_seed(3))
    torch.manual_seed(5)
    want = F.dropout(x, 0.3)
    torch.manual_seed(5)
    want_native = torch.ops.aten.native_dropout(x, 0.3, True)
    torch.manual_seed(5)
    p = sc.placement("cpu", ranks)
    gx = sc.distribute(x, p, layout)
    got = F.dropout(gx, 0.3)
    torch.manual_seed(5)
    got_native = torch.ops.aten.native_dropout(gx, 0.3, True)
    after = torch.rand(4)
    if torch.distributed.get_rank() not in p:
        return None, after
    same = [torch.equal(got.full_tensor(), want)]
    same += [torch.equal(a.full_tensor(), b) for a, b in zip(got_native, want_native)]
    same.append(torch.equal(want_native[1], want != 0))
    return same, after


def test_dropout_mask_is_exact_and_rng_stays_in_step():
    pool = get_pool(parity.WORLD)
    for ranks, layout in [(R2, S1), (R3, S0), (M22, (S1, S0))]:
        out = pool.run(_dropout_exact, ranks, layout)
        for rank, (same, after) in enumerate(out):
            assert same is None or all(same), (ranks, layout, rank, same)
            assert torch.equal(after, out[0][1]), f"rank {rank}'s generator is out of step"


# -- embedding -------------------------------------------------------------------


def embedding(w, i):
    return F.embedding(i, w)


def embedding_pad(w, i):
    return F.embedding(i, w, padding_idx=3)


def embedding_freq(w, i):
    return F.embedding(i, w, scale_grad_by_freq=True)


def test_embedding():
    w, i = rnd(11, 6), ids(11, 5, 7)
    i[0, :3] = 3  # a padding row that appears
    run([
        (embedding, [w, i], [B, S0], R3, [S0]),
        (embedding, [w, i], [B, S1], R2, [S1]),
        (embedding, [w, i], [S1, B], R3, [S2]),
        (embedding, [w, i], [S0, B], R2, [P]),
        (embedding, [w, i], [S0, B], R3, [P]),
        (embedding_pad, [w, i], [S0, B], R3, [P]),
        (embedding_pad, [w, i], [B, S0], R2, [S0]),
        (embedding_freq, [w, i], [S0, B], R3, [P]),
        (embedding_freq, [w, i], [B, S0], R2, None),
        # dp x tp: batch split on mesh axis 0, vocab rows split on axis 1.
        (embedding, [w, i], [(B, S0), (S0, B)], M22, [(S0, P)]),
        (embedding, [w, i], [(S1, S0), BB], M22, [(S2, P)]),
        (embedding, [rnd(3, 6), ids(3, 5, 7)], [S0, B], [0, 1, 2, 3, 4], [P]),  # ranks with no rows
    ])


def _vocab_parallel_grad_layout():
    p = sc.placement("cpu", [[0, 1], [2, 3]])
    w = sc.distribute(torch.randn(11, 6), p, (B, S0), requires_grad=True)
    i = sc.distribute(torch.randint(0, 11, (4, 5)), p, (S0, B))
    F.embedding(i, w).sum().backward()
    return w.grad.sbp if torch.distributed.get_rank() in p else None


def test_vocab_parallel_gradient_stays_row_split():
    out = get_pool(parity.WORLD).run(_vocab_parallel_grad_layout)
    assert out[0] in ((P, S0), (B, S0)), out[0]


def _dropout_on_a_gpu(_):
    """In a 1-rank NCCL job: ``F.dropout`` of a global tensor on the GPU (CUDA's fused ``native_dropout``)
    against a plain tensor from the same generator state: (outputs equal, the draw after equal)."""
    import sbp_core as sc

    p = sc.placement("cuda", [0])
    x = torch.randn(64, 33, device="cuda", dtype=torch.bfloat16)
    g = sc.distribute(x, p, S0)
    torch.manual_seed(5)
    plain, after = F.dropout(x, 0.3), torch.rand(4, device="cuda")
    torch.manual_seed(5)
    glob, glob_after = F.dropout(g, 0.3).full_tensor(), torch.rand(4, device="cuda")
    return bool(torch.equal(plain, glob)), bool(torch.equal(after, glob_after))


@pytest.mark.cuda
def test_dropout_of_a_global_tensor_on_a_gpu_draws_cudas_own_mask():
    from toolkit.launcher import launch

    assert launch(_dropout_on_a_gpu, None, 1, device="cuda") == (True, True)
