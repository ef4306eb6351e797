"""Gradient buckets overlapping backward (``sbp_core.grad_buckets``) against one device.

dp2 on the shared 5-rank pool (ranks 2-4 stay outside the placement), a
4-layer MLP, two micro-batches: the first under ``defer_grad_boxing`` (no
traffic), the second boxes the sums in buckets while its backward runs. No
``box_grads`` call: backward must return with every gradient boxed to ``B``,
equal to the single-device gradient, with one all-reduce per bucket, the
first ones started before the first layer's gradient exists.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import sbp_core as sc
from sbp_core.sbp import Split
from toolkit.rank_pool import get_pool

WORLD = 5
S0 = (Split(0),)


def _mlp():
    torch.manual_seed(0)
    # The square weight's gradient comes out transposed: autograd copies it into a buffer laid out like
    # the weight (``new_empty_strided`` + ``copy_``), which must stay partial (no all-reduce outside the buckets).
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 10), nn.Tanh(),
                         nn.Linear(10, 4))


def _micro_batches():
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(6, 8, generator=gen), torch.randn(6, 4, generator=gen)) for _ in range(2)]


def _loss(model, x, y):
    return ((model(x) - y) ** 2).mean()


def _overlapped(bucket_bytes: int):
    ref = _mlp()
    ref_losses = []
    for x, y in _micro_batches():
        loss = _loss(ref, x, y)
        (loss / 2).backward()
        ref_losses.append(loss.item())
    p = sc.placement("cpu", [0, 1])
    model = sc.distribute_module(_mlp(), p, bucket_bytes=bucket_bytes)
    seen, losses = [], []
    xs = [tuple(sc.distribute(t, p, S0) for t in xy) for xy in _micro_batches()]
    with sc.defer_grad_boxing():
        losses.append(_loss(model, *xs[0]))
        (losses[0] / 2).backward()
    losses.append(_loss(model, *xs[1]))
    with sc.comm_ledger() as backward:  # the last backward only: the loss's own reduction is not counted
        model[0].weight.register_post_accumulate_grad_hook(lambda _: seen.append(backward.count("all_reduce")))
        (losses[1] / 2).backward()
    losses = [v.full_tensor() for v in losses]
    if torch.distributed.get_rank() not in p:
        return None
    losses = [float(v) for v in losses]
    err = max(((q.grad.full_tensor() - r.grad).abs().max() / r.grad.abs().max()).item()
              for q, r in zip(model.parameters(), ref.parameters()))
    return dict(grad_err=err, loss_err=max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)),
                boxed=all(q.grad.sbp == q.sbp for q in model.parameters()),
                all_reduces=backward.count("all_reduce"), buckets=len(model._grad_buckets.buckets),
                started_before_first_layer=seen[-1])


@pytest.mark.parametrize("bucket_bytes", [1, 1 << 20])
def test_buckets_overlap_backward_and_match_one_device(bucket_bytes):
    for r in get_pool(WORLD).run(_overlapped, bucket_bytes)[:2]:
        assert r["grad_err"] <= 1e-5 and r["loss_err"] <= 1e-5, r
        assert r["boxed"] and r["all_reduces"] == r["buckets"], r
        if bucket_bytes == 1:  # every parameter its own bucket: the later layers' were already on their way
            assert r["buckets"] == 8 and r["started_before_first_layer"] >= 1, r
        else:
            assert r["buckets"] == 1, r


def test_buckets_fill_from_the_last_leaf_with_a_small_first_bucket():
    """Backward reaches the last leaves first: they fill the first bucket, capped at ``first_bucket_bytes``."""
    from sbp_core.grad_buckets import GradBuckets

    leaves = [torch.zeros(100, requires_grad=True) for _ in range(4)]  # 400 bytes each
    gb = GradBuckets(leaves, [None] * 4, lambda leaf, g: None, bucket_bytes=1000, first_bucket_bytes=100)
    got = [[next(i for i, leaf in enumerate(leaves) if leaf is r()) for r in bucket] for bucket in gb.buckets]
    assert got == [[3], [2, 1], [0]], got


def _deferred_backward(always: bool):
    """Worker: ZeRO-2's use, two weights' partial gradients reduce-scattered to S(0) by buckets made with
    ``always``, backward run under ``defer_grad_boxing``; what ``on_done`` received."""
    from sbp_core.grad_buckets import GradBuckets

    gen = torch.Generator().manual_seed(2)
    x, w1, w2 = torch.randn(6, 8, generator=gen), torch.randn(8, 4, generator=gen), torch.randn(4, 2, generator=gen)
    ref = [w1.clone().requires_grad_(), w2.clone().requires_grad_()]
    (torch.tanh(x @ ref[0]) @ ref[1]).square().sum().backward()
    p = sc.placement("cpu", [0, 1])
    leaves = [sc.distribute(w, p, sc.sbp.broadcast, requires_grad=True) for w in (w1, w2)]
    got = []
    buckets = GradBuckets(leaves, [S0, S0], lambda leaf, boxed: got.append((leaf, boxed)), bucket_bytes=1,
                          always=always)
    with sc.defer_grad_boxing():
        (torch.tanh(sc.distribute(x, p, S0) @ leaves[0]) @ leaves[1]).square().sum().backward()
    del buckets
    got = [(next(i for i, leaf in enumerate(leaves) if leaf is g), boxed.sbp, boxed.full_tensor()) for g, boxed in got]
    if torch.distributed.get_rank() not in p:
        return None
    return [leaf.grad.sbp for leaf in leaves], got, [r.grad for r in ref]


def test_always_buckets_box_under_defer_grad_boxing():
    """``always=True`` (ZeRO-2: every micro-batch reduce-scattered) boxes even inside ``defer_grad_boxing``,
    to the single-device gradient; without it the deferred gradients are left partial, nothing received."""
    pool = get_pool(WORLD)
    for grad_sbps, got, _ in pool.run(_deferred_backward, False)[:2]:
        assert got == [] and grad_sbps == [(sc.sbp.partial_sum,)] * 2, (grad_sbps, got)
    for _, got, ref in pool.run(_deferred_backward, True)[:2]:
        assert sorted(i for i, _, _ in got) == [0, 1], got
        for i, sbp, full in got:
            assert sbp == S0, (i, sbp)
            assert (full - ref[i]).abs().max().item() <= 1e-5 * ref[i].abs().max().item(), i


def _after_a_raised_backward():
    """Worker: dp2, every parameter its own bucket; a backward that raises once the last two layers' buckets
    started, then (gradients zeroed) a backward that completes. Its gradients against one device's."""
    ref = _mlp()
    x, y = _micro_batches()[0]
    _loss(ref, x, y).backward()
    p = sc.placement("cpu", [0, 1])
    model = sc.distribute_module(_mlp(), p, bucket_bytes=1)
    gx, gy = (sc.distribute(t, p, S0) for t in (x, y))

    def boom(_):
        raise RuntimeError("boom")

    h = model[3](model[2](model[1](model[0](gx))))
    h.register_hook(boom)  # raises once layers 4 and 6 have their gradients
    try:
        ((model[6](model[5](model[4](h))) - gy) ** 2).mean().backward()
        raised = False
    except RuntimeError as e:
        raised = "boom" in str(e)
    model.zero_grad(set_to_none=True)
    _loss(model, gx, gy).backward()
    if torch.distributed.get_rank() not in p:
        return None
    return raised, [(q.grad.sbp == q.sbp, ((q.grad.full_tensor() - r.grad).abs().max() / r.grad.abs().max()).item())
                    for q, r in zip(model.parameters(), ref.parameters())]


