"""Four GPUs, one per rank, NCCL: each group of a 2x2 mesh reduces over its own ranks, and no more.

``pytest -m cuda`` on a machine with 4 or more GPUs; skipped elsewhere. A
mesh builds a NCCL group per row and per column, each with a gloo control
twin, in the same order on every rank. Reduced along one axis, each rank
must get the sum of its own row's (or column's) terms. Communicators built
from the wrong ranks (what splitting the world's communicator does when
gloo groups are built beside NCCL ones: ``toolkit.launcher._join``) give
another group's sum, or hang until the timeout. A tensor sent between two
ranks that share no group (rank 1 to rank 2) must arrive whole. The same
checks run on 4 CPU processes (gloo) wherever the suite runs.
"""
from __future__ import annotations

import pytest
import torch

from toolkit.launcher import launch
from toolkit.rank_pool import get_pool


def _mesh_axes_and_a_send(kind: str):
    import sbp_core as sc
    from sbp_core import sbp

    me = torch.distributed.get_rank()
    device = torch.device("cuda", torch.cuda.current_device()) if kind == "cuda" else torch.device("cpu")
    mesh = sc.placement(kind, [[0, 1], [2, 3]])
    term = torch.full((4, 3), float(10 ** me), device=device)  # rank r holds 10^r: every sum names its ranks
    B, P = sbp.broadcast, sbp.partial_sum
    want = {(B, P): [11, 11, 1100, 1100],  # along axis 1: the rows {0, 1} and {2, 3}
            (P, B): [101, 1010, 101, 1010],  # along axis 0: the columns {0, 2} and {1, 3}
            (P, P): [1111] * 4}
    for layout, sums in want.items():
        got = sc.to_global(term, placement=mesh, sbp=layout).to_global(sbp=(B, B)).to_local()
        if not torch.equal(got, torch.full_like(term, float(sums[me]))):
            raise AssertionError(f"rank {me}: {layout} reduced to {got[0, 0].item()}, expected {sums[me]}")
    sent = torch.arange(12.0, device=device).reshape(4, 3) if me == 1 else None
    x = sc.to_global(sent, placement=sc.placement(kind, [1]), sbp=(B,))
    y = x.to_global(placement=sc.placement(kind, [2]), sbp=(B,))
    if me == 2 and not torch.equal(y.to_local(), torch.arange(12.0, device=device).reshape(4, 3)):
        raise AssertionError(f"rank 2 received {y.to_local()}")
    return True


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 GPUs, one per rank")
def test_each_mesh_axis_reduces_over_its_own_ranks_on_gpus():
    assert launch(_mesh_axes_and_a_send, "cuda", 4, device="cuda", timeout=120) is True


def test_each_mesh_axis_reduces_over_its_own_ranks_on_cpus():
    assert get_pool(4).run(_mesh_axes_and_a_send, "cpu") == [True] * 4


def _twins_under_nccl(rank_sets):
    """``process_groups.ensure(rank_sets)`` under NCCL's control flow (``tests.as_nccl``), from no cached group:
    ``(the groups and twins this rank built, in order; for each group it is in, the ranks of its control
    group)``."""
    from unittest import mock

    import torch.distributed as dist

    from sbp_core import process_groups as pg
    from tests.as_nccl import world_read_as_nccl

    me = dist.get_rank()
    saved = dict(pg._groups), dict(pg._twins), set(pg._twinned)
    real_new, built = dist.new_group, []

    def new_group(ranks, *args, **kwargs):
        built.append((tuple(ranks), kwargs.get("backend") or "default"))
        return real_new(ranks, *args, **kwargs)

    pg._groups.clear(), pg._twins.clear(), pg._twinned.clear()
    try:
        with mock.patch.object(dist, "new_group", new_group), world_read_as_nccl():
            pg.ensure(rank_sets)
        controls = {key: dist.get_process_group_ranks(pg.control_group(g)) for key, g in pg._groups.items()
                    if me in key}
        return built, controls
    finally:
        pg._groups.clear(), pg._twins.clear(), pg._twinned.clear()
        pg._groups.update(saved[0]), pg._twins.update(saved[1]), pg._twinned.update(saved[2])


def test_every_rank_builds_every_twin_though_it_is_outside_several_groups():
    """Under NCCL each group gets a gloo twin, built by every rank of the world in one order: a rank outside
    two groups gets one object for both from torch (``NON_GROUP_MEMBER``), and must still build both twins,
    or every group after them pairs up out of step. Each rank here is outside two of the four groups."""
    sets = [(0, 1), (2, 3), (0, 2), (1, 3), (0, 1, 2, 3)]
    got = get_pool(4).run(_twins_under_nccl, sets)
    builds = [b for b, _ in got]
    assert all(b == builds[0] for b in builds), builds
    # In ensure's order (sorted): a group and its twin; the world group exists, only its twin is built.
    assert builds[0] == [(s, kind) for s in sorted(sets) for kind in (("gloo",) if len(s) == 4 else ("default", "gloo"))]
    for rank, (_, controls) in enumerate(got):
        assert controls == {s: list(s) for s in sets if rank in s}, (rank, controls)


def _world_gather_under_nccl():
    """Groups (0, 1) and (2, 3) only, no placement over the world, under NCCL's control flow: an object
    all-gather over every rank; ``(what it gathered, whether it went over a gloo twin)``."""
    from unittest import mock

    import torch.distributed as dist

    from sbp_core import process_groups as pg
    from sbp_core.boxing import collectives
    from tests.as_nccl import world_read_as_nccl

    saved = dict(pg._groups), dict(pg._twins), set(pg._twinned)
    real, groups = dist.all_gather_object, []

    def all_gather_object(out, obj, group=None):
        groups.append(group)
        return real(out, obj, group=group)

    pg._groups.clear(), pg._twins.clear(), pg._twinned.clear()
    try:
        with mock.patch.object(dist, "all_gather_object", all_gather_object), world_read_as_nccl():
            pg.ensure([(0, 1), (2, 3)])
            got = collectives.all_gather_object(dist.get_rank() * 10, [0, 1, 2, 3])
            twins = {id(twin) for _, twin in pg._twins.values()}
        return got, [id(g) in twins for g in groups]
    finally:
        pg._groups.clear(), pg._twins.clear(), pg._twinned.clear()
        pg._groups.update(saved[0]), pg._twins.update(saved[1]), pg._twinned.update(saved[2])


def test_an_object_gather_over_the_world_goes_over_a_twin_though_no_placement_spans_it():
    """A pipeline without data or tensor parallelism has no placement over the world; its world-wide host
    messages (the tied weights' layouts) still go over gloo, not through a device."""
    assert get_pool(4).run(_world_gather_under_nccl) == [([0, 10, 20, 30], [True])] * 4
