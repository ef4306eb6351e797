"""Shard geometry: which part of the global tensor a rank holds.

N-d SBP is nested: mesh axis 0 lays the global tensor out over its ranks,
axis 1 lays each of those locals out over its ranks, and so on. Splits follow
``torch.tensor_split``. A rank's local tensor for S/B axes is a rectangular
*box* of the global tensor: ``(start, length)`` per tensor dim.
"""
from __future__ import annotations

import threading
import weakref

import torch

from .sbp import Broadcast


def strides_in_order(shape, order) -> tuple:
    """Dense strides for ``shape`` with dims laid out outermost-first as in ``order``."""
    strides, step = [0] * len(shape), 1
    for d in reversed(order):
        strides[d] = step
        step *= max(shape[d], 1)
    return tuple(strides)


def shard_bounds(size: int, parts: int, index: int) -> tuple:
    """``(start, length)`` of piece ``index`` of ``torch.tensor_split(range(size), parts)``."""
    q, r = divmod(size, parts)
    return index * q + min(index, r), q + (1 if index < r else 0)


def shard_sizes(size: int, parts: int) -> list:
    return [shard_bounds(size, parts, i)[1] for i in range(parts)]


def local_box(shape, mesh_shape, sbp, coords) -> tuple:
    """The box ``((start, length), ...)`` of the global tensor held at ``coords``.

    Partial axes do not restrict the box (each rank holds a full-shape term).
    """
    box = [(0, n) for n in shape]
    for p, s, c in zip(mesh_shape, sbp, coords):
        if s.is_split:
            start, length = box[s.axis]
            off, ln = shard_bounds(length, p, c)
            box[s.axis] = (start + off, ln)
    return tuple(box)


def local_shape(shape, mesh_shape, sbp, coords) -> torch.Size:
    return torch.Size(ln for _, ln in local_box(shape, mesh_shape, sbp, coords))


def view_shape(shape, mesh_shape, sbp, coords, axis) -> torch.Size:
    """Shape the group along mesh ``axis`` sees: this rank's local with ``axis`` undone."""
    undone = tuple(Broadcast() if i == axis else s for i, s in enumerate(sbp))
    return local_shape(shape, mesh_shape, undone, coords)


def box_slices(box) -> tuple:
    return tuple(slice(s, s + n) for s, n in box)


def reduce_identity(op: str, dtype: torch.dtype):
    """The identity element of ``op`` (what a rank holding no part contributes)."""
    if op == "sum":
        return 0
    if dtype == torch.bool:
        return op == "min"
    if dtype.is_floating_point or dtype.is_complex:
        return float("-inf") if op == "max" else float("inf")
    info = torch.iinfo(dtype)
    return info.min if op == "max" else info.max


def filler_op(sbp, coords) -> "str | None":
    """Which reduction's identity this rank holds when a full value is laid out as ``sbp``.

    The rank whose partial coordinates are all 0 keeps the value (``None``);
    elsewhere the first partial axis with a non-zero coordinate decides: its
    term must be that reduction's identity, and identity terms stay identity
    under any inner reduction.
    """
    for s, c in zip(sbp, coords):
        if s.is_partial and c != 0:
            return s.op
    return None


def take_local(full: torch.Tensor, mesh_shape, sbp, coords) -> torch.Tensor:
    """This rank's local tensor of ``full`` laid out as ``sbp`` (no communication).

    Partial axes: the first rank keeps the value, the others hold the
    reduction's identity (zeros for sum), so the reduction is exact.
    """
    local = full[box_slices(local_box(full.shape, mesh_shape, sbp, coords))]
    op = filler_op(sbp, coords)
    if op is not None:
        return torch.full_like(local, reduce_identity(op, full.dtype))
    return local


def reduce_rows(rows: torch.Tensor, op: str) -> torch.Tensor:
    """Reduce a ``(p, ...)`` tensor of partial terms over dim 0 with ``op``, in row order; keeps the dtype
    (torch sums integers and bools as int64)."""
    if op == "sum":
        out = rows.sum(0)
        return out if out.dtype == rows.dtype else out.to(rows.dtype)
    return rows.amax(0) if op == "max" else rows.amin(0)


def reduce_terms(terms, op: str) -> torch.Tensor:
    """Element-wise reduction of same-shape partial terms held on this rank."""
    if len(terms) == 1:
        return terms[0]
    return reduce_rows(torch.stack(list(terms)), op)


_intern_lock = threading.Lock()


class Layout:
    """Everything that describes a global tensor except its values: placement, N-d SBP, shape, dtype.

    Interned: ``Layout(...)`` returns the one live object for its value, so
    equality and hashing are identity (C-level, no Python ``__hash__``) and
    the dispatcher's cache key of an op is a tuple of layouts. Immutable;
    pickles by value and re-interns on load.
    """

    __slots__ = ("placement", "sbp", "shape", "dtype", "strides", "__weakref__")
    _interned: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()

    def __new__(cls, placement, sbp, shape, dtype):
        sbp, shape = tuple(sbp), torch.Size(shape)
        key = (placement, sbp, shape, dtype)
        lay = cls._interned.get(key)
        if lay is None:
            with _intern_lock:  # the runtime's threads make layouts too: one object per value
                lay = cls._interned.get(key)
                if lay is None:
                    lay = object.__new__(cls)
                    for name, value in zip(cls.__slots__, key):
                        object.__setattr__(lay, name, value)
                    # Dense row-major strides of the global shape: what a contiguous shard's wrapper reports.
                    object.__setattr__(lay, "strides", strides_in_order(shape, range(len(shape))))
                    cls._interned[key] = lay
        return lay

    def __setattr__(self, name, value):
        raise AttributeError("a Layout is immutable: make another with with_sbp() or Layout(...)")

    def __reduce__(self):
        return (Layout, (self.placement, self.sbp, self.shape, self.dtype))

    def __repr__(self):
        return f"Layout({self.placement}, sbp={self.sbp}, shape={tuple(self.shape)}, dtype={self.dtype})"

    def with_sbp(self, sbp) -> "Layout":
        return Layout(self.placement, sbp, self.shape, self.dtype)

    def local_shape(self, rank: int) -> torch.Size:
        if rank not in self.placement:
            return torch.Size([0])
        return local_shape(self.shape, self.placement.shape, self.sbp, self.placement.coords(rank))
