"""Planned collectives: boxing's steps with their geometry fixed once per (src, dst) layout pair.

Boxing plans a step when this rank's local shape is known, so split sizes,
permutations, the group and the ledger bytes are computed then, not per
call. Even pieces on a group that orders its members as the mesh axis does
(the common case) take a path with no per-call lists: each buffer holds the
``p`` pieces of the split dim stacked along dim 0 (one copy; none when the
split dim is 0), handed to the backend in that shape. Anything
else runs the general functions of ``collectives.py``, whose ledger
conventions and failure reporting these follow; so does a reduction of a
dtype the backends do not reduce as it is (``wire.reduces_as_is``).
"""
from __future__ import annotations

import functools
import math

import torch
import torch.distributed as dist

from .. import ledger
from ..layout import reduce_rows, shard_sizes
from ..process_groups import get_timeout, group_of, world_rank
from .collectives import (_REDUCE, _all_gather_flat, _failure, _group_order, _reduce_scatter_flat, all_gather,
                          all_reduce, all_to_all, reduce, reduce_scatter, sums_terms)
from .wire import moved, reduces_as_is


def _in_order(ranks) -> bool:
    return _group_order(ranks) == list(range(len(ranks)))


def _pieces_first(shape, dim: int, p: int) -> tuple:
    """``(view, order)``: ``shape`` with ``dim`` cut in ``p`` pieces, and the permutation putting the piece axis first."""
    view = tuple(shape[:dim]) + (p, shape[dim] // p) + tuple(shape[dim + 1 :])
    return view, (dim,) + tuple(i for i in range(len(view)) if i != dim)


def _pieces_back(ndim: int, dim: int) -> tuple:
    """Permutation of a ``(p, *piece)`` buffer putting the piece axis just before ``dim`` (then flattened into it)."""
    return tuple(range(1, dim + 1)) + (0,) + tuple(range(dim + 1, ndim + 1))


def _with(shape, dim: int, size: int) -> tuple:
    out = list(shape)
    out[dim] = size
    return tuple(out)


def _joined(buf: torch.Tensor, dim: int, p: int) -> torch.Tensor:
    """A received buffer of ``p`` pieces stacked along dim 0 as the pieces joined along ``dim``: the
    buffer itself for dim 0, else one copy.

    The copy is ``torch.cat`` of the pieces (contiguous blocks): 15-20% faster than the equal
    permute-and-reshape of the buffer on a 4 MB join here (200 against 240 us).
    """
    return buf if dim == 0 else torch.cat(buf.chunk(p), dim)


def plan_all_to_all(ranks, split_dim: int, cat_dim: int, local_shape, cat_length: int):
    """``all_to_all`` for this rank's ``local_shape`` input as a function ``local -> local``.

    Planned path: one send copy stacking the pieces along dim 0 (``torch.cat``
    of the local's ``p`` blocks along ``split_dim``; none for ``split_dim`` 0
    of a contiguous local), one ``all_to_all_single`` without split sizes
    whose input and output have that one stacked shape, one receive joining
    copy (none for ``cat_dim`` 0).
    """
    p = len(ranks)
    if p == 1 or local_shape[split_dim] % p or cat_length % p or not _in_order(ranks):
        return lambda local: all_to_all(local, ranks, split_dim, cat_dim, cat_length)
    group = group_of(ranks)
    piece = _with(local_shape, split_dim, local_shape[split_dim] // p)
    sent = (p - 1) * math.prod(piece)  # elements
    stacked = _with(piece, 0, p * piece[0])  # sent and received alike, in their own shape (see plan_all_gather)

    def run(local: torch.Tensor) -> torch.Tensor:
        ledger.record("all_to_all", p, sent * local.element_size(), ranks)
        if split_dim == 0:
            inp = local.contiguous()  # already the send buffer: piece k is row block k
        else:
            inp = torch.cat(local.chunk(p, split_dim))
        out = inp.new_empty(stacked)
        bound = get_timeout()
        try:
            dist.all_to_all_single(moved(out), moved(inp), group=group)
        except RuntimeError as exc:
            raise _failure("all_to_all", ranks, exc, bound) from exc
        return _joined(out, cat_dim, p)

    return run


def plan_all_gather(ranks, dim: int, local_shape, length: int):
    """``all_gather`` for this rank's ``local_shape`` input as a function ``local -> local``.

    Planned path: one ``all_gather_single`` into a buffer of the pieces
    stacked along dim 0, which is the result along dim 0 and is joined by one
    copy (``torch.cat`` of its ``p`` blocks) otherwise. The buffer and the
    local go to the backend in their own shapes: handed flat views instead,
    gloo took 55-75 us more CPU per 4 MB call here (290-320 against 230-245).
    """
    p = len(ranks)
    if p == 1 or length % p or not _in_order(ranks):
        return lambda local: all_gather(local, ranks, dim, length)
    group = group_of(ranks)
    local_shape = tuple(local_shape)
    sent = (p - 1) * math.prod(local_shape)
    stacked = _with(local_shape, 0, p * local_shape[0])

    def run(local: torch.Tensor) -> torch.Tensor:
        ledger.record("all_gather", p, sent * local.element_size(), ranks)
        buf = local.new_empty(stacked)
        bound = get_timeout()
        try:
            _all_gather_flat(moved(buf), moved(local.contiguous()), group=group)
        except RuntimeError as exc:
            raise _failure("all_gather", ranks, exc, bound) from exc
        return _joined(buf, dim, p)

    return run


def plan_reduce_scatter(ranks, dim: int, full_shape, op: str):
    """``reduce_scatter`` of a ``full_shape`` tensor as a function ``full -> piece``.

    Planned path: one send-permute copy (none along dim 0 of a contiguous
    tensor) and one ``reduce_scatter_single`` (on gloo an ``all_to_all_single``
    and the terms reduced in axis order, see ``collectives.sums_terms``).
    """
    p = len(ranks)
    if p == 1 or full_shape[dim] % p or not _in_order(ranks):
        return lambda full: reduce_scatter(full, ranks, dim, op)
    group = group_of(ranks)
    view, order = _pieces_first(full_shape, dim, p)
    piece = _with(full_shape, dim, full_shape[dim] // p)
    sent = (p - 1) * math.prod(piece)
    red = _REDUCE[op]
    by_terms = sums_terms(group)

    def run(full: torch.Tensor) -> torch.Tensor:
        if not reduces_as_is(full.dtype, op):
            return reduce_scatter(full, ranks, dim, op)
        ledger.record("reduce_scatter", p, sent * full.element_size(), ranks)
        inp = full.contiguous() if dim == 0 else full.reshape(view).permute(order).contiguous()
        out = inp.new_empty((p,) + piece if by_terms else piece)
        bound = get_timeout()
        try:
            if by_terms:  # in their own shapes, as plan_all_gather's (flat views: ~25 us more CPU on gloo)
                dist.all_to_all_single(out, inp, group=group)
            else:
                _reduce_scatter_flat(out.view(-1), inp.view(-1), op=red, group=group)
        except RuntimeError as exc:
            raise _failure("reduce_scatter", ranks, exc, bound) from exc
        return reduce_rows(out, op) if by_terms else out

    return run


def _planned_reduction(name: str, ranks, op: str, sent: int, collective, general):
    """``t -> out``: record ``sent`` elements, run ``collective`` in place on a contiguous copy of ``t``
    (``general(t)`` for a dtype the backends do not reduce with ``op`` as it is)."""
    p = len(ranks)

    def run(t: torch.Tensor) -> torch.Tensor:
        if not reduces_as_is(t.dtype, op):
            return general(t)
        ledger.record(name, p, sent * t.element_size(), ranks)
        out = t.clone(memory_format=torch.contiguous_format)
        bound = get_timeout()
        try:
            collective(out)
        except RuntimeError as exc:
            raise _failure(name, ranks, exc, bound) from exc
        return out

    return run


def plan_all_reduce(ranks, shape, op: str):
    """``all_reduce`` of a ``shape`` tensor as a function ``t -> reduced copy`` (ledger bytes and group fixed now)."""
    p = len(ranks)
    if p == 1:
        return lambda t: all_reduce(t, ranks, op)
    numel = math.prod(shape)
    sent = numel + (p - 2) * shard_sizes(numel, p)[ranks.index(world_rank())]  # elements (ring)
    return _planned_reduction("all_reduce", ranks, op, sent,
                              functools.partial(dist.all_reduce, op=_REDUCE[op], group=group_of(ranks)),
                              lambda t: all_reduce(t, ranks, op))


def plan_reduce(ranks, shape, op: str):
    """``reduce`` onto ``ranks[0]`` of a ``shape`` tensor as a function ``t -> t'`` (see ``reduce``)."""
    p = len(ranks)
    if p == 1:
        return lambda t: reduce(t, ranks, op)
    sent = 0 if ranks.index(world_rank()) == 0 else math.prod(shape)
    return _planned_reduction("reduce", ranks, op, sent,
                              functools.partial(dist.reduce, dst=ranks[0], op=_REDUCE[op], group=group_of(ranks)),
                              lambda t: reduce(t, ranks, op))
