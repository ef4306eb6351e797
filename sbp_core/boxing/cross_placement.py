"""Boxing between two different placements (pipeline stages, resizes).

The receivers own the transfer plan: every rank of both placements derives
the same list of ``(source rank, destination rank, box)`` transfers from the
two layouts, then each sends and receives its part point-to-point.

- A partial source is first reduced *inside* its placement to a split (a
  reduce-scatter, ``(p1-1)|T|``), so each element crosses once; only
  ``P(op) -> P(op)`` ships the partial terms themselves (``p1|T|``).
- From split/broadcast sources each destination box is cut from the source
  boxes that overlap it, taking one replica of broadcast data (the
  destination's own copy when it has one; otherwise replicas in turn).
- A partial destination: ranks whose partial coordinates are all 0 receive
  the data, the others hold the reduction's identity.

Bytes (disjoint placements) therefore match docs/design.md's table.
"""
from __future__ import annotations

import math

import torch

from ..layout import filler_op, local_box, reduce_identity, reduce_terms
from ..process_groups import world_rank
from ..sbp import Broadcast, Split
from . import collectives
from .same_placement import box_same_placement


def _intersect(a, b):
    box = []
    for (s1, n1), (s2, n2) in zip(a, b):
        lo, hi = max(s1, s2), min(s1 + n1, s2 + n2)
        if hi <= lo:
            return None
        box.append((lo, hi - lo))
    return tuple(box)


def _relative(box, origin):
    return tuple(slice(s - o, s - o + n) for (s, n), (o, _) in zip(box, origin))


def _reduction_target(src: tuple, dst: tuple, shape) -> tuple:
    """Where a partial source is reduced to before crossing: a split it can send once."""
    if not shape:
        return tuple(Broadcast() for _ in src)
    want = next((s.axis for s in dst if s.is_split), None)
    if want is None:
        want = max(range(len(shape)), key=lambda d: (shape[d], -d))
    return tuple(Split(want) if s.is_partial else s for s in src)


def _all_partial(sbp, op=None) -> bool:
    return all(s.is_partial and (op is None or s.op == op) for s in sbp)


def transfers(src_pl, src: tuple, dst_pl, dst: tuple, shape) -> list:
    """``[(src_rank, dst_rank, global_box)]`` from S/B (or all-partial) sources; same on every rank."""
    out = []
    if _all_partial(src):
        # Each source term goes to one destination receiver, in turn.
        receivers = [r for r in dst_pl.ranks if filler_op(dst, dst_pl.coords(r)) is None]
        full = tuple((0, n) for n in shape)
        for k, r in enumerate(src_pl.ranks):
            out.append((r, receivers[k % len(receivers)], full))
        return out
    rep_axes = [i for i, s in enumerate(src) if s.is_broadcast]
    n_rep = math.prod(src_pl.shape[i] for i in rep_axes)

    def replica(coords):
        k = 0
        for i in rep_axes:
            k = k * src_pl.shape[i] + coords[i]
        return k

    holders = [(r, replica(src_pl.coords(r)), local_box(shape, src_pl.shape, src, src_pl.coords(r))) for r in src_pl.ranks]
    for jj, j in enumerate(dst_pl.ranks):
        coords = dst_pl.coords(j)
        if filler_op(dst, coords) is not None:
            continue
        want = local_box(shape, dst_pl.shape, dst, coords)
        rep = replica(src_pl.coords(j)) if j in src_pl else jj % n_rep
        for i, ri, have in holders:
            if ri == rep:
                inter = _intersect(have, want)
                if inter is not None:
                    out.append((i, j, inter))
    return out


def transfer_slices(src, dst) -> list:
    """The point-to-point pieces of boxing layout ``src`` to ``dst`` (``Layout``s, no partial source).

    ``[(src_rank, dst_rank, src_local_slices, dst_local_slices)]``, the same
    on every rank: ``src_rank`` sends ``its_local[src_local_slices]`` and
    ``dst_rank`` writes it to ``new_local[dst_local_slices]`` (a local piece
    when the two ranks are one). For callers that run the two sides as
    separate actors (pipeline stage boundaries); ``box_cross_placement``
    runs both sides in one call. Bytes are docs/design.md's disjoint-devices row.
    """
    if any(s.is_partial for s in src.sbp):
        raise ValueError(f"transfer_slices needs a split/broadcast source, got {src.sbp}: reduce it inside its placement first")
    if any(s.is_partial for s in dst.sbp):
        raise ValueError(f"transfer_slices needs a split/broadcast destination, got {dst.sbp}")
    if tuple(src.shape) != tuple(dst.shape):
        raise ValueError(f"shapes differ: {list(src.shape)} -> {list(dst.shape)}")
    shape = tuple(src.shape)
    out = []
    for i, j, b in transfers(src.placement, src.sbp, dst.placement, dst.sbp, shape):
        have = local_box(shape, src.placement.shape, src.sbp, src.placement.coords(i))
        want = local_box(shape, dst.placement.shape, dst.sbp, dst.placement.coords(j))
        out.append((i, j, _relative(b, have), _relative(b, want)))
    return out


