"""Sparse row gradients of global embedding tables equal single-device torch's.

``F.embedding(..., sparse=True)`` on global tensors: the gradient is a
``SparseGlobalTensor`` whose layout follows the table (``S(1)`` columns kept,
row splits ``B``), with ids ``B`` or split over data parallel (a ``B`` table:
the rows are gathered when the sparse tensor is made), accumulated over two
micro-batches (sparse ``add_``); boxing, ``coalesce``/``values_global``,
``to_dense`` and the optimizer's ``rows_in_box`` give the single-device
values; other ops fail naming the op. One pool call.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import sbp_core as sc
from sbp_core.grad_buckets import GradBuckets
from sbp_core.sbp import Broadcast, Split, format_sbp
from sbp_core.sparse import rows_in_box
from toolkit.rank_pool import get_pool

B, S0, S1 = Broadcast(), Split(0), Split(1)
ROWS, DIM = 40, 6
CASES = {  # name: (mesh ranks, table sbp, ids sbp)
    "vocab_split": ([0, 1, 2], (S0,), (S0,)),
    "column_split": ([0, 1], (S1,), (S0,)),
    "data_parallel": ([0, 1, 2, 3], (B,), (S0,)),
    "2d": ([[0, 1], [2, 3]], (S0, S1), (S0, S0)),
}


def _micro_batches():
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, ROWS, (12, 2), generator=gen) for _ in range(2)], torch.randn(ROWS, DIM, generator=gen)


def _reference():
    ids, table = _micro_batches()
    w = table.clone().requires_grad_()
    for i in ids:
        F.embedding(i, w, sparse=True).pow(2).sum().backward()
    return w.grad.coalesce()


def _case(ranks, table_sbp, ids_sbp):
    ids, table = _micro_batches()
    p = sc.placement("cpu", ranks)
    me = torch.distributed.get_rank()
    w = torch.nn.Parameter(sc.distribute(table, p, table_sbp))
    GradBuckets([w], [w.sbp], lambda leaf, grad: setattr(leaf, "grad", grad))  # as distribute_module's
    for i in ids:
        F.embedding(sc.distribute(i, p, ids_sbp), w, sparse=True).pow(2).sum().backward()
    g = w.grad
    if me not in p:
        return None
    ref = _reference()
    full = g.full_tensor().coalesce()
    dense = g.to_dense()
    norm_sq = float(g.coalesce().values_global().pow(2).sum().full_tensor())
    rows, vals = rows_in_box(g, w.shape, p.shape, w.sbp, p.coords(me))
    box = sc.layout.local_box(w.shape, p.shape, w.sbp, p.coords(me))
    want = ref.to_dense()[sc.layout.box_slices(box)]
    got = torch.zeros_like(want)
    got[rows] = vals
    return dict(
        kind=type(g).__name__, sbp=format_sbp(g.sbp),
        full=float((full.to_dense() - ref.to_dense()).abs().max()),
        dense=float((dense.full_tensor() - ref.to_dense()).abs().max()),
        norm=abs(norm_sq - float(ref._values().pow(2).sum())) / float(ref._values().pow(2).sum()),
        shard=float((got - want).abs().max()),
    )


def _unsupported():
    p = sc.placement("cpu", [0, 1])
    w = torch.nn.Parameter(sc.distribute(torch.randn(ROWS, DIM), p, (S1,)))
    F.embedding(sc.distribute(torch.tensor([[1, 2]]), p, (B,)), w, sparse=True).sum().backward()
    w.grad.sum()


def _all():
    out = {name: _case(*spec) for name, spec in CASES.items()}
    try:
        _unsupported()
        out["unsupported"] = None
    except sc.NoSbpRule as e:
        out["unsupported"] = str(e)
    return out


@pytest.fixture(scope="module")
def results():
    return get_pool(5).run(_all)


@pytest.mark.parametrize("name,want_sbp", [("vocab_split", "(B)"), ("column_split", "(S(1))"),
                                           ("data_parallel", "(B)"), ("2d", "(B, S(1))")])
def test_row_gradients_equal_one_device(results, name, want_sbp):
    ranks = CASES[name][0]
    n = len(sum(ranks, [])) if isinstance(ranks[0], list) else len(ranks)
    for r in results[:n]:
        got = r[name]
        assert got["kind"] == "SparseGlobalTensor" and got["sbp"] == want_sbp, got
        assert got["full"] <= 1e-6 and got["dense"] <= 1e-6 and got["shard"] <= 1e-6 and got["norm"] <= 1e-6, got


def test_other_ops_name_themselves(results):
    msg = results[0]["unsupported"]
    assert msg is not None and "aten.sum" in msg and "sparse global tensors" in msg


def _add_across_layouts():
    """A column-split row gradient plus a replicated one (a gradient accumulated from two micro-batches whose
    tables were laid out differently): the replicated one is boxed to the first's layout before the add."""
    from sbp_core.sparse import from_indices_values

    p = sc.placement("cpu", [0, 1])
    g = torch.Generator().manual_seed(3)
    rows = [torch.tensor([[1, 4, 4, 7]]), torch.tensor([[0, 4, 9]])]
    vals = [torch.randn(4, DIM, generator=g), torch.randn(3, DIM, generator=g)]
    split = from_indices_values(sc.distribute(rows[0], p, (B,)), sc.distribute(vals[0], p, (S1,)), (ROWS, DIM))
    whole = from_indices_values(sc.distribute(rows[1], p, (B,)), sc.distribute(vals[1], p, (B,)), (ROWS, DIM))
    total = split + whole
    if torch.distributed.get_rank() not in p:
        return format_sbp(total.sbp), total._local.sparse_dim(), tuple(total._local.shape)
    want = sum(torch.sparse_coo_tensor(r, v, (ROWS, DIM)).to_dense() for r, v in zip(rows, vals))
    return format_sbp(total.sbp), (total.full_tensor().to_dense() - want).abs().max().item()


def test_sparse_add_boxes_the_other_to_the_first_ones_layout():
    out = get_pool(5).run(_add_across_layouts)
    for sbp, err in out[:2]:
        assert sbp == "(S(1))" and err <= 1e-6, (sbp, err)
    assert all(r == ("(S(1))", 1, (0, 0)) for r in out[2:]), out[2:]  # outside: empty, one sparse dim as inside


def test_rows_in_box_takes_the_shards_columns_of_a_whole_row_gradient():
    """A plain (one-device) row gradient of a [10, 4] table, for the shard a rank holds of it split ``S(1)``
    over 2: the rank at coordinate 1 gets columns 2..3 of the looked-up rows."""
    dense = torch.arange(40.0).view(10, 4)
    grad = torch.sparse_coo_tensor(torch.tensor([[2, 7]]), dense[[2, 7]], (10, 4), check_invariants=True)
    for coord, cols in ((0, slice(0, 2)), (1, slice(2, 4))):
        rows, vals = rows_in_box(grad, (10, 4), (2,), (S1,), (coord,))
        assert rows.tolist() == [2, 7] and torch.equal(vals, dense[[2, 7]][:, cols]), (coord, vals)
