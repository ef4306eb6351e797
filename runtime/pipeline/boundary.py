"""Stage boundaries as actors: cross-placement boxing split into its two sides.

A tensor that leaves stage ``s`` (laid out ``src`` on its placement) for
stage ``s+1`` (``dst`` on the next placement) is boxed by the transfer plan
of ``sbp_core.boxing.cross_placement.transfer_slices``: every source rank
has a *cut* actor per destination rank it feeds (it slices its local shard),
and every destination rank an *assemble* actor that reads the cuts of all
its sources — the runtime turns those cross-rank edges into send/receive
actors on channels of their own — and writes them into its new local shard.
Gradients go back the same way with the two layouts swapped. Bytes are
docs/design.md's disjoint-placement row (``S→S`` |T|, ``B→B`` p2·|T|).
"""
from __future__ import annotations

import torch

from sbp_core import GlobalTensor, Layout
from sbp_core.boxing.cross_placement import transfer_slices

from ..plan import ActorSpec
from .schedule import ASSEMBLE_QUOTA, CUT_QUOTA


def as_tuple(out) -> tuple:
    """A stage's boundary output as a tuple of tensors (a forward returns one tensor, or a tuple or list)."""
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def _cut(slices, select, dtype):
    """The cut's action: ``slices`` of the selected local, contiguous, in the boundary layout's ``dtype``
    (the shape and dtype the cut declares as its ``out``, so its channel sends the data alone).

    On a GPU a copy it makes runs on the copy thread's own stream (the executor's ``after_marks``), so the
    local it reads is recorded as in use there: its memory belongs to the compute thread's stream."""
    def cut(piece, value):
        value = select(value)
        local = value.to_local() if isinstance(value, GlobalTensor) else value
        out = local.detach()[slices].to(dtype).contiguous()
        if out.is_cuda:
            local.record_stream(torch.cuda.current_stream(out.device))
        return out

    return cut


def _sliced_shape(shape, slices) -> torch.Size:
    """The shape of ``t[slices]`` for a tensor ``t`` of ``shape`` (on the meta device: no data)."""
    return torch.empty(shape, device="meta")[slices].shape


def _assemble(layout: Layout, rank: int, pieces, requires_grad: bool, device):
    """Build ``rank``'s local shard from the received cuts; a ``GlobalTensor`` (a leaf when ``requires_grad``).

    One cut that is the whole shard (e.g. stage to stage on one device each) becomes the shard itself,
    uncopied: stages are disjoint (``PipelineStep`` refuses shared ranks), so every cut arrives through a
    receive actor in a buffer of its own.
    """
    shape = layout.local_shape(rank)
    whole = len(pieces) == 1 and _sliced_shape(shape, pieces[0]) == torch.Size(shape)

    def assemble(piece, *cuts):
        if whole:  # a cut is contiguous and in the layout's dtype (``_cut``, its declared ``out``)
            out = cuts[0] if device is None else cuts[0].to(device)  # received on the device already
        else:
            out = torch.empty(shape, dtype=layout.dtype, device=device)
            for slices, cut in zip(pieces, cuts):
                out[slices] = cut
        return GlobalTensor(out, layout, requires_grad=requires_grad)

    return assemble


def boundary_actors(name: str, producer: dict, src: Layout, dst: Layout, requires_grad: bool, device,
                    select=lambda value: value) -> tuple:
    """Actors boxing ``producer[rank]``'s output (laid out ``src``) to ``dst``; returns ``(actors, assembler)``.

    ``producer`` maps each rank of ``src.placement`` to the actor whose
    output (a ``GlobalTensor`` or its local) is sent. ``assembler`` maps each
    rank of ``dst.placement`` to its assemble actor's name, whose output is
    the ``GlobalTensor`` laid out ``dst``. ``select(output)`` picks the
    tensor from a producer's output (e.g. the boundary tensor of a stash).
    """
    plan = transfer_slices(src, dst)
    actors, assembler = [], {}
    for j in dst.placement.ranks:
        mine = [(k, i, ss, ds) for k, (i, jj, ss, ds) in enumerate(plan) if jj == j]
        cuts = []
        for k, i, ss, _ in mine:
            cut = f"{name}.cut{k}@{i}"
            out = (_sliced_shape(src.local_shape(i), ss), src.dtype)
            actors.append(ActorSpec(cut, _cut(ss, select, src.dtype), inputs=(producer[i],), queue="copy",
                                    quota=CUT_QUOTA, rank=i, out=out))
            cuts.append(cut)
        asm = f"{name}.assemble@{j}"
        actors.append(ActorSpec(asm, _assemble(dst, j, [ds for *_, ds in mine], requires_grad, device),
                                inputs=tuple(cuts), queue="copy", quota=ASSEMBLE_QUOTA, rank=j))
        assembler[j] = asm
    return actors, assembler
