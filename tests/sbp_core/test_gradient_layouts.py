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


def _layer_norm_then_column_parallel(x, w, b, m):
    return torch.nn.functional.layer_norm(x, (8,), w, b) @ m


def _layer_norm_backward_of_partial():
    """Megatron's layer norm before a column-parallel linear: replicated input, its gradient arrives partial."""
    p = sc.placement("cpu", [0, 1])
    me = torch.distributed.get_rank()
    gen = torch.Generator().manual_seed(2)
    x, w, b, m, wo = (torch.randn(*s, generator=gen) for s in [(6, 8), (8,), (8,), (8, 4), (6, 4)])
    ref = [t.clone().requires_grad_() for t in (x, w, b)]
    (_layer_norm_then_column_parallel(*ref, m) * wo).sum().backward()
    glob = [sc.distribute(t, p, sbp.broadcast, requires_grad=True) for t in (x, w, b)]
    out = _layer_norm_then_column_parallel(*glob, sc.distribute(m, p, sbp.split(1)))
    with sc.comm_ledger() as ledger:
        (out * sc.distribute(wo, p, sbp.split(1))).sum().backward()
    if me not in p:
        return None
    return ([(g.grad.sbp, g.grad.full_tensor(), r.grad) for g, r in zip(glob, ref)], ledger.by_op())


def test_layer_norm_backward_reduces_a_partial_gradient_once():
    """With weight and bias gradients, layer norm's backward all-reduces the incoming partial gradient
    once (the input was replicated): all three gradients come out ``B``, not split nor partial."""
    for grads, ops in get_pool(WORLD).run(_layer_norm_backward_of_partial)[:2]:
        for name, (got_sbp, got, want) in zip(("x", "weight", "bias"), grads):
            assert got_sbp == (sbp.broadcast,), (name, got_sbp)
            assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item(), name
        assert set(ops) == {"all_reduce"}, ops
