"""What a shape rule needs beyond ``call.p``: the mesh axis it decides, and local sizes.

The dispatcher asks a rule once per mesh axis (``call.axis`` of
``call.mesh_shape``, with the inputs' actual N-d SBP in ``call.sbps``).
Shape rules use more of that than element-wise ones:

- the inputs' actual SBP on this axis, so that ``P -> P`` pass-through
  signatures are offered only for inputs that really are partial there. The
  boxing table makes ``S -> P`` and ``B -> P`` free, so an always-offered
  ``P -> P`` would beat an all-to-all and leave the output partial,
  deferring a larger reduction;
- the sizes of the *earlier* axes: N-d SBP is nested, so a split on axis
  ``k`` cuts the pieces the earlier axes left, and whether a reshape keeps a
  split exact depends on those pieces' sizes (``nested_aligned``).

``sized_local`` runs an op whose argument 1 is a *global* size (``view``,
``expand``, ``slice_backward`` ...) with this rank's local output size instead.
"""
from __future__ import annotations

from typing import NamedTuple

from ..layout import shard_sizes


class AxisInfo(NamedTuple):
    index: int  # which mesh axis is being decided
    earlier: tuple  # sizes of the mesh axes before it
    sbps: tuple  # the inputs' actual 1-d SBP on this axis (None when unknown)

    def partial_ops(self, *inputs) -> list:
        """Reduction ops of the given inputs that are partial on this axis (all ops when unknown)."""
        if self.sbps is None:
            return ["sum", "max", "min"]
        ops = []
        for j in inputs:
            s = self.sbps[j] if j < len(self.sbps) else None
            if s is not None and s.is_partial and s.op not in ops:
                ops.append(s.op)
        return ops


def axis_of(call) -> AxisInfo:
    axis = call.axis
    sbps = tuple(a[axis] for a in call.sbps) if call.sbps else None
    return AxisInfo(axis, tuple(call.mesh_shape[:axis]), sbps)


def aligned(a: int, a_unit: int, b: int, b_unit: int, p: int) -> bool:
    """Do ``tensor_split`` pieces of ``a`` rows of ``a_unit`` elements equal those of ``b`` rows of ``b_unit``?"""
    return [n * a_unit for n in shard_sizes(a, p)] == [n * b_unit for n in shard_sizes(b, p)]


def nested_aligned(a: int, a_unit: int, b: int, b_unit: int, p: int, earlier: tuple) -> bool:
    """``aligned`` for every piece the earlier mesh axes may have cut ``a``/``b`` into.

    Each earlier axis either leaves the dim whole or (when that is itself
    exact) splits it; this axis must be exact on every resulting piece.
    """
    pairs = {(a, b)}
    for q in earlier:
        cut = set(pairs)
        for sa, sb in pairs:
            if aligned(sa, a_unit, sb, b_unit, q):
                cut |= set(zip(shard_sizes(sa, q), shard_sizes(sb, q)))
        pairs = cut
    return all(aligned(sa, a_unit, sb, b_unit, p) for sa, sb in pairs)


def local_out_shape(ctx, k: int = 0):
    """This rank's local shape of tensor output ``k`` (a fresh list; computed once per decision)."""
    return list(ctx.local_out_shapes[k])


def sized_local(func, args, kwargs, ctx):
    """Run ``func`` with its size argument (index 1) replaced by this rank's output size."""
    args = list(args)
    args[1] = local_out_shape(ctx)
    return func(*args, **kwargs)
