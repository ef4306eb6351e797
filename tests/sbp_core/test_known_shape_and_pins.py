"""``to_global(local, ..., shape=)`` declares without an exchange; a plan's ``:inputs`` pins every input.

- Known shape on a 2x2 mesh (uneven ``S(0), S(0)`` rows): the global value is
  the shards', the local leaf gets its shard of the gradient, no collective
  runs, and a shard of the wrong shape raises on its own rank naming both
  shapes; a rank outside the placement passes an empty tensor.
- ``"<module>:inputs"`` boxes every positional global tensor input of the
  module (``":input"`` only the first).
- A plan's first matching pattern wins; frozen parameters stay frozen; a
  tied parameter named by its second name alone takes that entry's layout.
"""
from __future__ import annotations

import torch
from torch import nn

import sbp_core as sc
from sbp_core.layout import box_slices, local_box
from sbp_core.sbp import Broadcast, Split
from toolkit.rank_pool import get_pool

WORLD = 5
S0, B = Split(0), Broadcast()
MESH = [[0, 1], [2, 3]]


def _known_shape():
    p = sc.placement("cpu", MESH)
    me = torch.distributed.get_rank()
    full = torch.arange(22.0).view(11, 2)
    w = torch.randn(11, 2, generator=torch.Generator().manual_seed(0))
    box = local_box(full.shape, p.shape, (S0, S0), p.coords(me)) if me in p else None
    local = (full[box_slices(box)] if box else torch.empty(0)).clone().requires_grad_()
    with sc.comm_ledger() as ledger:
        g = sc.to_global(local, p, (S0, S0), shape=(11, 2))
    declared = ledger.count()
    (g * sc.distribute(w, p, (B, B))).sum().backward()
    value = g.full_tensor()
    try:
        sc.to_global(torch.zeros(5 if me == 1 else 3, 2), p, (S0, S0), shape=(11, 2))
        error = None
    except ValueError as e:
        error = str(e)
    if me not in p:
        return None
    return declared, torch.equal(value, full), torch.equal(local.grad, w[box_slices(box)]), error


def test_to_global_with_a_known_shape():
    out = get_pool(WORLD).run(_known_shape)
    for rank, (declared, value_ok, grad_ok, error) in enumerate(out[:4]):
        assert declared == 0 and value_ok and grad_ok
        if rank == 1:
            assert "rank 1's shard has shape [5, 2]" in error and "gives it [3, 2]" in error, error
        elif rank == 0:
            assert error is None  # 11 rows -> 6, 5 -> 3, 3 on mesh row 0
    assert out[4] is None


class _Pair(nn.Module):
    def forward(self, a, b):
        return a.sbp, b.sbp


class _Holder(nn.Module):
    def __init__(self):
        super().__init__()
        self.both, self.first = _Pair(), _Pair()


def _pins():
    p = sc.placement("cpu", [0, 1])
    m = sc.distribute_module(_Holder(), p, {"both:inputs": (B,), "first:input": (B,)})
    a = sc.distribute(torch.zeros(4, 2), p, (S0,))
    b = sc.distribute(torch.zeros(4), p, (S0,))
    return m.both(a, b), m.first(a, b)


def test_inputs_pin_boxes_every_input():
    both, first = get_pool(WORLD).run(_pins)[0]
    assert both == ((B,), (B,))
    assert first == ((B,), (S0,))


def _plan_precedence_and_frozen():
    p = sc.placement("cpu", [0, 1])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2))
    model[1].weight.requires_grad_(False)  # frozen: it must stay so
    full = {n: t.detach().clone() for n, t in model.named_parameters()}
    sc.distribute_module(model, p, {"0.weight": (S0,), "*.weight": (Split(1),), "*": (B,)})
    if torch.distributed.get_rank() not in p:
        return None
    return ({n: (q.sbp, q.requires_grad, torch.equal(q.full_tensor(), full[n])) for n, q in model.named_parameters()},
            sorted(n for n, q in model.named_parameters() if q.requires_grad))


def test_the_first_matching_pattern_wins_and_frozen_parameters_stay_frozen():
    """``0.weight`` matches all three patterns and takes the first's layout; ``1.weight`` the second's; the
    biases the catch-all's. A parameter frozen before ``distribute_module`` is frozen after it."""
    for got, trained in get_pool(WORLD).run(_plan_precedence_and_frozen)[:2]:
        assert got == {"0.weight": ((S0,), True, True), "0.bias": ((B,), True, True),
                       "1.weight": ((Split(1),), False, True), "1.bias": ((B,), True, True)}, got
        assert trained == ["0.bias", "0.weight", "1.bias"]


class _TiedHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.head = nn.Embedding(6, 4), nn.Linear(4, 6, bias=False)
        self.head.weight = self.embed.weight


def _tied_by_second_name():
    p = sc.placement("cpu", [0, 1])
    out = []
    for plan in ({"head.weight": (S0,)}, {"head.weight": (S0,), "embed.weight": (Split(1),)}):
        torch.manual_seed(0)
        model = _TiedHead()
        full = model.embed.weight.detach().clone()
        sc.distribute_module(model, p, plan)
        if torch.distributed.get_rank() in p:
            out.append((model.head.weight is model.embed.weight, model.embed.weight.sbp,
                        torch.equal(model.head.weight.full_tensor(), full)))
    return out or None


def test_a_tied_parameter_named_by_its_second_name_takes_that_layout():
    """``head.weight`` is ``embed.weight`` under a second name: a plan naming it alone splits the one parameter,
    which stays one parameter with its values; a plan naming both takes the first entry that matches either
    (an override put first wins)."""
    for got in get_pool(WORLD).run(_tied_by_second_name)[:2]:
        assert got == [(True, (S0,), True), (True, (S0,), True)], got
