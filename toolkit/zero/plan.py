"""ZeRO as a rewrite of the parallel plan: where each master weight lives.

A parallel plan gives every parameter its *compute* layout, e.g.
``(B, S(1))`` on a ``(dp, tp)`` mesh for Megatron's ``c_attn.weight``.
ZeRO keeps that layout for the copy forward and backward compute with and
lays the *master* (and so its gradient shard and optimizer states) out
``S(d)`` on the data-parallel axis instead of ``B``; the other axes' splits
stay. The cast between the two (``sbp_core.cast``) all-gathers in forward
and reduce-scatters the gradient in backward.

``d`` is the first tensor dim no other mesh axis splits, preferring one with
at least ``dp`` rows (so no rank holds an empty shard): ``S(0)`` for a plain
data-parallel weight, ``S(0)`` under a tensor-parallel ``S(1)``, ``S(1)``
under a ``S(0)``. A tensor whose every dim another axis splits (a 1-d bias
split by tensor parallelism) nests the data-parallel split inside that one
(``(S(0), S(0))``): memory is still ``1/dp``, boxing takes a longer route.
A parameter that is not ``B`` on the dp axis, and a 0-d one, keep their
layout.
"""
from __future__ import annotations

import warnings

from sbp_core.sbp import Split, format_sbp

VALID_STAGES = (0, 1, 2, 3)


def check_stage(stage, dp_size: int) -> int:
    """The stage to run: ``stage`` itself, or 0 with a warning when there is no data parallelism.

    Raises ``ValueError`` naming the valid stages for anything else.
    """
    if isinstance(stage, bool) or stage not in VALID_STAGES:
        raise ValueError(f"ZeRO stage {stage!r} is not one of {VALID_STAGES} "
                         "(0: off, 1: optimizer states, 2: + gradients, 3: + parameters)")
    if stage and dp_size == 1:
        warnings.warn(f"ZeRO stage {stage} with a data-parallel size of 1 has nothing to shard; "
                      "running as stage 0", stacklevel=3)
        return 0
    return int(stage)


def shard_dim(sbp: tuple, shape, dp_axis: int, dp_size: int):
    """The tensor dim the data-parallel axis splits in the master layout, or ``None``."""
    if not shape:
        return None
    taken = {s.axis for i, s in enumerate(sbp) if i != dp_axis and s.is_split}
    free = [d for d in range(len(shape)) if d not in taken]
    for d in free:
        if shape[d] >= dp_size:
            return d
    if free:
        return max(free, key=lambda d: shape[d])
    return max(range(len(shape)), key=lambda d: shape[d])


def master_sbp(sbp: tuple, shape, dp_axis: int, dp_size: int) -> tuple:
    """The master layout for a parameter computed with ``sbp``: ``B`` on ``dp_axis`` becomes ``S(d)``."""
    if not sbp[dp_axis].is_broadcast:
        return tuple(sbp)
    d = shard_dim(sbp, shape, dp_axis, dp_size)
    if d is None:
        return tuple(sbp)
    return tuple(Split(d) if i == dp_axis else s for i, s in enumerate(sbp))


def rewrite_plan(layouts: dict, dp_axis: int, dp_size: int) -> dict:
    """``{name: (shape, compute sbp)}`` -> ``{name: master sbp}`` (exact names, no patterns)."""
    return {name: master_sbp(sbp, shape, dp_axis, dp_size) for name, (shape, sbp) in layouts.items()}


def describe(layouts: dict, masters: dict) -> str:
    """One line per parameter: name, shape, compute SBP -> master SBP."""
    return "\n".join(f"{n:50s} {tuple(shape)} {format_sbp(sbp)} -> {format_sbp(masters[n])}"
                     for n, (shape, sbp) in layouts.items())
