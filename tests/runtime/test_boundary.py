"""Stage-boundary actors on one process: the assemble side, from cuts as receive actors hand them over."""
from __future__ import annotations

import torch

import sbp_core as sc
from runtime.pipeline.boundary import _assemble, _cut, boundary_actors
from sbp_core import Layout
from sbp_core.boxing.cross_placement import transfer_slices
from toolkit.search.rehearsal import fake_world

S0, B = sc.sbp.split(0), sc.sbp.broadcast


def _boxed(src: Layout, dst: Layout, full: torch.Tensor, j: int):
    """Rank ``j``'s assembled shard of ``full`` boxed ``src -> dst``, with the cuts copied as a receive would."""
    plan = transfer_slices(src, dst)
    mine = [(i, ss, ds) for i, jj, ss, ds in plan if jj == j]
    cuts = [_cut(ss, lambda v: v, src.dtype)(0, full.chunk(len(src.placement.ranks))[src.placement.ranks.index(i)]).clone()
            for i, ss, _ in mine]
    return _assemble(dst, j, [ds for *_, ds in mine], True, None)(0, *cuts), cuts


def test_a_whole_shard_cut_is_the_shard_uncopied_and_pieces_are_joined():
    with fake_world(6):  # placements over 6 ranks; nothing is communicated
        _check_assemble()


def _check_assemble():
    full = torch.arange(24.0).reshape(6, 4)
    one, two, three = sc.placement("cpu", [0]), sc.placement("cpu", [1, 2]), sc.placement("cpu", [3, 4, 5])
    # One device to one device: the received buffer becomes the leaf shard itself.
    out, cuts = _boxed(Layout(one, (B,), (6, 4), torch.float32), Layout(sc.placement("cpu", [1]), (B,), (6, 4),
                       torch.float32), full, 1)
    assert out.to_local().data_ptr() == cuts[0].data_ptr() and out.requires_grad and out.is_leaf
    assert torch.equal(out.to_local(), full)
    # S(0) on two devices to S(0) on three: rank 4's rows 2..3 come from two sources, written into a new buffer.
    out, cuts = _boxed(Layout(two, (S0,), (6, 4), torch.float32), Layout(three, (S0,), (6, 4), torch.float32), full, 4)
    assert len(cuts) == 2 and all(out.to_local().data_ptr() != c.data_ptr() for c in cuts)
    assert torch.equal(out.to_local(), full[2:4])


def test_cuts_declare_the_shape_and_dtype_they_produce():
    """A cut's ``out`` (its channel then sends the data alone) is what it returns, in the layout's dtype."""
    with fake_world(6):
        full = torch.arange(24.0).reshape(6, 4)
        two, three = sc.placement("cpu", [1, 2]), sc.placement("cpu", [3, 4, 5])
        src, dst = Layout(two, (S0,), (6, 4), torch.float32), Layout(three, (S0,), (6, 4), torch.float32)
        actors, _ = boundary_actors("b", {1: "p1", 2: "p2"}, src, dst, False, None)
        cuts = [a for a in actors if ".cut" in a.name]
        assert len(cuts) == 4 and all(a.out is None for a in actors if a not in cuts)
        for a in cuts:
            got = a.action(0, full.chunk(2)[two.ranks.index(a.rank)].to(torch.bfloat16))
            assert (got.shape, got.dtype) == (torch.Size(a.out[0]), a.out[1]) == (got.shape, torch.float32)
            assert got.is_contiguous()


def test_a_cut_across_columns_is_contiguous_and_a_list_output_is_a_tuple():
    """S(1) over 2 ranks to S(1) over 3: a cut takes some columns of a shard, which its channel can only send
    contiguous (the executor refuses a declared ``out`` that is not). A forward may return a list."""
    from runtime.pipeline.boundary import as_tuple

    with fake_world(6):
        full = torch.arange(36.0).reshape(3, 12)
        two, three = sc.placement("cpu", [1, 2]), sc.placement("cpu", [3, 4, 5])
        S1 = sc.sbp.split(1)
        src, dst = Layout(two, (S1,), (3, 12), torch.float32), Layout(three, (S1,), (3, 12), torch.float32)
        actors, _ = boundary_actors("b", {1: "p1", 2: "p2"}, src, dst, False, None)
        cuts = [a for a in actors if ".cut" in a.name]
        partial = 0
        for a in cuts:
            shard = full.chunk(2, dim=1)[two.ranks.index(a.rank)]
            got = a.action(0, shard)
            assert got.is_contiguous() and got.shape == torch.Size(a.out[0]), a.name
            partial += got.shape[1] < shard.shape[1]
        assert partial > 0  # some cut takes part of a shard's columns
    a, b = torch.ones(2), torch.zeros(3)
    assert as_tuple([a, b]) == (a, b) and as_tuple((a,)) == (a,) and as_tuple(a) == (a,)
