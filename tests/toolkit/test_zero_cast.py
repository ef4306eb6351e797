"""The cast ZeRO is written with: coalesced boxing, differentiable group casts, rematerialisation.

- ``box_many`` equals boxing each tensor on its own to 1e-6 relative (uneven splits on 3
  ranks, a 2x2 mesh, a step that cannot be coalesced, layouts that differ on
  both mesh axes) with one collective per kind of step (and round), sending
  the same bytes when splits are even;
- ``cast`` and ``cast_group`` (fp32 -> bf16 narrowing, ``S -> B``) have the
  gradient of ``x.to(dtype).to_global(sbp)``: ``S`` back, reduce-scattered;
- with ``remat=True`` inside ``remat_saved()`` no gathered tensor is alive
  between forward and backward, and the gradients are unchanged.
"""
from __future__ import annotations

import torch

import sbp_core as sc
from sbp_core.boxing import box
from sbp_core.boxing.coalesced import box_many
from sbp_core.cast import _live, cast, cast_group, remat_saved
from sbp_core.sbp import Broadcast, Partial, Split
from toolkit.rank_pool import get_pool

WORLD = 5
B, P, S0, S1 = Broadcast(), Partial("sum"), Split(0), Split(1)
UNEVEN = [(5, 3), (7,), (4, 6), (2, 5)]
EVEN = [(8, 3), (12,), (4, 6), (4, 5)]
EVEN_BOTH = [(8, 4), (12,), (4, 8), (4, 4)]  # every dim and numel divisible by 4: the planned even groups


def _partial(full, p, sbp):
    """A global tensor laid out ``sbp`` whose partial axes hold rank-dependent terms."""
    g = sc.distribute(full, p, tuple(B if s.is_partial else s for s in sbp))
    me = torch.distributed.get_rank()
    bump = torch.full_like(g._local, float(me + 1)) if me in p else g._local
    terms = sc.GlobalTensor(g._local + bump, g.layout.with_sbp(sbp))
    minus = sc.GlobalTensor(bump, g.layout.with_sbp(sbp)).full_tensor()  # sum of the bumps
    return terms, minus


def _box_many_case(ranks, pairs, shapes):
    """Worker: ``pairs`` of (src sbp, dst sbp) per shape; max error against per-tensor boxing, #collectives."""
    p = sc.placement("cpu", ranks)
    torch.manual_seed(0)
    items, fulls = [], []
    for shape, (src, dst) in zip(shapes, pairs):
        full = torch.randn(shape)
        g, _ = _partial(full, p, src) if any(s.is_partial for s in src) else (sc.distribute(full, p, src), None)
        items.append((g._local, g.layout, g.layout.with_sbp(dst)))
        fulls.append(full)
    with sc.comm_ledger() as one_by_one:
        want = [box(*it) for it in items]
    with sc.comm_ledger() as coalesced:
        got = box_many(items)
    if torch.distributed.get_rank() not in p:
        return None
    # relative: on gloo the coalesced reduce-scatter sums in group-rank order, a per-tensor one in ring order
    err = max((a - b).abs().max().item() / b.abs().max().item() if a.numel() else 0.0 for a, b in zip(got, want))
    shapes_ok = all(a.shape == b.shape for a, b in zip(got, want))
    return err, shapes_ok, one_by_one.count(), coalesced.count(), one_by_one.bytes, coalesced.bytes


def test_box_many_equals_boxing_each():
    pool = get_pool(WORLD)
    cases = [
        ([0, 1, 2], [((S0,), (B,)), ((S0,), (B,)), ((S1,), (B,)), ((P,), (S0,))], UNEVEN),  # padded chunks
        ([0, 1, 2, 3], [((S0,), (B,))] * 2 + [((P,), (S0,))] * 2, EVEN),  # the same bytes
        ([0, 1], [((P,), (B,)), ((P,), (B,)), ((P,), (S1,)), ((S0,), (B,))], UNEVEN),
        ([[0, 1], [2, 3]], [((S0, S1), (B, S1)), ((S0, B), (B, B)), ((P, S1), (S0, S1)), ((S0, S0), (B, S0))], EVEN),
        ([0, 1, 2, 3], [((S1,), (B,)), ((P,), (B,)), ((P,), (S1,)), ((S0,), (B,))], EVEN_BOTH),
        # partial on both mesh axes (sequence parallelism's replicated weights): two rounds of coalesced steps
        ([[0, 1], [2, 3]], [((P, P), (B, B)), ((P, P), (B, B)), ((P, P), (B, S0)), ((P, S0), (B, S0))], EVEN),
    ]
    for ranks, pairs, shapes in cases:
        res = [r for r in pool.run(_box_many_case, ranks, pairs, shapes) if r is not None]
        for err, shapes_ok, n_each, n_coalesced, bytes_each, bytes_coalesced in res:
            assert err <= 1e-6 and shapes_ok, (ranks, pairs, err)
            assert n_coalesced < n_each, (ranks, n_each, n_coalesced)
            if shapes is not UNEVEN:
                assert bytes_coalesced == bytes_each, (ranks, bytes_each, bytes_coalesced)


