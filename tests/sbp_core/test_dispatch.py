"""The dispatcher: cost-chosen signatures, lazy partials, caching, and loud errors."""
from __future__ import annotations

import torch

import sbp_core as sc
from sbp_core import sbp
from sbp_core.dispatch import _cache
from toolkit.rank_pool import get_pool

WORLD = 5


def _uvw():
    p = sc.placement("cpu", [0, 1])
    torch.manual_seed(0)
    u, v, w = torch.randn(8, 6), torch.randn(6, 10), torch.randn(10, 3)
    gu = sc.distribute(u, p, sbp.split(1))
    gv = sc.distribute(v, p, sbp.split(0))
    gw = sc.distribute(w, p, sbp.broadcast)
    with sc.comm_ledger() as lazy, sc.explain() as steps:
        out = (gu @ gv @ gw).full_tensor()
    with sc.comm_ledger() as eager:
        uv = (gu @ gv).to_global(sbp=sbp.broadcast)
        out2 = (uv @ gw).full_tensor()
    if torch.distributed.get_rank() not in p:
        return None
    return lazy.by_op(), eager.by_op(), (out - u @ v @ w).abs().max().item(), (out2 - out).abs().max().item(), [s[3] for s in steps]


def test_partial_stays_partial_until_needed():
    res = get_pool(WORLD).run(_uvw)
    for rank in (0, 1):
        lazy, eager, err, err2, outs = res[rank]
        # One all-reduce of the 8x3 result (ring: 2(p-1)/p of 96 bytes per rank) ...
        assert lazy == {"all_reduce": 96}
        # ... instead of the 8x10 intermediate.
        assert eager == {"all_reduce": 320}
        assert err < 1e-5 and err2 < 1e-5
        assert outs[:2] == [[(sbp.partial_sum,)], [(sbp.partial_sum,)]]


def _errors(kind):
    p = sc.placement("cpu", [0, 1])
    x = sc.distribute(torch.randn(4, 4), p, sbp.partial_sum)
    if kind == "no_rule":
        torch.linalg.qr(x)
    elif kind == "inplace":
        x.exp_()
    elif kind == "placements":
        y = sc.distribute(torch.randn(4, 4), sc.placement("cpu", [2, 3]), sbp.broadcast)
        x + y
    elif kind == "local":
        x + torch.ones(4, 4)


def test_errors_name_the_op_and_layouts():
    pool = get_pool(WORLD)
    for kind, words in [
        ("no_rule", "no SBP rule for aten.linalg_qr.default with inputs ['(4, 4) (P(sum))']"),
        ("inplace", "aten.exp_.default cannot run with inputs ['(4, 4) (P(sum))'] in place; valid signatures"),
        ("placements", "mixes global tensors on placement(type='cpu', ranks=[0, 1]) and placement(type='cpu', ranks=[2, 3])"),
        ("local", "mixes a global tensor with a local (4, 4) tensor"),
    ]:
        outs = pool.outcomes(_errors, kind)
        assert all(not o.ok and words in o.message for o in outs), (kind, [o.message for o in outs])


def _cached():
    p = sc.placement("cpu", [0, 1, 2, 3, 4])
    x = sc.distribute(torch.randn(10, 4), p, sbp.split(0))
    w = sc.distribute(torch.randn(4, 4), p, sbp.broadcast)
    (x @ w).relu()
    before = len(_cache)
    for _ in range(5):
        (x @ w).relu()
    return len(_cache) - before


def test_decisions_are_cached():
    assert get_pool(WORLD).run(_cached) == [0] * WORLD
