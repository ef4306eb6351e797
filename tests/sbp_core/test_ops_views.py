"""View, shape, slicing, indexing and joining rules reproduce single-device torch.

Every case runs through ``parity._worker`` (values and input gradients to
1e-5) on 2 ranks, 3 ranks (uneven splits) and a 2x2 mesh; cases of one op
family share one pool call. Where a rule must keep (or must not keep) a
split, the case also names the output SBP it expects.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from sbp_core import sbp

from . import parity

R2, R3, M22 = [0, 1], [0, 1, 2], [[0, 1], [2, 3]]
S0, S1, S2, S3 = sbp.split(0), sbp.split(1), sbp.split(2), sbp.split(3)
B, P, PMAX, PMIN = sbp.broadcast, sbp.partial_sum, sbp.partial_max, sbp.partial_min
ANY = None  # no expectation on the output layout


run = parity.check_cases


def _not(*sbps):
    """Expectation: the (single) output is not laid out as ``sbps``."""
    return lambda got: got[0] != tuple(sbps)


g = torch.Generator().manual_seed(0)


def rnd(*shape):
    return torch.randn(*shape, generator=g)


# -- views: view / reshape / flatten ------------------------------------------------------


def merge(x):  # [4, 3, 5] -> [12, 5]
    return x.view(12, 5) * 1.5


def merge_only(x):  # P(max)/P(min) cases end on the op itself (x * 1.5 has no max rule)
    return x.view(12, 5)


def split_dim(x):  # [12, 5] -> [4, 3, 5]
    return x.reshape(4, 3, 5)


def flat_after_t(x):  # non-contiguous: clone + _unsafe_view
    return x.t().reshape(-1)


def six_as_2x3(x):
    return x.view(2, 3)


def seven_as_7x1(x):
    return x.view(7, 1)


def twelve_as_6x2(x):
    return x.view(6, 2)


def rows_2x6_as_4x3(x):
    return x.view(4, 3)


def flatten_unflatten(x):  # [2, 3, 4] -> [2, 12] -> [2, 3, 4]
    return torch.flatten(x, 1).unflatten(1, (3, 4)) + 0.0


def test_view():
    x435, x125, x126 = rnd(4, 3, 5), rnd(12, 5), rnd(12, 6)
    run([
        (merge, [x435], [S0], R2, [S0]),
        (merge, [x435], [S0], R3, _not(S0)),  # 4 rows of 3 on 3 ranks: pieces 6,3,3 != 4,4,4
        (merge, [x435], [S2], R3, [S1]),
        (merge, [x435], [S1], R2, ANY),  # inner dim of the merge: boxed
        (merge, [x435], [P], R3, [P]),
        (merge, [x435], [B], R2, [B]),
        (merge_only, [x435], [PMAX], R3, [PMAX], False),  # views move elements: max/min terms stay terms
        (merge_only, [x435], [PMIN], R2, [PMIN], False),
        (split_dim, [x125], [S0], R2, [S0]),
        (split_dim, [x125], [S0], R3, _not(S0)),
        (split_dim, [x125], [S1], R3, [S2]),
        (flat_after_t, [x126], [S1], R3, [S0]),  # [12, 6] -> t -> [6, 12] -> [72]
        (flat_after_t, [x125], [S1], R3, _not(S0)),  # 5 rows on 3 ranks
        (flat_after_t, [x125], [S0], R2, ANY),
        (flat_after_t, [x125], [P], R2, [P]),
        (six_as_2x3, [rnd(6)], [S0], R3, _not(S0)),  # [6] on 3 ranks: 2,2,2 != 3,3,0
        (six_as_2x3, [rnd(6)], [S0], R2, ANY),
        (seven_as_7x1, [rnd(7)], [S0], R2, [S0]),  # 4,3 -> [4,1],[3,1]: exact
        (rows_2x6_as_4x3, [rnd(2, 6)], [S0], R2, [S0]),
        (rows_2x6_as_4x3, [rnd(2, 6)], [S0], R3, _not(S0)),
        (flatten_unflatten, [rnd(2, 3, 4)], [S1], R3, [S1]),
        (flatten_unflatten, [rnd(2, 3, 4)], [S0], R3, [S0]),
        # 2x2 mesh: nested splits of one dim must line up on the pieces of the outer split.
        (twelve_as_6x2, [rnd(12)], [(S0, S0)], M22, _not(S0, S0)),  # 12 -> 6,6 -> 3,3 vs 6 -> 3 -> 2,1 rows
        (split_dim, [x125], [(S0, S0)], M22, [(S0, S0)]),  # 4 rows over 2x2
        (merge, [x435], [(S0, S2)], M22, [(S0, S1)]),
        (merge, [x435], [(P, S0)], M22, [(P, S0)]),
    ])


# -- GPT-2 attention reshapes and nn.Linear on 3-D inputs ----------------------------------


def heads4(x):  # [B, T, C=8] -> [B, nh=4, T, hs=2] -> back
    b, t, c = x.shape
    h = x.view(b, t, 4, c // 4).transpose(1, 2)
    h = h * 2.0 + h  # an op on split heads
    return h.transpose(1, 2).contiguous().view(b, t, c)


def heads3(x):  # C=6, nh=3: heads split evenly on 3 ranks
    b, t, c = x.shape
    h = x.view(b, t, 3, c // 3).transpose(1, 2)
    return h.transpose(1, 2).reshape(b, t, c) * 2


def qkv_split(x):  # HF GPT-2: c_attn output [B, T, 3C] split into q, k, v, heads on dim 2
    q, k, v = x.split(4, dim=2)
    b, t, _ = x.shape
    q, k, v = (y.view(b, t, 2, 2).transpose(1, 2) for y in (q, k, v))
    return (q * k + v).transpose(1, 2).contiguous().view(b, t, 4)


def linear3d(x, w, b):
    return F.linear(x, w, b)


def tied_head(x, w):  # logits = x @ wte.T
    return F.linear(x, w)


def test_gpt2_chains():
    x8, x6 = rnd(2, 3, 8), rnd(2, 3, 6)
    x, w, bias = rnd(2, 3, 4), rnd(5, 4), rnd(5)
    run([
        (heads4, [x8], [S2], R2, [S2]),
        (heads4, [x8], [S2], R3, ANY),  # 4 heads on 3 ranks: boxed, still exact
        (heads4, [x8], [S0], R3, [S0]),
        (heads4, [x8], [P], R2, [P]),
        (heads3, [x6], [S2], R3, [S2]),
        (heads4, [x8], [(S0, S2)], M22, [(S0, S2)]),
        (heads4, [x8], [(S2, S2)], M22, ANY),  # 4 heads over 2x2: one head per rank
        (qkv_split, [rnd(2, 3, 12)], [S0], R3, [S0]),
        (qkv_split, [rnd(2, 3, 12)], [S1], R3, [S1]),
        (linear3d, [x, w, bias], [B, S0, S0], R2, [S2]),  # column parallel
        (linear3d, [x, w, bias], [B, S0, S0], R3, [S2]),
        (linear3d, [x, w, bias], [S2, S1, B], R3, [P]),  # row parallel: partial sums
        (linear3d, [rnd(3, 3, 4), w, bias], [S0, B, B], R3, [S0]),  # 3 rows of 3 tokens: [9, 4] S(0)
        (linear3d, [x, w, bias], [S0, B, B], R3, ANY),  # 2 rows of 3 tokens on 3 ranks: boxed
        (linear3d, [x, w, bias], [(S0, B), (B, S0), (B, S0)], M22, [(S0, S2)]),
        (tied_head, [x, rnd(7, 4)], [B, S0], R3, [S2]),
    ])


# -- permutations, expand, (un)squeeze, new_* ------------------------------------------------


def permutes(x):  # [4, 5, 3]
    return x.t() if x.dim() == 2 else x.permute(2, 0, 1).transpose(0, 2) * 2


def permute_only(x):
    return x.permute(2, 0, 1)


def expand_only(x):
    return x.expand(2, 4, 5, 3)


def t2d(x):
    return x.t() * 2


def expand(x):  # [4, 1, 3] -> [2, 4, 5, 3]
    return x.expand(2, 4, 5, 3) * 1.0


def expand_keep(x):  # [4, 1, 3] -> [4, 6, 3] with -1
    return x.expand(-1, 6, -1) + 0.0


def squeezes(x):  # [3, 1, 2]: a shard of size 1 must not be squeezed
    return x.squeeze() * 2 + x.squeeze(1) + x.squeeze((1,)), x.squeeze(0) * 1.0


def unsqueezes(x):
    return x.unsqueeze(0).unsqueeze(-1) * 3


def new_tensors(x):
    return x + x.new_ones(x.shape) + x.new_zeros(x.shape[1:]) + x.new_full((1, x.shape[1]), 0.5) + x.new_empty(x.shape).zero_()


def new_other_shapes(x):  # [n, 3] -> [n, 5], [n, 2], [n, 4]: the rows' dim as long as x's
    return (x.new_zeros((x.shape[0], 5)), x.new_full((x.shape[0], 2), 0.5),
            x.new_empty_strided((x.shape[0], 4), (1, x.shape[0])).zero_())


def new_other_rank(x):
    return x.new_zeros((x.shape[0],)) + 1


def test_permute_expand_squeeze_new():
    x453, x413, x312 = rnd(4, 5, 3), rnd(4, 1, 3), rnd(3, 1, 2)
    run([
        (permutes, [x453], [S0], R3, [S1]),  # dims (2, 0, 1) then swap 0 and 2: S(0) ends on dim 1
        (permutes, [x453], [S1], R2, [S0]),
        (permutes, [x453], [S2], R3, [S2]),
        (permutes, [x453], [P], R2, [P]),
        (permute_only, [x453], [PMIN], R3, [PMIN], False),
        (permutes, [x453], [(S0, S2)], M22, [(S1, S2)]),
        (t2d, [rnd(5, 3)], [S0], R3, [S1]),
        (t2d, [rnd(5, 3)], [B], R3, [B]),
        (t2d, [rnd(5)], [S0], R2, [S0]),
        (expand, [x413], [S0], R3, [S1]),
        (expand, [x413], [S2], R2, [S3]),
        (expand, [x413], [S1], R2, ANY),  # the broadcast size-1 dim: boxed
        (expand, [x413], [P], R3, [P]),
        (expand_only, [x413], [PMAX], R2, [PMAX], False),
        (expand, [x413], [(S0, S2)], M22, [(S1, S3)]),
        (expand_keep, [x413], [S2], R3, [S2]),
        (squeezes, [x312], [S0], R3, [S0, S0]),
        (squeezes, [x312], [S2], R3, [S1, S2]),
        (squeezes, [x312], [S1], R2, ANY),
        (squeezes, [x312], [P], R2, [P, P]),
        (unsqueezes, [x312], [S2], R3, [S3]),
        (unsqueezes, [x312], [(S0, P)], M22, [(S1, P)]),
        (new_tensors, [rnd(4, 3)], [S0], R3, [S0]),
        (new_tensors, [rnd(4, 3)], [B], R2, [B]),
        (new_tensors, [rnd(4, 3)], [(S1, S0)], M22, [(S1, S0)]),
        # Another shape, the split dim as long: split alike (each rank allocates its rows), unevenly too (values
        # only: the outputs do not depend on the input's).
        (new_other_shapes, [rnd(4, 3)], [S0], R2, [S0, S0, S0], False),
        (new_other_shapes, [rnd(5, 3)], [S0], R3, [S0, S0, S0], False),
        (new_other_shapes, [rnd(4, 3)], [S1], R3, [B, B, B], False),  # the split dim's length changes
        (new_other_shapes, [rnd(4, 3)], [P], R2, [B, B, B], False),
        (new_other_rank, [rnd(4, 3)], [S0], R2, [B], False),
    ])


# -- slices, selects, pads, triangles -----------------------------------------------------------


def slices(x):  # [6, 5]
    return x[1:4] * 2


def slice_cols(x):
    return x[:, ::2] + x[:, 2:]


def slice_whole(x):
    return x[:, 0:100] * 2


def selects(x):  # [6, 5]
    return x[2] * 2, x[:, 3] + 1


def narrows(x):
    return x.narrow(1, 1, 3) * 2


def pads(x):
    return F.pad(x, (1, 2)) * 2


def pads_rows(x):
    return F.pad(x, (0, 0, 2, 0), value=-1.0)


def causal(x):  # [2, 5, 5] attention scores
    return x.tril() + x.triu(2) * 2 + x.tril(-1)


def triangle_only(x):
    return x.tril(1)


def causal_wide(x):  # [4, 6]
    return x.triu(1) - x.tril(-2)


def masked(x, m, v):  # the value as a 0-d global tensor (masked_fill.Tensor)
    return x.masked_fill(m, v) + x.masked_fill(m, -1.0)


def test_slicing():
    x65, x255, x46 = rnd(6, 5), rnd(2, 5, 5), rnd(4, 6)
    m = torch.rand(6, 5, generator=g) > 0.5
    run([
        (slices, [x65], [S1], R3, [S1]),
        (slices, [x65], [S0], R3, ANY),  # rows from other ranks: boxed
        (slices, [x65], [P], R2, [P]),
        (slice_cols, [x65], [S0], R3, [S0]),
        (slice_cols, [x65], [S1], R2, ANY),
        (slice_whole, [x65], [S1], R3, [S1]),  # the whole dim: the split stays
        (selects, [x65], [S1], R3, [S0, ANY]),
        (selects, [x65], [S0], R2, ANY),
        (selects, [x65], [P], R3, ANY),
        (selects, [x65], [(S1, P)], M22, [(S0, P), ANY]),
        (narrows, [x65], [S0], R3, [S0]),
        (pads, [x65], [S0], R3, [S0]),
        (pads, [x65], [P], R2, [P]),
        (pads, [x65], [S1], R2, ANY),
        (pads_rows, [x65], [S1], R3, [S1]),
        (pads_rows, [x65], [PMAX], R3, [PMAX], False),  # every term holds the fill
        (pads_rows, [x65], [P], R2, _not(P)),  # -1 on every rank would sum to -p
        (causal, [x255], [S1], R3, [S1]),
        (causal, [x255], [S2], R3, [S2]),
        (causal, [x255], [S0], R2, [S0]),
        (causal, [x255], [P], R3, [P]),
        (triangle_only, [x255], [PMAX], R2, [PMAX], False),
        (causal, [x255], [(S1, S2)], M22, [(S1, S2)]),
        (causal, [x255], [(S1, S1)], M22, [(S1, S1)]),
        (causal_wide, [x46], [S1], R3, [S1]),
        (causal_wide, [x46], [(S0, S1)], M22, [(S0, S1)]),
        (masked, [x65, m, torch.tensor(0.5)], [S0, S0, B], R3, [S0]),
        (masked, [x65, m, torch.tensor(0.5)], [S1, B, B], R2, [S1]),
    ])


def diagonals(x):  # [2, 5, 5]: the diagonal of each matrix, and a band above it, as ``torch.diagonal`` gives
    return x.diagonal(0, 1, 2) * 2, x.diagonal(1, -1, -2) * 3


def diagonal_rows(x):  # [4, 3, 3]: ``einsum("bii->bi")`` and ``diag_embed`` back to matrices
    return torch.einsum("bii->bi", x).diag_embed(1) * 2


def matrix_diagonal(x):  # [4, 4]: ``torch.diag`` of a matrix (``diagonal_copy``) and of a vector
    return torch.diag(x) * 2, torch.diag(x[0] * 3)


def test_diagonals():
    x255, x433, x44 = rnd(2, 5, 5), rnd(4, 3, 3), rnd(4, 4)
    run([
        (diagonals, [x255], [S0], R3, [S0, S0]),
        (diagonals, [x255], [P], R2, [P, P]),
        (diagonals, [x255], [S1], R3, ANY),  # across the diagonal: boxed first
        (diagonals, [x255], [(S0, S2)], M22, lambda got: got is not None and all(o[0] == S0 for o in got)),  # S(2) boxed
        (diagonal_rows, [x433], [S0], R3, [S0]),
        (diagonal_rows, [x433], [S2], R2, ANY),
        (matrix_diagonal, [x44], [S1], R2, ANY),
        (matrix_diagonal, [x44], [B], R3, [B, B]),
        (matrix_diagonal, [x44], [P], R2, [P, ANY]),
    ])


# -- tensor-indexed ops ---------------------------------------------------------------------


def index_rows(x, i):  # x [5, 4, 3], i [2, 3]: x[i] -> [2, 3, 4, 3]
    return x[i] * 2


def index_mid(x, i):  # x[:, i] -> [5, 2, 3, 3]
    return x[:, i] * 2


def index_apart(x, i, j):  # x[i, :, j]: separated index dims go first -> [2, 3, 4]
    return x[i, :, j] * 2


def index_put_acc(x, i, v):  # x [5, 4, 3], i [2, 3], v [2, 3, 4, 3]
    return x.index_put((i,), v, accumulate=True)


def index_put_set(x, i, v):  # i without repeats; ``y[i] = v`` is ``index_put_``
    y = x * 1.0
    y[i] = v
    return y + x.index_put((i,), v * 2)


def gathers(x, idx):  # x [4, 6], idx [4, 3] in [0, 6)
    return x.gather(1, idx) * 2


def gather_only(x, idx):
    return x.gather(1, idx)


def gather_rows(x, idx):  # along dim 0: idx [3, 6] in [0, 4)
    return x.gather(0, idx) * 2


def scatter_adds(x, idx, src):  # x [4, 6], idx [4, 3], src [4, 3]
    return x.scatter_add(1, idx, src)


def scatters(x, idx, src):  # idx rows without repeats
    return x.scatter(1, idx, src) + x.scatter(1, idx, 0.0)


def index_selects(x, i):  # x [5, 4], i [3] in [0, 5)
    return x.index_select(0, i) * 2, x.index_select(1, i.clamp(max=3)) * 2


def embedding_rows(w, i):  # vocab-parallel lookup: w split on rows -> partial sums
    return w.index_select(0, i) * 2


def index_adds(x, i, src):  # x [5, 4], i [3], src [3, 4]
    return x.index_add(0, i, src, alpha=2.0)


def test_indexing():
    x543 = rnd(5, 4, 3)
    i23 = torch.tensor([[0, 2, 4], [4, 1, 1]])
    j23 = torch.tensor([[1, 0, 2], [2, 2, 0]])
    v = rnd(2, 3, 4, 3)
    iu = torch.tensor([[3, 0, 2]])  # no repeats: put without accumulate is deterministic
    x46, idx43 = rnd(4, 6), torch.randint(0, 6, (4, 3), generator=g)
    idx36 = torch.randint(0, 4, (3, 6), generator=g)
    src43 = rnd(4, 3)
    idx_perm = torch.stack([torch.randperm(6, generator=g)[:3] for _ in range(4)])
    x54, i3, src34 = rnd(5, 4), torch.tensor([4, 0, 4]), rnd(3, 4)
    run([
        (index_rows, [x543, i23], [S1, B], R3, [S2]),
        (index_rows, [x543, i23], [B, S1], R3, [S1]),
        (index_rows, [x543, i23], [B, S0], R2, [S0]),
        (index_rows, [x543, i23], [P, B], R2, [P]),
        (index_rows, [x543, i23], [S0, B], R2, ANY),  # the indexed dim: boxed
        (index_rows, [x543, i23], [(S2, B), (B, S1)], M22, [(S3, S1)]),
        (index_mid, [x543, j23], [S0, B], R3, [S0]),
        (index_mid, [x543, j23], [S2, B], R3, [S3]),
        (index_mid, [x543, j23], [B, S1], R3, [S2]),
        (index_apart, [x543, i23, j23], [S1, B, B], R3, [S2]),
        (index_apart, [x543, i23, j23], [B, S1, S1], R3, [S1]),
        (index_apart, [x543, i23, j23], [B, S0, B], R2, [S0]),
        (index_put_acc, [x543, i23, v], [S1, B, S2], R3, [S1]),
        (index_put_acc, [x543, i23, v], [P, S1, S1], R3, [P]),
        (index_put_acc, [x543, i23, v], [B, S0, S0], R2, [P]),
        (index_put_acc, [x543, i23, v], [P, B, P], R2, [P]),
        # No gradients: the backward of a non-accumulating put builds its zeros with aten.zeros,
        # a factory that makes a plain local tensor, which the dispatcher refuses to mix in.
        (index_put_set, [x543, iu, rnd(1, 3, 4, 3)], [S2, B, S3], R3, [S2], False),
        (index_put_set, [x543, iu, rnd(1, 3, 4, 3)], [P, B, P], R3, [P], False),
        (index_put_set, [x543, iu, rnd(1, 3, 4, 3)], [B, B, B], R2, [B], False),
        (gathers, [x46, idx43], [S0, S0], R3, [S0]),
        (gathers, [x46, idx43], [B, S1], R3, [S1]),
        (gathers, [x46, idx43], [S1, B], R3, [P]),  # vocab-parallel: masked local gather
        (gathers, [x46, idx43], [P, B], R2, [P]),
        (gather_only, [x46, idx43], [PMAX, B], R3, [PMAX], False),
        (gathers, [x46, idx43], [(S0, S1), (S0, B)], M22, [(S0, P)]),
        (gather_rows, [x46, idx36], [S0, B], R3, [P]),
        (gather_rows, [x46, idx36], [S1, B], R2, ANY),  # idx has 6 columns too: S(1) kept
        (gather_rows, [rnd(2, 6), torch.randint(0, 2, (3, 6), generator=g)], [S0, B], R3, [P]),  # an empty shard
        (scatter_adds, [x46, idx43, src43], [S0, S0, S0], R3, [S0]),
        (scatter_adds, [x46, idx43, src43], [B, S1, S1], R3, [P]),
        (scatter_adds, [x46, idx43, src43], [P, B, P], R2, [P]),
        (scatter_adds, [x46, idx43, src43], [(S0, B), (S0, S1), (S0, S1)], M22, [(S0, P)]),
        (scatters, [x46, idx_perm, src43], [S0, S0, S0], R3, [S0]),
        (scatters, [x46, idx_perm, src43], [P, B, P], R2, ANY),  # scatter.value: 0 keeps P(sum)
        (index_selects, [x54, i3], [S1, B], R3, [S1, P]),
        (index_selects, [x54, i3], [B, S0], R2, [S0, S1]),
        (embedding_rows, [x54, i3], [S0, B], R3, [P]),
        (embedding_rows, [x54, i3], [B, S0], R3, [S0]),
        (embedding_rows, [x54, i3], [S1, B], R2, [S1]),
        (embedding_rows, [x54, i3], [(S0, S1), (B, B)], M22, [(P, S1)]),
        (index_adds, [x54, i3, src34], [S1, B, S1], R3, [S1]),
        (index_adds, [x54, i3, src34], [B, S0, S0], R3, [P]),
        (index_adds, [x54, i3, src34], [P, B, P], R2, [P]),
    ])


# -- cat, stack, split, unbind ----------------------------------------------------------------


def cats(a, b):  # [3, 4], [3, 2] along dim 1
    return torch.cat([a, b * 2], 1)


def cat_only(a, b):
    return torch.cat([a, b], 1)


def stacks(a, b):
    return torch.stack([a, b], 1) * 1.0


def splits(x):  # [6, 5] on dim 1
    a, b, c = x.split(2, dim=1)
    d, e = x.split([1, 4], dim=1)
    return a * b + c.sum(1, keepdim=True) + d * 2, e


def chunks(x):
    return [y * k for k, y in enumerate(x.chunk(3, dim=1), 1)]


def unbinds(x):  # [6, 3] -> three [6]
    a, b, c = x.unbind(1)
    return a * b + c


def test_joining():
    a, b = rnd(3, 4), rnd(3, 2)
    x65 = rnd(6, 5)
    run([
        (cats, [a, b], [S0, S0], R2, [S0]),
        (cats, [a, b], [S0, S0], R3, [S0]),
        (cats, [a, b], [S1, S1], R2, ANY),  # along the split dim: boxed
        (cats, [a, b], [P, P], R3, [P]),
        (cats, [a, b], [P, B], R2, [P]),
        (cats, [a, b], [B, B], R2, [B]),
        (cat_only, [a, b], [PMIN, PMIN], R3, [PMIN], False),
        (cats, [a, b], [(S0, P), (S0, B)], M22, [(S0, P)]),
        (stacks, [a, a * 3], [S1, S1], R3, [S2]),
        (stacks, [a, a * 3], [S0, B], R2, [S0]),
        (stacks, [a, a * 3], [P, P], R2, [P]),
        (splits, [x65], [S0], R3, [S0, S0]),
        (splits, [x65], [S1], R3, ANY),
        (splits, [x65], [P], R2, ANY),
        (splits, [x65], [(S0, S0)], M22, [(S0, S0), (S0, S0)]),
        (chunks, [x65], [S0], R3, [S0, S0, S0]),
        (chunks, [x65], [P], R3, [P, P, P]),
        (unbinds, [rnd(6, 3)], [S0], R3, [S0]),
        (unbinds, [rnd(6, 3)], [S1], R2, ANY),
        (unbinds, [rnd(6, 3)], [(S0, S0)], M22, [(S0, S0)]),
    ])


def _view_strides():
    import sbp_core as sc
    from toolkit.rank_pool import get_pool  # noqa: F401  (runs in a pool worker)

    p = sc.placement("cpu", [0, 1])
    x = sc.distribute(torch.randn(4, 6), p, (sbp.broadcast,))
    seen = []
    for _ in range(2):  # the first call decides; the second reuses the cached decision (the hot path)
        y = x.t()
        seen.append((tuple(y.stride()), y.is_contiguous(), tuple(y._local.stride())))
    return seen


def test_a_views_strides_are_its_locals_on_the_cached_path_too():
    """``x.t()`` of a global tensor reports torch's strides for it (``(1, 6)``, not contiguous) on every call."""
    from toolkit.rank_pool import get_pool

    for seen in get_pool(parity.WORLD).run(_view_strides)[:2]:
        assert seen == [((1, 6), False, (1, 6))] * 2, seen
