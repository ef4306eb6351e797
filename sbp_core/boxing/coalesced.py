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
in one order wherever it sits in the buffer, the coalesced reduce-scatter's
(``collectives.reduce_scatter_start``: on gloo the terms of an all-to-all in
group-rank order, which a per-tensor gloo collective's ring may differ from
in the last bit; ``collectives.all_reduce_packed_start``). The
ledger records the one collective with its bytes, which equal the sum of
the per-tensor ones when no chunk is padded. Layouts that differ on several
mesh axes (a replicated weight's gradient, partial on the data- and
tensor-parallel axes under sequence parallelism) take the steps a single
boxing plans (``nd_plan.plan``), in rounds: round ``r`` boxes every item's
``r``-th step, coalesced as above, once the round before is done, wherever
every step is one of the three kinds. Anything else is boxed one by
one. Every rank of the world calls it with the same tensors in the same order.

``box_many_async`` starts the same collectives without waiting (gradient
buckets overlapping backward, ``sbp_core.grad_buckets``): the first round's,
and each later one on ``advance()`` or ``wait()``; ``box_many`` is it
followed by ``wait()``.

Planned: the grouping, piece shapes, chunk sizes and offsets depend only on
the items' layouts, so they are computed once per tuple of ``(src, dst)``
layouts (a bucket, a ZeRO unit, a refresh: the same list every step). When
every tensor splits evenly (no padding), packing is one ``torch.cat`` of
each tensor seen as ``p`` rows (a view along dim 0) and unpacking one copy
per tensor; otherwise the general per-piece path below runs.
"""
from __future__ import annotations

import math

import torch

from ..layout import Layout, shard_sizes, view_shape
from ..process_groups import world_rank
from . import box, collectives, nd_plan
from .collective_plans import _pieces_back, _pieces_first
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
    if kind == "all_reduce":
        return (_all_reduce_two if len(ranks) == 2 else _all_reduce_chunked)(items, ranks)
    return _gather_or_scatter(items, axis, kind, ranks, coords)


def _all_reduce_two(items, ranks):
    """Two ranks: every element is a + b whichever algorithm runs (collectives.all_reduce_packed_start),
    so the tensors go whole, one after another, and come back as views of the reduced buffer."""
    dtype, device = items[0][0].dtype, items[0][0].device
    sizes = [loc.numel() for loc, _, _ in items]
    shapes = [loc.shape for loc, _, _ in items]
    n = sum(sizes)
    half = (n + 1) // 2
    packed = torch.empty(2 * half, dtype=dtype, device=device)
    torch.cat([loc.reshape(-1) for loc, _, _ in items], out=packed[:n])
    packed[n:].zero_()

    def unpack_whole(got):
        return [t.view(shape) for t, shape in zip(got.view(-1)[:n].split(sizes), shapes)]

    return collectives.all_reduce_packed_start(packed, ranks, "sum", [half, n - half], owned=True), unpack_whole


def _all_reduce_chunked(items, ranks):
    """Piece k of every (flattened) tensor into chunk k: see collectives.all_reduce_packed_start."""
    p = len(ranks)
    dtype, device = items[0][0].dtype, items[0][0].device
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


def _gather_or_scatter(items, axis: int, kind: str, ranks, coords):
    """All-gather (``S -> B``) or reduce-scatter (``P -> S``) of every item in one collective, padded to the
    widest rank's share."""
    p, idx = len(ranks), coords[axis]
    dtype, device = items[0][0].dtype, items[0][0].device
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
    """``box_many_async``'s boxings in flight, round by round (a round: every item's next one-axis step).

    ``advance()`` moves every collective of the current round on (an
    all-reduce's all-gather starts after its reduce-scatter) and, where
    items have steps left, waits for the round and starts the next;
    ``wait()`` runs the rounds to the end (starting what ``advance`` has
    not) and returns the boxed locals in the items' order. It holds no
    reference to the items' locals once their first round has started.
    """

    def __init__(self, out: list, plan: "_Plan", locals_: list, into=None):
        self._out, self._plan, self._into = out, plan, into
        self._now = list(locals_)  # each item's local as of the current round
        for i in plan.single:  # boxed already
            self._now[i] = None
        self._round, self._parts = -1, []
        self._start_next()

    def _start_next(self) -> None:
        self._round += 1
        if self._round >= len(self._plan.rounds):
            self._parts = []
            return
        into, last = self._into, self._plan.last
        parts = []
        for idxs, axis, kind, ranks, even, steps in self._plan.rounds[self._round]:
            locals_ = [self._now[i] for i in idxs]
            if even is not None and not (kind == "all_reduce" and len(ranks) == 2):  # two: _start packs whole
                sub_into = [into[i] if into is not None and last[i] == self._round else None for i in idxs]
                parts.append((idxs, *even.start(locals_, ranks, sub_into)))
            else:
                parts.append((idxs, *_start([(t, src, dst) for t, (src, dst) in zip(locals_, steps)], axis, kind)))
            for i in idxs:  # the collectives read packed copies: the locals (a unit's gradients) may go
                self._now[i] = None
        self._parts = parts

    def _finish_round(self) -> None:
        into, last = self._into, self._plan.last
        for idxs, pending, unpack in self._parts:
            for i, t in zip(idxs, unpack(pending.wait())):
                if last[i] == self._round:
                    self._out[i] = t if into is None or into[i] is None or into[i] is t else into[i].copy_(t)
                else:
                    self._now[i] = t
        self._parts = []

    def advance(self) -> None:
        for _, pending, _ in self._parts:
            pending.advance()
        if self._round + 1 < len(self._plan.rounds):
            self._finish_round()
            self._start_next()

    def wait(self) -> list:
        while self._parts:
            self._finish_round()
            self._start_next()
        self._now = []
        return self._out


