"""LazyAdamW on one device: AdamW for dense gradients, torch's SparseAdam for row gradients.

Its lazy moments live only for looked-up rows; dense moment storage gives
the same parameters; moments saved by one table split load into another
(the checkpoint's pieces); ``load_state_dict`` restores a run bit for bit.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from toolkit.lazy_adam import LazyAdamW, RowMoments

ROWS, DIM = 50, 4


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.table = nn.Embedding(ROWS, DIM, sparse=True)
        self.head = nn.Linear(3 * DIM, 1)

    def forward(self, ids):
        return self.head(self.table(ids).flatten(1)).squeeze(-1)


def _batches(n=4):
    gen = torch.Generator().manual_seed(3)
    return [(torch.randint(0, ROWS // 2, (6, 3), generator=gen), torch.randn(6, generator=gen)) for _ in range(n)]


def _train(model, opt, batches):
    for ids, y in batches:
        ((model(ids) - y) ** 2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def _lazy(model, **kw):
    return LazyAdamW([{"params": list(model.head.parameters()), "weight_decay": 0.1},
                      {"params": [model.table.weight]}], lr=0.01, **kw)


def test_matches_adamw_and_sparse_adam():
    torch.manual_seed(0)
    model = _Tiny()
    ref = copy.deepcopy(model)
    _train(model, _lazy(model), _batches())
    _train_reference(ref, torch.optim.AdamW(ref.head.parameters(), lr=0.01, weight_decay=0.1),
                     torch.optim.SparseAdam([ref.table.weight], lr=0.01))
    for (name, a), b in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=name)


def _train_reference(ref, dense, sparse, before_step=lambda ids: None):
    """torch's AdamW on the head and SparseAdam on the table over ``_batches()``; ``before_step(ids)`` after
    each backward."""
    for ids, y in _batches():
        ((ref(ids) - y) ** 2).mean().backward()
        before_step(ids)
        dense.step()
        sparse.step()
        dense.zero_grad(set_to_none=True)
        sparse.zero_grad(set_to_none=True)


def test_gradients_given_to_step_are_the_parameters_own():
    """``step(grads={id(p): g})`` (a one-device step's gradients left on its leaves) is ``step()`` with each
    ``p.grad = g``: the same parameters after every step, sparse rows included. ``sc.takes_local_grads``
    says so of it, sparse too, but of torch's AdamW for dense gradients only, and of neither with a step
    hook."""
    import sbp_core as sc

    torch.manual_seed(0)
    model = _Tiny()
    other = copy.deepcopy(model)
    opt, given = _lazy(model), _lazy(other)
    for ids, y in _batches():
        ((model(ids) - y) ** 2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        ((other(ids) - y) ** 2).mean().backward()
        grads = {id(p): p.grad for p in other.parameters()}
        other.zero_grad(set_to_none=True)
        assert grads[id(other.table.weight)].is_sparse
        given.step(grads=grads)
    for (name, a), b in zip(model.named_parameters(), other.parameters()):
        assert torch.equal(a, b), name
    adamw = torch.optim.AdamW(model.head.parameters())
    assert sc.takes_local_grads(opt, sparse=True) and sc.takes_local_grads(adamw)
    assert not sc.takes_local_grads(adamw, sparse=True)
    for o in (opt, adamw):
        o.register_step_pre_hook(lambda *a: None)
        assert not sc.takes_local_grads(o)


def test_moments_only_for_looked_up_rows_and_dense_storage_agrees():
    torch.manual_seed(0)
    model = _Tiny()
    other = copy.deepcopy(model)
    start = model.table.weight.detach().clone()
    opt = _lazy(model)
    _train(model, opt, _batches())
    seen = torch.unique(torch.cat([ids.flatten() for ids, _ in _batches()]))
    state = opt.state[model.table.weight]
    (piece,) = state["shards"].values()
    assert torch.equal(torch.sort(piece["index"]).values, seen)
    assert piece["exp_avg"].shape == (len(seen), DIM) and float(state["step"]) == 4
    untouched = torch.ones(ROWS, dtype=torch.bool)
    untouched[seen] = False
    assert torch.equal(model.table.weight[untouched], start[untouched])
    _train(other, _lazy(other, dense_state=True), _batches())
    for a, b in zip(model.parameters(), other.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_pieces_of_one_split_load_into_another():
    """Moments saved as row halves (S(0)) or column halves (S(1)) rebuild any other shard exactly."""
    gen = torch.Generator().manual_seed(0)
    rows = torch.tensor([3, 17, 4, 40, 25, 9])
    m, v = torch.randn(6, DIM, generator=gen), torch.rand(6, DIM, generator=gen)
    full = torch.zeros(ROWS, DIM), torch.zeros(ROWS, DIM)
    full[0][rows], full[1][rows] = m, v

    def pieces(boxes):
        out = {}
        for (r0, nr), (c0, nc) in boxes:
            keep = (rows >= r0) & (rows < r0 + nr)
            out[f"{r0}:{c0}"] = {"box": [r0, nr, c0, nc], "index": rows[keep],
                                 "exp_avg": m[keep][:, c0:c0 + nc], "exp_avg_sq": v[keep][:, c0:c0 + nc]}
        return out

    by_rows = pieces([((0, 25), (0, DIM)), ((25, 25), (0, DIM))])
    by_cols = pieces([((0, ROWS), (0, 2)), ((0, ROWS), (2, 2))])
    for saved in (by_rows, by_cols):
        for box in (((0, ROWS), (0, DIM)), ((10, 20), (1, 3)), ((0, 13), (0, 2))):
            mom = RowMoments(box, torch.float32, "cpu")
            mom.absorb(saved)
            (r0, nr), (c0, nc) = box
            got_m = torch.zeros(nr, nc)
            got_m[mom._index[:mom.n] - r0] = mom.exp_avg
            assert torch.equal(got_m, full[0][r0:r0 + nr, c0:c0 + nc]), (box, saved.keys())
            want_rows = rows[(rows >= r0) & (rows < r0 + nr)]
            assert sorted(mom._index[:mom.n].tolist()) == sorted(want_rows.tolist())


def test_state_dict_round_trip_resumes_exactly():
    torch.manual_seed(0)
    model = _Tiny()
    fresh = copy.deepcopy(model)
    opt = _lazy(model)
    _train(model, opt, _batches()[:2])
    saved = copy.deepcopy(opt.state_dict())
    _train(model, opt, _batches()[2:])
    _train(fresh, _lazy(fresh), _batches()[:2])  # the same two steps, then a new optimizer from the saved state
    resumed = _lazy(fresh)
    resumed.load_state_dict(saved)
    _train(fresh, resumed, _batches()[2:])
    for a, b in zip(model.parameters(), fresh.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_bad_arguments():
    with pytest.raises(ValueError, match="lr"):
        LazyAdamW([nn.Parameter(torch.zeros(2))], lr=0)
    with pytest.raises(ValueError, match="betas"):
        LazyAdamW([nn.Parameter(torch.zeros(2))], betas=(0.9, 1.0))


def test_row_slots_follow_first_look_up_with_one_host_read():
    """Slots in order of first look-up (ascending within a call), the sorted index consistent, and each call
    reading the device once (the new-row count; ``test_host_reads.HostReads`` counts masks and reads)."""
    from .host_reads import HostReads

    mom = RowMoments(((100, 50), (0, 4)), torch.float32, "cpu")
    gen = torch.Generator().manual_seed(0)
    seen = {}  # global row -> slot
    for _ in range(20):
        size = int(torch.randint(0, 12, (1,), generator=gen))
        rows = torch.unique(torch.randint(0, 50, (size,), generator=gen))
        with HostReads() as reads:
            got = mom.slots(rows)
        for r in rows.tolist():
            seen.setdefault(r + 100, len(seen))
        assert got.tolist() == [seen[r + 100] for r in rows.tolist()]
        assert dict(reads.ops) == {"aten::_local_scalar_dense": 1}, reads.sites
    assert mom.n == len(seen) and mom.sorted_rows.tolist() == sorted(seen)
    assert mom.slot_of_sorted.tolist() == [seen[r] for r in sorted(seen)]
    assert mom._index[:mom.n].tolist() == sorted(seen, key=seen.get)


def test_weight_decay_on_looked_up_rows_is_decoupled_and_scaled_by_lr():
    """A table group with ``weight_decay``: each step, the rows looked up shrink by ``1 - lr * wd`` before
    SparseAdam's update (decoupled, as AdamW); the other rows stay as they were."""
    torch.manual_seed(0)
    model = _Tiny()
    ref = copy.deepcopy(model)
    lr, wd = 0.01, 0.5
    _train(model, LazyAdamW([{"params": list(model.head.parameters())},
                             {"params": [model.table.weight], "weight_decay": wd}], lr=lr), _batches())

    def decay(ids):  # decoupled, on the looked-up rows only
        with torch.no_grad():
            ref.table.weight[torch.unique(ids)] *= 1 - lr * wd

    _train_reference(ref, torch.optim.AdamW(ref.head.parameters(), lr=lr, weight_decay=0.0),
                     torch.optim.SparseAdam([ref.table.weight], lr=lr), decay)
    for (name, a), b in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=name)


def test_absorb_leaves_the_row_at_the_shard_end_to_the_next_shard():
    """Rows ``[row0, row0 + n_rows)`` are a shard's: a saved row at ``row0 + n_rows`` is the next shard's and
    does not come into this one (nor its moments)."""
    m = torch.arange(12, dtype=torch.float32).reshape(3, DIM)
    saved = {"0:0": {"box": [0, ROWS, 0, DIM], "index": torch.tensor([9, 10, 20]),
                     "exp_avg": m, "exp_avg_sq": m + 1}}
    mom = RowMoments(((10, 10), (0, DIM)), torch.float32, "cpu")
    mom.absorb(saved)
    assert mom.n == 1 and mom._index[:mom.n].tolist() == [10]
    assert torch.equal(mom.exp_avg, m[1:2]) and torch.equal(mom.exp_avg_sq, m[1:2] + 1)
