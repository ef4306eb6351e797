"""After a resume in another layout, one placement's ranks put torch's generators back in step
(``toolkit.checkpoint.rng.agree_within``): a dispatched random op draws the global draw on each of them."""
from __future__ import annotations

import torch

from toolkit.rank_pool import get_pool


def _agree(seeds):
    """Placements (0, 1) and (2, 3); each rank seeded ``seeds[rank]``: (agreed?, a draw after, agreed again?)."""
    import torch.distributed as dist

    from toolkit.checkpoint.rng import agree_within
    from toolkit.mesh import stage_placements

    placements = stage_placements(2, 1, 2)  # every rank builds every placement's groups
    me = dist.get_rank()
    torch.manual_seed(seeds[me])
    ranks = next(p.ranks for p in placements if me in p.ranks)
    first = agree_within(ranks)
    return first, torch.rand(3).tolist(), agree_within(ranks)


def test_a_placements_ranks_take_its_first_ranks_generator_state_where_they_differ():
    pool = get_pool(4)
    (a, b, c, d) = pool.run(_agree, [1, 2, 3, 3])
    torch.manual_seed(1)
    one = torch.rand(3).tolist()
    torch.manual_seed(3)
    three = torch.rand(3).tolist()
    assert a[:2] == b[:2] == (True, one) and c[:2] == d[:2] == (False, three)
    assert not any(r[2] for r in (a, b, c, d))  # in step now: nothing left to agree