def test_a_backward_after_one_that_raised_boxes_every_gradient():
    """A backward that raised ran no end-of-backward callback: the next backward starts its buckets afresh
    (each backward is an autograd graph task of its own) and returns every gradient boxed, as on one device."""
    for raised, grads in get_pool(WORLD).run(_after_a_raised_backward)[:2]:
        assert raised
        assert all(boxed and err <= 1e-5 for boxed, err in grads), grads


def test_a_bucket_packs_its_gradients_in_its_own_order_whatever_order_the_hooks_fire_in():
    """Every rank must pack a bucket's pieces alike: the hooks' order (autograd's threads) is not trusted."""
    from unittest import mock

    from sbp_core import grad_buckets

    p = sc.placement("cpu", [0])
    leaves = [sc.distribute(torch.zeros(n), p, (sc.sbp.broadcast,), requires_grad=True) for n in (3, 4, 5)]
    packed = []

    def box_many_async(items):
        packed.append([local.numel() for local, _, _ in items])
        return mock.Mock()

    gb = grad_buckets.GradBuckets(leaves, [(sc.sbp.broadcast,)] * 3, lambda leaf, g: None, bucket_bytes=1 << 20,
                                  first_bucket_bytes=1 << 20)
    with mock.patch.object(grad_buckets, "box_many_async", box_many_async):
        for order in ((0, 1, 2), (2, 0, 1)):
            gb.reset()
            gb._task = -1  # as in a backward whose end-of-backward callback is queued (outside one here: -1)
            for i in order:
                leaf = leaves[i]
                leaf.grad = sc.GlobalTensor(torch.ones(leaf.shape), leaf.layout.with_sbp((sc.sbp.partial_sum,)))
                gb._ready(leaf)
    assert packed == [[5, 4, 3], [5, 4, 3]], packed  # the bucket's order: from the last leaf
