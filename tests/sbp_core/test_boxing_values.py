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
