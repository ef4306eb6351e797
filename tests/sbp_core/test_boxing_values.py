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
