"""Boxing cost: total bytes moved over all devices (docs/design.md's table).

``|T|`` is the global tensor's bytes. Same-placement costs count what a ring
or direct algorithm sends; disjoint costs count every byte that leaves its
source placement, plus the reduction inside the source where there is one.
"""
from __future__ import annotations


def same_placement(a, b, p: int, nbytes: float) -> float:
    """Bytes to box ``a -> b`` (1-d SBPs) among the same ``p`` devices."""
    if a == b or p == 1:
        return 0.0
    if a.is_split:
        if b.is_split:
            return (p - 1) / p * nbytes  # all-to-all
        if b.is_broadcast:
            return (p - 1) * nbytes  # all-gather
        return 0.0  # S -> P: pad with the reduction's identity
    if a.is_broadcast:
        return 0.0  # B -> S slices, B -> P keeps the first rank's copy
    if b.is_split:
        return (p - 1) * nbytes  # reduce-scatter
    if b.is_partial:
        return (p - 1) * nbytes  # P(op1) -> P(op2): reduce onto the first rank
    return 2 * (p - 1) * nbytes  # all-reduce


def disjoint(a, b, p1: int, p2: int, nbytes: float) -> float:
    """Bytes to box ``a`` on ``p1`` devices to ``b`` on ``p2`` other devices."""
    if a.is_partial:
        if b.is_broadcast:
            return (p1 + p2 - 1) * nbytes  # reduce-scatter at the source, then S -> B
        return p1 * nbytes  # P -> S, P -> P: every source term crosses once
    if b.is_broadcast:
        return p2 * nbytes
    return nbytes