def _cast_grads(remat: bool, dtype):
    """Worker: gradients of to_global / cast / cast_group, #gathered tensors alive after forward, traffic."""
    p = sc.placement("cpu", [0, 1, 2, 3])
    torch.manual_seed(0)
    fulls = [torch.randn(s) for s in [(8, 3), (12, 2), (4, 4)]]
    # data split by rows: the weights' gradients d^T @ g arrive partial, as in data parallelism
    ds = [sc.distribute(torch.randn(6, f.shape[0]), p, (S0,)) for f in fulls]
    out = []
    for how in ("to_global", "cast", "cast_group"):
        xs = [sc.distribute(f, p, (S0,), requires_grad=True) for f in fulls]
        with remat_saved():
            if how == "to_global":
                outs = [x.to_global(sbp=(B,)) for x in xs]
            elif how == "cast":
                outs = [cast(x, (B,), dtype, remat=remat) for x in xs]
            else:
                outs = cast_group(xs, [(B,)] * len(xs), dtype, remat=remat)
            # a product saves its operands: the gathered copies, unless rematerialised
            loss = sum(cast(d.to(o.dtype) @ (o * o), dtype=torch.float32).sum() for o, d in zip(outs, ds))
        del outs
        n_alive = len(_live)
        with sc.comm_ledger() as ledger:
            loss.backward()
        grads = [(x.grad.full_tensor(), x.grad.sbp, x.grad.dtype) for x in xs]
        out.append((grads, n_alive, ledger.by_op()))
    return out


def test_cast_and_cast_group_gradients():
    for remat in (False, True):
        for dtype in (None, torch.bfloat16):
            for res in get_pool(WORLD).run(_cast_grads, remat, dtype)[:4]:
                (ref, _, _), (one, n1, ops1), (group, n2, ops2) = res
                for (g1, s1, d1), (g2, s2, d2), (r, _, _) in zip(one, group, ref):
                    assert s1 == s2 == (S0,) and d1 == d2 == torch.float32
                    assert torch.equal(g1, g2)  # coalesced or not: the same sums
                    tol = 0 if dtype is None else 2e-2 * r.abs().max().item()
                    assert (g1 - r).abs().max().item() <= tol, (dtype, remat)
                for how, n_alive, by_op in (("cast", n1, ops1), ("cast_group", n2, ops2)):
                    assert by_op.get("reduce_scatter", 0) > 0, (how, by_op)
                    if remat:
                        assert n_alive == 0, how  # autograd holds handles, not the gathered copies
                        assert by_op.get("all_gather", 0) > 0, (how, by_op)  # gathered again for backward
                    else:
                        assert "all_gather" not in by_op, (how, by_op)


def _remat_after_in_place(modify: bool):
    """Worker: a remat cast_group's product, its first input scaled in place (or not) before backward."""
    p = sc.placement("cpu", list(range(WORLD)))
    torch.manual_seed(0)
    fulls = [torch.randn(s) for s in [(10, 3), (5, 2)]]
    xs = [sc.distribute(f, p, (S0,), requires_grad=True) for f in fulls]
    with remat_saved():
        outs = cast_group(xs, [(B,)] * len(xs), remat=True)
        loss = sum((o * o).sum() for o in outs)  # saves handles of the gathered copies
    del outs
    if modify:
        with torch.no_grad():
            xs[0].mul_(2.0)  # an optimizer step before backward
    try:
        loss.backward()
    except RuntimeError as exc:
        return str(exc)
    return [(x.grad.full_tensor(), x.grad.sbp) for x in xs]


def test_remat_cast_group_refuses_an_input_modified_in_place():
    """Rebuilding the gathered copies from an input changed since forward would give the gradient of
    another forward, silently: backward raises instead. Unchanged: the gradient of sum(x * x), 2 x."""
    pool = get_pool(WORLD)
    torch.manual_seed(0)
    fulls = [torch.randn(s) for s in [(10, 3), (5, 2)]]
    for grads in pool.run(_remat_after_in_place, False):
        for (got, got_sbp), full in zip(grads, fulls):
            assert got_sbp == (S0,)
            assert (got - 2 * full).abs().max().item() <= 1e-6 * full.abs().max().item()
    for msg in pool.run(_remat_after_in_place, True):
        assert isinstance(msg, str), "backward ran on the modified input without an error"
        assert "modified in place" in msg, msg


def _pending_holds_no_input():
    """``box_many_async`` of (P, P) -> (B, B) gradients (two rounds) on a 2x2 mesh: once started, the
    inputs' locals are not kept alive (a ZeRO-3 unit's full-size gradients while its reduction is in
    flight); the result equals boxing each."""
    import gc
    import weakref

    from sbp_core.boxing.coalesced import box_many_async

    p = sc.placement("cpu", [[0, 1], [2, 3]])
    torch.manual_seed(0)
    items, refs, want = [], [], []
    for shape in EVEN:
        g, _ = _partial(torch.randn(shape), p, (P, P))
        dst = g.layout.with_sbp((B, B))
        want.append(box(g._local, g.layout, dst))
        local = g._local.clone()
        refs.append(weakref.ref(local))
        items.append((local, g.layout, dst))
        del g, local
    pending = box_many_async(items)
    del items
    gc.collect()
    alive = sum(r() is not None for r in refs)
    got = pending.wait()
    if torch.distributed.get_rank() not in p:
        return None
    return alive, max((a - b).abs().max().item() / b.abs().max().item() for a, b in zip(got, want))


def test_pending_boxing_lets_its_inputs_go():
    for alive, err in [r for r in get_pool(WORLD).run(_pending_holds_no_input) if r is not None]:
        assert alive == 0 and err <= 1e-6, (alive, err)
