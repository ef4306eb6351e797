"""Gradients through ``to_global`` equal the single-device gradients, for every pair.

Each case declares a global tensor from every rank's local leaf, boxes it to
another layout (same placement or across placements), takes a loss of the
result, and compares each rank's leaf gradient with autograd on one device.
Losses: ``sum(sin(y) * W)`` for split/broadcast results (every rank of a
broadcast computes the same loss), ``sum(y * W)`` summed over ranks for
partial results (the loss of a partial value must be linear in its terms).
"""
from __future__ import annotations

import itertools

import pytest
import torch

import sbp_core as sc
from sbp_core import sbp
from sbp_core.layout import take_local
from toolkit.rank_pool import get_pool

WORLD = 5
KINDS = [sbp.split(0), sbp.split(1), sbp.broadcast, sbp.partial_sum, sbp.partial_max, sbp.partial_min]


def _coords(ranks, r):
    return (ranks.index(r),)


def source(seed, ranks, a, shape):
    """The global value, each rank's local leaf value, and single-device leaves producing it."""
    g = torch.Generator().manual_seed(seed)
    full = torch.randn(shape, generator=g)
    if not a.is_partial:
        locals_ = {r: take_local(full, (len(ranks),), (a,), _coords(ranks, r)) for r in ranks}
        return locals_
    noise = {r: torch.randn(shape, generator=g) for r in ranks}
    if a.op == "sum":
        return noise
    sign = -1 if a.op == "max" else 1
    return {r: full if k == 0 else full + sign * noise[r].abs() for k, r in enumerate(ranks)}


def reference(locals_, ranks, a, shape, loss_of):
    """Single-device: the global value from the leaves, the loss, each rank's leaf gradient."""
    if a.is_split:
        leaves = [locals_[r].clone().requires_grad_() for r in ranks]
        y = torch.cat(leaves, a.axis)
    elif a.is_broadcast:
        leaf = locals_[ranks[0]].clone().requires_grad_()
        leaves = [leaf] * len(ranks)
        y = leaf
    else:
        leaves = [locals_[r].clone().requires_grad_() for r in ranks]
        stacked = torch.stack(leaves)
        y = {"sum": stacked.sum(0), "max": stacked.amax(0), "min": stacked.amin(0)}[a.op]
    loss_of(y).backward()
    return {r: leaf.grad for r, leaf in zip(ranks, leaves)}


def run_cases(cases):
    """Worker: every case on every rank; returns ``[(case index, max relative error or None)]``."""
    me = torch.distributed.get_rank()
    out = []
    for idx, (src_ranks, chain, dst_ranks, shape) in enumerate(cases):
        a = chain[0]
        locals_ = source(idx, src_ranks, a, shape)
        w = torch.randn(shape, generator=torch.Generator().manual_seed(10_000 + idx))
        last = chain[-1]
        dst_pl = sc.placement("cpu", dst_ranks)
        leaf = locals_[me].clone().requires_grad_() if me in src_ranks else None
        y = sc.to_global(leaf, placement=sc.placement("cpu", src_ranks), sbp=a)
        for i, s in enumerate(chain[1:]):
            pl = dst_pl if i == len(chain) - 2 else y.placement
            y = y.to_global(placement=pl, sbp=s)
        yl = y.to_local()
        if me in dst_ranks:
            if last.is_partial:
                loss = (yl * w).sum()
            else:
                wl = take_local(w, (len(dst_ranks),), (last,), _coords(dst_ranks, me))
                loss = (yl.sin() * wl).sum()
        else:
            loss = yl.sum()
        loss.backward()
        if me not in src_ranks:
            out.append((idx, None))
            continue
        ref_loss = (lambda v: (v * w).sum()) if last.is_partial else (lambda v: (v.sin() * w).sum())
        want = reference(locals_, src_ranks, a, shape, ref_loss)[me]
        err = ((leaf.grad - want).abs().max() / want.abs().max().clamp_min(1e-12)).item()
        out.append((idx, err))
    return out


def check(cases):
    results = get_pool(WORLD).run(run_cases, cases)
    bad = []
    for rank, per_rank in enumerate(results):
        for idx, err in per_rank:
            if err is not None and not err <= 1e-5:
                src_ranks, chain, dst_ranks, shape = cases[idx]
                bad.append(f"rank {rank}: {src_ranks} {chain} -> {dst_ranks} {shape}: rel err {err:.2e}")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("ranks,shape", [([0, 1], (6, 4)), ([0, 1, 2], (7, 5)), ([0, 1, 2, 3], (8, 6))])
def test_every_same_placement_pair(ranks, shape):
    check([(ranks, (a, b), ranks, shape) for a, b in itertools.product(KINDS, KINDS)])


@pytest.mark.parametrize("src,dst", [([0, 1], [2, 3]), ([0, 1], [2]), ([0], [1, 2]), ([0, 1], [2, 3, 4]), ([0, 1, 2], [1, 2])])
def test_every_cross_placement_pair(src, dst):
    shape = (7, 5)
    check([(src, (a, b), dst, shape) for a, b in itertools.product(KINDS, KINDS)])


def test_chains_take_the_gradient_layout_into_account():
    """Three-step chains: gradients arrive split, broadcast or partial and are boxed back."""
    kinds = [sbp.split(0), sbp.broadcast, sbp.partial_sum, sbp.partial_max]
    ranks = [0, 1, 2]
    check([(ranks, chain, ranks, (7, 5)) for chain in itertools.product(kinds, repeat=3)])
