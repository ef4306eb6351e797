"""Declaring global tensors: from each rank's shard, or from a value every rank has.

``to_global(local, placement, sbp)`` is collective over the whole world: the
ranks exchange their shards' shape, dtype and device (a few bytes), so that
every rank, inside the placement or not, knows the global shape, and every
rank raises the same error when the shards disagree.
"""
from __future__ import annotations

import itertools

import torch

from .boxing import collectives
from .global_tensor import GlobalTensor
from .layout import Layout, local_shape, take_local
from .placement import Placement
from .process_groups import world_rank, world_size
from .sbp import check_split_axes, format_sbp, nd_sbp


def _check_placement(placement) -> None:
    if not isinstance(placement, Placement):
        raise TypeError(f"placement must be sc.placement(...), got {placement!r}")


def _infer_shape(metas: dict, placement: Placement, sbp: tuple, ndim: int) -> torch.Size:
    """Global shape from the shards' shapes: a split dim sums its pieces along the split axes."""
    shape = []
    for d in range(ndim):
        axes = [i for i, s in enumerate(sbp) if s.is_split and s.axis == d]
        total = 0
        for sub in itertools.product(*(range(placement.shape[i]) for i in axes)):
            coords = [0] * placement.ndim
            for i, c in zip(axes, sub):
                coords[i] = c
            total += metas[placement.rank_at(coords)][0][d]
        shape.append(total)
    return torch.Size(shape)


def _validate(metas: dict, placement: Placement, sbp: tuple) -> tuple:
    """Check every member's shard against the others; return ``(global shape, dtype)``."""
    first = placement.ranks[0]
    shape0, dtype0, _, _ = metas[first]
    for r in placement.ranks:
        shape, dtype, dev, _ = metas[r]
        if dev != placement.device_type:
            raise ValueError(
                f"rank {r}'s shard is on device type {dev!r} but the placement is {placement.device_type!r}"
            )
        if dtype != dtype0:
            raise ValueError(
                f"shard dtypes disagree: rank {first} has {dtype0}, rank {r} has {dtype}; all shards need one dtype"
            )
        if len(shape) != len(shape0):
            raise ValueError(
                f"shard ranks disagree: rank {first} has shape {list(shape0)}, rank {r} has {list(shape)}"
            )
    check_split_axes(sbp, len(shape0))
    gshape = _infer_shape(metas, placement, sbp, len(shape0))
    for r in placement.ranks:
        want = local_shape(gshape, placement.shape, sbp, placement.coords(r))
        if tuple(metas[r][0]) != tuple(want):
            raise ValueError(
                f"rank {r}'s shard has shape {list(metas[r][0])} but sbp {format_sbp(sbp)} of a global "
                f"{list(gshape)} tensor gives it {list(want)} (torch.tensor_split sizes; other dims equal)"
            )
    return gshape, getattr(torch, dtype0.replace("torch.", ""))


def to_global(local, placement=None, sbp=None, shape=None) -> GlobalTensor:
    """A global tensor from this rank's shard ``local`` laid out as ``sbp`` on ``placement``.

    Called on every rank; ranks outside ``placement`` pass ``None``. A
    ``GlobalTensor`` argument is boxed instead (``x.to_global``). Differentiable:
    the local leaf gets its gradient in the declared layout.

    ``shape``: the global shape, when every rank already knows it. Then
    nothing is exchanged (no collective): each member checks its own shard
    against it, and ranks outside pass a tensor of the dtype (e.g. empty).
    """
    if isinstance(local, GlobalTensor):
        return local.to_global(placement, sbp)
    from .boxing.autograd import FromLocal

    _check_placement(placement)
    sbp = nd_sbp(sbp, placement.ndim)
    me = world_rank()
    member = me in placement
    if member and not isinstance(local, torch.Tensor):
        raise TypeError(f"rank {me} is in {placement} and must pass its shard as a tensor, got {local!r}")
    if shape is not None:
        return _declared(local, placement, sbp, torch.Size(shape), member)
    meta = (tuple(local.shape), str(local.dtype), local.device.type, local.requires_grad) if member else None
    gathered = collectives.all_gather_object(meta, list(range(world_size())))
    metas = {r: m for r, m in enumerate(gathered) if r in placement}
    shape, dtype = _validate(metas, placement, sbp)
    if not member:
        # Ranks outside record the same autograd graph as the members, so the
        # backward's collectives line up on every rank.
        grad = any(m[3] for m in metas.values())
        local = torch.empty(0, dtype=dtype, device=placement.device(), requires_grad=grad)
    return FromLocal.apply(local, Layout(placement, sbp, shape, dtype))


def _declared(local, placement, sbp, shape, member: bool) -> GlobalTensor:
    """``to_global`` with a known global shape: a local check instead of an exchange."""
    from .boxing.autograd import FromLocal

    if not isinstance(local, torch.Tensor):
        raise TypeError(f"to_global(shape=...) needs a tensor on every rank (its dtype), got {local!r}")
    check_split_axes(sbp, len(shape))
    if member:
        want = local_shape(shape, placement.shape, sbp, placement.coords(world_rank()))
        if tuple(local.shape) != tuple(want):
            raise ValueError(f"rank {world_rank()}'s shard has shape {list(local.shape)} but sbp {format_sbp(sbp)} "
                             f"of a global {list(shape)} tensor gives it {list(want)}")
    else:
        local = torch.empty(0, dtype=local.dtype, device=placement.device(), requires_grad=local.requires_grad)
    return FromLocal.apply(local, Layout(placement, sbp, shape, local.dtype))


def distribute(full: torch.Tensor, placement, sbp, requires_grad: bool = False) -> GlobalTensor:
    """A global *leaf* tensor whose value is ``full``, which every rank holds (no communication).

    Partial axes keep the value on the first rank and the reduction's identity
    elsewhere.
    """
    return _declare(full, placement, sbp, requires_grad, share=False)


def adopt(full: torch.Tensor, placement, sbp) -> GlobalTensor:
    """``distribute(full, placement, sbp)`` for a tensor whose owner gives it up (``distribute_module``
    replacing a parameter): where this rank's local tensor is all of ``full``, already on the placement's
    device, it is ``full``'s storage rather than a copy, so a module's parameters are never held twice."""
    return _declare(full, placement, sbp, False, share=True)


def _declare(full: torch.Tensor, placement, sbp, requires_grad: bool, share: bool) -> GlobalTensor:
    _check_placement(placement)
    sbp = nd_sbp(sbp, placement.ndim)
    check_split_axes(sbp, full.dim())
    me = world_rank()
    layout = Layout(placement, sbp, full.shape, full.dtype)
    if me in placement:
        local = take_local(full, placement.shape, sbp, placement.coords(me)).to(placement.device())
        if local.layout != torch.strided:  # no storage to compare (sparse): always a copy
            local = local.clone()
        elif local.untyped_storage().data_ptr() == full.untyped_storage().data_ptr():  # still full's memory
            whole = local.data_ptr() == full.data_ptr() and local.shape == full.shape and local.is_contiguous()
            if not (share and whole):  # the caller keeps full, or a slice would keep all of it alive
                local = local.clone()
    else:
        local = torch.empty(0, dtype=full.dtype, device=full.device)
    return GlobalTensor(local, layout, requires_grad=requires_grad)