def box_cross_placement(local, src_pl, src: tuple, dst_pl, dst: tuple, shape, dtype) -> torch.Tensor:
    """Box this rank's ``local`` (ignored off ``src_pl``) to ``dst`` on ``dst_pl``.

    Returns this rank's new local (an empty tensor off ``dst_pl``).
    """
    sends, recvs, finish = _sides(local, src_pl, src, dst_pl, dst, shape, dtype)
    return finish(collectives.exchange(sends, recvs))


class CrossPlacementBoxing:
    """A cross-placement boxing in flight: ``wait()`` gives this rank's new local."""

    def __init__(self, exchange, finish):
        self._exchange, self._finish = exchange, finish

    def wait(self) -> torch.Tensor:
        return self._finish(self._exchange.wait())


def box_cross_placement_start(local, src, dst) -> CrossPlacementBoxing:
    """``box_cross_placement`` from ``src`` to ``dst`` (``Layout``s) with its transfers posted, not waited.

    A partial source is still reduced inside its placement first, here.
    The two placements' ranks may start it at different times (a receiver
    early, before the data exists); boxings between one pair of ranks
    match in the order they are started, so every rank starts them in one
    order. ``local`` must not change until ``wait()`` returns.
    """
    sends, recvs, finish = _sides(local, src.placement, src.sbp, dst.placement, dst.sbp, src.shape, src.dtype)
    return CrossPlacementBoxing(collectives.exchange_start(sends, recvs), finish)


def _sides(local, src_pl, src: tuple, dst_pl, dst: tuple, shape, dtype):
    """``(sends, recvs, finish)``: this rank's part of one cross-placement boxing, for ``collectives.exchange``.

    A partial source is reduced inside its placement here, first.
    ``finish(received)`` builds the new local from what ``recvs`` received.
    """
    me = world_rank()
    device = (dst_pl if me in dst_pl else src_pl).device()
    if me not in src_pl and me not in dst_pl:
        return [], [], lambda received: torch.empty(0, dtype=dtype, device=device)
    op = src[0].op if src and src[0].is_partial else None
    if any(s.is_partial for s in src) and not (_all_partial(src, op) and _all_partial(dst, op)):
        mid = _reduction_target(src, dst, shape)
        if me in src_pl:
            local = box_same_placement(local, src_pl, src, mid, shape)
        src = mid
    plan = transfers(src_pl, src, dst_pl, dst, shape)
    my_box = local_box(shape, src_pl.shape, src, src_pl.coords(me)) if me in src_pl else None
    sends = [(j, local[_relative(b, my_box)]) for i, j, b in plan if i == me and j != me]
    incoming = [(i, b) for i, j, b in plan if j == me]
    recvs = [(i, torch.Size(n for _, n in b), dtype, device) for i, b in incoming if i != me]

    def finish(received):
        received = iter(received)
        if me not in dst_pl:
            return torch.empty(0, dtype=dtype, device=device)
        coords = dst_pl.coords(me)
        want = local_box(shape, dst_pl.shape, dst, coords)
        fill = filler_op(dst, coords)
        if _all_partial(src):
            terms = [local if i == me else next(received) for i, _ in incoming]
            if not terms:
                return torch.full(tuple(shape), reduce_identity(op, dtype), dtype=dtype, device=device)
            return reduce_terms(terms, op)
        if fill is not None:
            return torch.full(tuple(n for _, n in want), reduce_identity(fill, dtype), dtype=dtype, device=device)
        out = torch.empty(tuple(n for _, n in want), dtype=dtype, device=device)
        for i, b in incoming:
            piece = local[_relative(b, my_box)] if i == me else next(received)
            out[_relative(b, want)] = piece
        return out

    return sends, recvs, finish
