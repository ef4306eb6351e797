"""SBP signatures: how a global tensor is laid out along one mesh axis.

- ``Split(axis)``: local tensors are ``torch.tensor_split(global, p, axis)``
  (balanced; the first ``n % p`` ranks hold one more row).
- ``Broadcast``: every local tensor equals the global tensor.
- ``Partial(op)``: local tensors have the global shape; the global tensor is
  their element-wise reduction with ``op`` in ``sum``, ``max``, ``min``.

An N-d SBP is a tuple with one entry per mesh axis. ``nd_sbp`` normalises
whatever a user passes (one SBP or a sequence) to that tuple.
"""
from __future__ import annotations

from typing import Iterable, Union

REDUCE_OPS = ("sum", "max", "min")


class SBP:
    """Base of the three SBP kinds; instances are immutable and interned.

    ``Split(0) is Split(0)``: one object per value, so equality and hashing
    are identity (C-level). Layouts and the dispatcher's cache keys hash
    tuples of SBPs on every op, where a Python ``__hash__`` per entry showed
    in profiles.
    """

    __slots__ = ()

    is_split = False
    is_broadcast = False
    is_partial = False

    def __setattr__(self, *_):
        raise AttributeError("SBP values are immutable")

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self


class Split(SBP):
    __slots__ = ("axis",)
    is_split = True
    _interned: dict = {}

    def __new__(cls, axis: int):
        got = cls._interned.get(axis) if type(axis) is int else None
        if got is not None:
            return got
        if not isinstance(axis, int) or isinstance(axis, bool):
            raise TypeError(f"split axis must be an int, got {axis!r}")
        if axis < 0:
            raise ValueError(
                f"split axis must be non-negative (normalise against the tensor's ndim first), got {axis}"
            )
        obj = object.__new__(cls)
        object.__setattr__(obj, "axis", axis)
        return cls._interned.setdefault(axis, obj)  # setdefault: one object even if two threads race

    def __reduce__(self):
        return (Split, (self.axis,))

    def __repr__(self):
        return f"S({self.axis})"


class Broadcast(SBP):
    __slots__ = ()
    is_broadcast = True
    _the = None

    def __new__(cls):
        if cls._the is None:
            type.__setattr__(cls, "_the", object.__new__(cls))
        return cls._the

    def __reduce__(self):
        return (Broadcast, ())

    def __repr__(self):
        return "B"


class Partial(SBP):
    __slots__ = ("op",)
    is_partial = True
    _interned: dict = {}

    def __new__(cls, op: str = "sum"):
        got = cls._interned.get(op)
        if got is not None:
            return got
        if op not in REDUCE_OPS:
            raise ValueError(f"partial reduction {op!r} is not one of {REDUCE_OPS}")
        obj = object.__new__(cls)
        object.__setattr__(obj, "op", op)
        return cls._interned.setdefault(op, obj)

    def __reduce__(self):
        return (Partial, (self.op,))

    def __repr__(self):
        return f"P({self.op})"


def split(axis: int) -> Split:
    return Split(axis)


broadcast = Broadcast()
partial_sum = Partial("sum")
partial_max = Partial("max")
partial_min = Partial("min")

NdSbp = tuple  # tuple[SBP, ...], one per mesh axis
SbpLike = Union[SBP, Iterable[SBP]]


def nd_sbp(value: SbpLike, mesh_ndim: int) -> tuple:
    """Normalise ``value`` to an N-d SBP tuple for a mesh of ``mesh_ndim`` axes.

    A single SBP is accepted for a 1-d mesh only, so a 2-d layout is never
    guessed.
    """
    if isinstance(value, SBP):
        value = (value,)
    try:
        value = tuple(value)
    except TypeError:
        raise TypeError(f"sbp must be an SBP or a sequence of SBPs, got {value!r}") from None
    for v in value:
        if not isinstance(v, SBP):
            raise TypeError(
                f"sbp entries must be sbp.split(i), sbp.broadcast or sbp.partial_*, got {v!r}"
            )
    if len(value) != mesh_ndim:
        raise ValueError(
            f"sbp {format_sbp(value)} has {len(value)} entries but the placement's mesh has "
            f"{mesh_ndim} axes: give one SBP per mesh axis"
        )
    return value


def check_split_axes(sbp: tuple, ndim: int) -> None:
    """Raise if a split axis does not exist on a tensor of ``ndim`` dims."""
    for s in sbp:
        if s.is_split and s.axis >= ndim:
            raise ValueError(
                f"split axis {s.axis} in sbp {format_sbp(sbp)} is out of range for a "
                f"{ndim}-d tensor: valid axes are 0..{ndim - 1}"
                if ndim
                else f"split axis {s.axis} in sbp {format_sbp(sbp)}: a 0-d tensor cannot be split"
            )


def format_sbp(sbp) -> str:
    if isinstance(sbp, SBP):
        return repr(sbp)
    return "(" + ", ".join(repr(s) for s in sbp) + ")"
