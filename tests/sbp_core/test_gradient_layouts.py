"""Which layout a gradient takes, and what its backward communicates."""
from __future__ import annotations

import torch

import sbp_core as sc
from sbp_core import sbp
from toolkit.rank_pool import get_pool

WORLD = 5


def _slice_backward():
    p = sc.placement("cpu", [0, 1, 2, 3])
    torch.manual_seed(0)
    x = sc.randn(8, 4, placement=p, sbp=sbp.broadcast, requires_grad=True)
    y = x.to_global(sbp=sbp.split(0))
    with sc.comm_ledger() as ledger:
        y.to_local().sum().backward()
    return x.grad.sbp, ledger.bytes, x.grad.full_tensor()


def test_slice_backward_pads_with_zeros_and_stays_partial():
    out = get_pool(WORLD).run(_slice_backward)
    for rank in range(4):
        grad_sbp, nbytes, full = out[rank]
        assert grad_sbp == (sbp.partial_sum,)
        assert nbytes == 0
        assert torch.equal(full, torch.ones(8, 4))


def _gather_backward():
    p = sc.placement("cpu", [0, 1, 2, 3])
    torch.manual_seed(0)
    x = sc.randn(8, 4, placement=p, sbp=sbp.split(0), requires_grad=True)
    y = x.to_global(sbp=sbp.broadcast).to_global(sbp=sbp.split(1))
    with sc.comm_ledger() as ledger:
        y.to_local().sum().backward()
    return x.grad.sbp, ledger.by_op(), x.grad.to_local()


def test_all_gather_backward_is_a_reduce_scatter():
    out = get_pool(WORLD).run(_gather_backward)
    for rank in range(4):
        grad_sbp, ops, local = out[rank]
        assert grad_sbp == (sbp.split(0),)
        # 8x4 fp32 partial gradient, each rank sends 3 of its 4 pieces.
        assert ops == {"reduce_scatter": 3 * 2 * 4 * 4}
        assert torch.equal(local, torch.ones(2, 4))


def _run_p2b(grad_partial: bool):
    p = sc.placement("cpu", [0, 1])
    me = torch.distributed.get_rank()
    leaf = torch.full((3,), float(me + 1), requires_grad=True) if me in p else None
    y = sc.to_global(leaf, placement=p, sbp=sbp.partial_sum).to_global(sbp=sbp.broadcast)
    if grad_partial:
        # The gradient of a slice arrives partial (zero-padded): P -> B's backward must all-reduce it.
        y = y.to_global(sbp=sbp.split(0))
    local = y.to_local()
    weight = torch.arange(1.0, 4.0)[: local.shape[0]]
    with sc.comm_ledger() as ledger:
        (local * weight).sum().backward()
    return ledger.by_op(), (leaf.grad if leaf is not None else None)


def test_partial_to_broadcast_backward_follows_the_gradients_layout():
    pool = get_pool(WORLD)
    # Gradient arrives broadcast: each partial term's gradient is it, no traffic.
    out = pool.run(_run_p2b, False)
    for rank in range(2):
        ops, grad = out[rank]
        assert ops == {}
        assert torch.equal(grad, torch.arange(1.0, 4.0))
    # Gradient arrives partial: it is all-reduced first.
    out = pool.run(_run_p2b, True)
    for rank in range(2):
        ops, grad = out[rank]
        assert set(ops) == {"all_reduce"}
        assert torch.equal(grad, torch.tensor([1.0, 2.0, 1.0]))


def _cross_placement_backward():
    src = sc.placement("cpu", [0, 1])
    dst = sc.placement("cpu", [2, 3, 4])
    me = torch.distributed.get_rank()
    torch.manual_seed(1)
    x = sc.randn(6, 5, placement=src, sbp=sbp.split(1), requires_grad=True)
    y = x.to_global(placement=dst, sbp=sbp.split(0))
    with sc.comm_ledger() as ledger:
        (y.to_local() * 2).sum().backward()
    return ledger.by_op(), (x.grad.to_local() if me in src else None)


def test_cross_placement_backward_sends_grads_back():
    out = get_pool(WORLD).run(_cross_placement_backward)
    total = sum(o[0].get("send", 0) for o in out)
    assert total == 6 * 5 * 4  # every element's gradient crosses back once
    for rank in (0, 1):
        assert torch.equal(out[rank][1], torch.full((6, [3, 2][rank]), 2.0))