class _EvenGroup:
    """One collective for tensors that all split evenly along their dims: offsets fixed once.

    Chunk ``k`` of the packed buffer is every tensor's piece ``k`` (flattened),
    in item order, exactly as ``_start`` packs it; only the copies differ.
    """

    def __init__(self, layouts, axis: int, kind: str, coords, p: int):
        self.kind, self.p = kind, p
        self.items = []  # (view shape the group sees, dim cut in p pieces, piece shape, piece numel)
        for src, dst in layouts:
            view = view_shape(src.shape, src.placement.shape, src.sbp, coords, axis)
            if kind == "all_reduce":
                n = view.numel()
                self.items.append((view, None, (n // p,), n // p))
                continue
            d = (src if kind == "all_gather" else dst).sbp[axis].axis
            piece = view[:d] + (view[d] // p,) + view[d + 1:]
            self.items.append((view, d, piece, math.prod(piece)))
        self.offsets = [0]
        for *_, n in self.items:
            self.offsets.append(self.offsets[-1] + n)

    @staticmethod
    def fits(layouts, axis: int, kind: str, coords, p: int) -> bool:
        for src, dst in layouts:
            view = view_shape(src.shape, src.placement.shape, src.sbp, coords, axis)
            if kind == "all_reduce":
                if view.numel() % p:
                    return False
            elif view[(src if kind == "all_gather" else dst).sbp[axis].axis] % p:
                return False
        return True

    def rows(self, local, i: int):
        """``local`` (the whole tensor the group sees) as ``(p, piece numel)``: row ``k`` is piece ``k``."""
        view, d, piece, n = self.items[i]
        if d is None or d == 0:
            return local.reshape(self.p, n)
        split_view, order = _pieces_first(view, d, self.p)
        return local.reshape(split_view).permute(order).reshape(self.p, n)

    def joined(self, rows, i: int, out=None):
        """Inverse of ``rows``: a ``(p, piece numel)`` view back as the whole tensor (one copy),
        written into ``out`` when given (a contiguous ``out`` along dim 0: that copy itself)."""
        view, d, piece, n = self.items[i]
        if d is None or d == 0:
            if out is not None and out.is_contiguous():
                out.view(self.p, n).copy_(rows)
                return out
            whole = rows.reshape(view)
        else:
            whole = rows.reshape((self.p,) + tuple(piece)).permute(_pieces_back(len(piece), d)).reshape(view)
        return whole if out is None else out.copy_(whole)

    def start(self, locals_, ranks, into):
        width = self.offsets[-1]
        spans = list(enumerate(zip(self.offsets, self.offsets[1:])))

        def unpack_joined(got):
            return [self.joined(got[:, a:b], i, into[i]) for i, (a, b) in spans]

        if self.kind == "all_gather":
            send = torch.cat([t.reshape(-1) for t in locals_])  # a copy: the locals may change once started
            return collectives.all_gather_start(send, ranks), unpack_joined
        packed = torch.cat([self.rows(t, i) for i, t in enumerate(locals_)], dim=1)
        if self.kind == "all_reduce":
            return (collectives.all_reduce_packed_start(packed.view(-1), ranks, "sum", [width] * self.p),
                    unpack_joined)

        def unpack_scattered(got):
            out = [got[a:b].view(self.items[i][2]) for i, (a, b) in spans]
            return [o if t is None else t.copy_(o) for o, t in zip(out, into)]

        return collectives.reduce_scatter_start(packed.view(-1), ranks, "sum"), unpack_scattered


def _steps(src: Layout, dst: Layout):
    """``src -> dst`` as one-axis coalescable steps (``(from, to)`` layouts), or ``None`` where a step is not.

    More than one step where the layouts differ on several mesh axes (a
    gradient partial on the data- and tensor-parallel axes at once): the
    steps single boxing plans (``nd_plan.plan``), so each is one coalesced
    collective of its round."""
    if _kind(src, dst) is not None:
        return [(src, dst)]
    if src.placement != dst.placement or src.shape != dst.shape or src.dtype != dst.dtype:
        return None
    path, _ = nd_plan.plan(src.sbp, dst.sbp, src.placement.shape, tuple(src.shape), src.dtype.itemsize)
    steps, now = [], src
    for axis, new in path:
        to = Layout(src.placement, now.sbp[:axis] + (new,) + now.sbp[axis + 1:], src.shape, src.dtype)
        if _kind(now, to) is None:
            return None
        steps.append((now, to))
        now = to
    return steps or None  # none: the same layout, boxed by nothing


class _Plan:
    """How ``box_many_async`` boxes one list of ``(src, dst)`` layouts on this rank: the items boxed one
    by one, and per round (every coalescable item's next step) its groups, each one collective.

    ``rounds[r]``: ``(item indices, axis, kind, ranks, _EvenGroup or None, their steps' layouts)`` per
    group; ``last[i]``: item ``i``'s last round."""

    def __init__(self, layouts, me: int):
        self.single, paths = [], {}
        for i, (src, dst) in enumerate(layouts):
            steps = _steps(src, dst) if me in src.placement else None
            if steps is None:
                self.single.append(i)
            else:
                paths[i] = steps
        self.last = {i: len(steps) - 1 for i, steps in paths.items()}
        self.rounds = []
        for r in range(max(self.last.values(), default=-1) + 1):
            groups: dict = {}
            for i, steps in paths.items():
                if r < len(steps):
                    src, dst = steps[r]
                    groups.setdefault((src.placement, _kind(src, dst), src.dtype), []).append(i)
            this = []
            for (placement, (axis, kind), _), idxs in groups.items():
                coords = placement.coords(me)
                ranks = placement.axis_ranks(axis, me)
                sub = [paths[i][r] for i in idxs]
                even = _EvenGroup(sub, axis, kind, coords, len(ranks)) \
                    if _EvenGroup.fits(sub, axis, kind, coords, len(ranks)) else None
                this.append((idxs, axis, kind, ranks, even, sub))
            self.rounds.append(this)


_plans: dict = {}  # (rank, tuple of (src, dst) layouts (interned: hashed by identity)) -> _Plan
_MAX_PLANS = 4096


def _plan(layouts: tuple) -> _Plan:
    key = (world_rank(), layouts)
    plan = _plans.get(key)
    if plan is None:
        if len(_plans) >= _MAX_PLANS:  # layouts of long-gone tensors: start over
            _plans.clear()
        plan = _plans[key] = _Plan(layouts, key[0])
    return plan


def box_many_async(items, into=None) -> PendingBoxing:
    """Start boxing each ``(local, src, dst)`` to ``dst``: one asynchronous collective per coalescable
    group of each round; anything else is boxed now, one by one. The locals may change once this
    returns (the collectives read packed copies). ``into`` (optional, one per item, ``None`` allowed):
    tensors of the boxed locals' shapes and dtypes that receive the results (then returned)."""
    out = [None] * len(items)
    plan = _plan(tuple((src, dst) for _, src, dst in items))
    for i in plan.single:
        local, src, dst = items[i]
        out[i] = box(local, src, dst)
        if into is not None and into[i] is not None:
            out[i] = into[i].copy_(out[i])
    return PendingBoxing(out, plan, [local for local, _, _ in items], into)


def box_many(items, into=None) -> list:
    """Locals of each ``(local, src, dst)`` boxed to ``dst`` (written into ``into``'s tensors when
    given, see ``box_many_async``); one collective per coalescable group."""
    return box_many_async(items, into).wait()
