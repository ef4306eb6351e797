"""Every boxing pair reproduces the global tensor and moves exactly the table's bytes.

Runs the same cases as ``python scripts/verify_boxing.py`` (1-d pairs on
1-4 ranks with uneven splits on 3, disjoint placements, 2-d pairs on 2x2).
"""
from scripts.verify_boxing import WORLD, verify
from toolkit.rank_pool import get_pool


def test_every_boxing_pair_is_exact():
    lines = list(verify(get_pool(WORLD)))
    assert len(lines) > 500
    bad = [line for line, ok in lines if not ok]
    assert not bad, "\n".join(bad)


def _together_and_alone():
    """Every disjoint-placement case started by ``box_cross_placement_start`` before any is waited (waited
    last to first), and each boxed alone by ``to_global``."""
    import torch

    import sbp_core as sc
    from sbp_core.boxing.cross_placement import box_cross_placement_start
    from scripts.verify_boxing import cases, source_locals

    me = torch.distributed.get_rank()
    items, alone = [], []
    for idx, case in enumerate(cases()):
        kind, src_ranks, src, dst_ranks, dst, shape = case
        if kind != "disjoint":
            continue
        x = sc.to_global(source_locals(case, idx)[1].get(me), placement=sc.placement("cpu", src_ranks), sbp=src)
        y = x.to_global(placement=sc.placement("cpu", dst_ranks), sbp=dst)
        items.append((x._local, x.layout, y.layout))
        alone.append(y._local)
    started = [box_cross_placement_start(*item) for item in items]
    together = [b.wait() for b in reversed(started)][::-1]
    return len(items), all(torch.equal(a, b) for a, b in zip(alone, together))


def test_disjoint_pairs_in_flight_together_equal_each_boxed_alone():
    out = get_pool(WORLD).run(_together_and_alone)
    assert all(n > 50 and same for n, same in out), out


def _mixed_partials():
    """On the 2x2 mesh, terms ``x[i][j]`` (rank ``2i + j``) laid out ``(P(sum), P(max))`` hold the value
    ``sum_i max_j x[i][j]`` (N-d SBP is nested: the later axis reduces first), and ``(P(max), P(sum))``
    ``max_i sum_j x[i][j]``. Boxed to broadcast, every rank of the mesh gets that value."""
    import torch

    import sbp_core as sc
    from sbp_core import sbp

    terms = torch.randn(2, 2, 4, 3, generator=torch.Generator().manual_seed(3))
    me = torch.distributed.get_rank()
    mesh = sc.placement("cpu", [[0, 1], [2, 3]])
    out = []
    for layout, want in (((sbp.partial_sum, sbp.partial_max), terms.amax(1).sum(0)),
                         ((sbp.partial_max, sbp.partial_sum), terms.sum(1).amax(0))):
        local = terms[me // 2][me % 2] if me in mesh else None
        x = sc.to_global(local, placement=mesh, sbp=layout)
        got = x.to_global(sbp=(sbp.broadcast, sbp.broadcast))
        out.append(None if me not in mesh else (got.to_local() - want).abs().max().item())
    return out


def test_partial_axes_of_different_ops_reduce_the_later_axis_first():
    for errs in get_pool(WORLD).run(_mixed_partials)[:4]:
        assert all(e < 1e-6 for e in errs), errs
