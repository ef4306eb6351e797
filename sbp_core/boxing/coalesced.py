"""Coalesced boxing: many tensors' one-axis steps in one collective.

``box_many`` boxes each ``(local, src, dst)`` whose layouts differ on one
mesh axis only, by a valid planner step (``nd_plan.step_is_valid``) of the
kind ``S(d) -> B`` (all-gather), ``P(sum) -> S(d)`` (reduce-scatter) or
``P(sum) -> B`` (all-reduce), with one collective per (kind, axis, dtype)
group instead of one per tensor: each rank packs its pieces for rank ``k``
into chunk ``k`` of one flat buffer (chunks padded to the largest, which
happens only when splits are uneven), runs the collective, and unpacks.
All-reduce packs the same way (piece ``k`` of each flattened tensor in chunk
``k``) and runs as reduce-scatter plus all-gather, so each element is summed
in the order a per-tensor all-reduce sums it (``collectives.all_reduce_packed_start``). The
ledger records the one collective with its bytes, which equal the sum of
the per-tensor ones when no chunk is padded. Anything else is boxed one by
one. Every rank of the world calls it with the same tensors in the same order.

``box_many_async`` starts the same collectives without waiting (gradient
buckets overlapping backward, ``sbp_core.grad_buckets``); ``box_many`` is it
followed by ``wait()``.
"""
from __future__ import annotations

import math

import torch

from ..layout import Layout, shard_sizes, view_shape
from ..process_groups import world_rank
from . import box, collectives
from .nd_plan import step_is_valid


def _kind(src: Layout, dst: Layout):
    """``(axis, kind)`` when ``src -> dst`` is one coalescable step, else ``None``."""
    if src.placement != dst.placement or src.shape != dst.shape or src.dtype != dst.dtype:
        return None
    axes = [i for i, (a, b) in enumerate(zip(src.sbp, dst.sbp)) if a != b]
    if len(axes) != 1 or not step_is_valid(src.sbp, axes[0], dst.sbp[axes[0]]):
        return None
    a, b = src.sbp[axes[0]], dst.sbp[axes[0]]
    if a.is_split and b.is_broadcast:
        return axes[0], "all_gather"
    if a.is_partial and a.op == "sum" and b.is_split:
        return axes[0], "reduce_scatter"
    if a.is_partial and a.op == "sum" and b.is_broadcast:
        return axes[0], "all_reduce"
    return None


def _pieces(layout: Layout, axis: int, dim: int, coords, p: int) -> list:
    """Shapes of the ``p`` pieces along ``dim`` of the tensor the ranks along ``axis`` see."""
    view = list(view_shape(layout.shape, layout.placement.shape, layout.sbp, coords, axis))
    out = []
    for n in shard_sizes(view[dim], p):
        view[dim] = n
        out.append(tuple(view))
    return out


def _start(items, axis: int, kind: str):
    """Start this rank's one collective for ``items`` (``(local, src, dst)``); returns
    ``(pending, unpack)``, ``unpack(pending.wait())`` being the boxed locals."""
    placement = items[0][1].placement
    me = world_rank()
    coords = placement.coords(me)
    ranks = placement.axis_ranks(axis, me)
    p, idx = len(ranks), coords[axis]
    dtype, device = items[0][0].dtype, items[0][0].device
    if kind == "all_reduce":
        # Piece k of every (flattened) tensor into chunk k: see collectives.all_reduce_packed_start.
        pieces = [loc.reshape(-1).tensor_split(p) for loc, _, _ in items]
        counts = [sum(ps[k].numel() for ps in pieces) for k in range(p)]
        width = max(counts)
        packed = torch.empty(p, width, dtype=dtype, device=device)
        for k in range(p):
            torch.cat([ps[k] for ps in pieces], out=packed[k, :counts[k]])
            packed[k, counts[k]:].zero_()
        sizes = [[ps[k].numel() for k in range(p)] for ps in pieces]
        shapes = [loc.shape for loc, _, _ in items]
        del pieces  # views of the gradients: nothing below reads them again

        def unpack_reduced(got):
            out, offsets = [], [0] * p
            for numels, shape in zip(sizes, shapes):
                parts = []
                for k in range(p):
                    parts.append(got[k, offsets[k]:offsets[k] + numels[k]])
                    offsets[k] += numels[k]
                out.append(torch.cat(parts).view(shape))
            return out

        return collectives.all_reduce_packed_start(packed.view(-1), ranks, "sum", counts), unpack_reduced
    dims = [(src if kind == "all_gather" else dst).sbp[axis].axis for _, src, dst in items]
    shapes = [_pieces(src, axis, d, coords, p) for (_, src, _), d in zip(items, dims)]
    counts = [sum(math.prod(s[k]) for s in shapes) for k in range(p)]
    width = max(counts)
    if kind == "all_gather":
        send = torch.cat([loc.reshape(-1) for loc, _, _ in items])
        if counts[idx] < width:
            send = torch.cat([send, send.new_zeros(width - counts[idx])])

        def unpack_gathered(got):
            out, offsets = [], [0] * p
            for s, d in zip(shapes, dims):
                parts = []
                for k in range(p):
                    n = math.prod(s[k])
                    parts.append(got[k, offsets[k]:offsets[k] + n].view(s[k]))
                    offsets[k] += n
                out.append(torch.cat(parts, d))
            return out

        return collectives.all_gather_start(send, ranks), unpack_gathered
    chunks = []
    for k in range(p):
        flat = [loc.tensor_split(p, d)[k].reshape(-1) for (loc, _, _), d in zip(items, dims)]
        if counts[k] < width:
            flat.append(torch.zeros(width - counts[k], dtype=dtype, device=device))
        chunks.append(torch.cat(flat))
    sizes = [math.prod(s[idx]) for s in shapes]

    def unpack_scattered(got):
        return [t.view(s[idx]) for t, s in zip(got[:counts[idx]].split(sizes), shapes)]

    return collectives.reduce_scatter_start(torch.cat(chunks), ranks, "sum"), unpack_scattered


class PendingBoxing:
    """``box_many_async``'s boxings in flight: ``advance()`` waits for each first half and starts
    what follows it (an all-reduce's all-gather), ``wait()`` returns the boxed locals in the items' order."""

    def __init__(self, out: list, parts: list):
        self._out, self._parts = out, parts

    def advance(self) -> None:
        for _, pending, _ in self._parts:
            pending.advance()

    def wait(self) -> list:
        for idxs, pending, unpack in self._parts:
            for i, t in zip(idxs, unpack(pending.wait())):
                self._out[i] = t
        self._parts = []
        return self._out


def box_many_async(items) -> PendingBoxing:
    """Start boxing each ``(local, src, dst)`` to ``dst``: one asynchronous collective per coalescable
    group; anything else is boxed now, one by one. The locals may change once this returns
    (the collectives read packed copies)."""
    out = [None] * len(items)
    groups: dict = {}
    for i, (local, src, dst) in enumerate(items):
        kind = _kind(src, dst)
        if kind is None or world_rank() not in src.placement:
            out[i] = box(local, src, dst)
        else:
            groups.setdefault((src.placement, kind, src.dtype), []).append(i)
    parts = []
    for (_, (axis, kind), _), idxs in groups.items():
        parts.append((idxs, *_start([items[i] for i in idxs], axis, kind)))
    return PendingBoxing(out, parts)


def box_many(items) -> list:
    """Locals of each ``(local, src, dst)`` boxed to ``dst``; one collective per coalescable group."""
    return box_many_async(items).wait()
