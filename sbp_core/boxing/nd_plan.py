"""Planning N-d boxing on one placement as a sequence of 1-d steps.

A step changes the SBP of one mesh axis ``i`` with a 1-d boxing among the
ranks along that axis. Because N-d SBP is nested, a step is only exact when
the later axes do not get in its way:

- no later axis splits a tensor dim that the step splits or gathers;
- reducing a ``P(op)`` needs every later partial axis to use the same ``op``
  (sum and max do not commute), and creating a ``P(op)`` likewise;
- ``P(op1) -> P(op2)`` reduces onto the first rank, whose value the others'
  identity terms leave unchanged under ``op2``.

Among all valid step sequences the planner returns the one with the fewest
bytes (Dijkstra over N-d states; meshes are small, so the graph is too).
"""
from __future__ import annotations

import functools
import heapq
import math

from ..sbp import Broadcast, Split
from . import cost


def step_is_valid(state: tuple, axis: int, new) -> bool:
    old = state[axis]
    if old == new:
        return False
    dims = {s.axis for s in (old, new) if s.is_split}
    later = state[axis + 1 :]
    if any(s.is_split and s.axis in dims for s in later):
        return False
    op = old.op if old.is_partial else new.op if new.is_partial else None
    if op is not None and any(s.is_partial and s.op != op for s in later):
        return False
    return True


def step_cost(state: tuple, axis: int, new, mesh_shape, nbytes: float) -> float:
    groups = math.prod(n for i, n in enumerate(mesh_shape) if i != axis)
    seen = nbytes / math.prod(n for i, (n, s) in enumerate(zip(mesh_shape, state)) if i != axis and s.is_split)
    return groups * cost.same_placement(state[axis], new, mesh_shape[axis], seen)


@functools.lru_cache(maxsize=4096)
def plan(src: tuple, dst: tuple, mesh_shape: tuple, shape: tuple, itemsize: int) -> tuple:
    """Cheapest sequence of ``(axis, new_sbp)`` steps from ``src`` to ``dst``, and its bytes.

    Returns ``(steps, total_bytes)``; identical on every rank (deterministic).
    """
    nbytes = float(math.prod(shape) * itemsize)
    dims = sorted({s.axis for s in src + dst if s.is_split})
    choices = []
    for i in range(len(mesh_shape)):
        opts = [src[i], dst[i], Broadcast()] + [Split(d) for d in dims]
        uniq = []
        for o in opts:
            if o not in uniq:
                uniq.append(o)
        choices.append(uniq)
    best = {src: 0.0}
    prev = {}
    heap = [(0.0, 0, src)]
    tick = 0
    while heap:
        c, _, state = heapq.heappop(heap)
        if state == dst:
            break
        if c > best.get(state, math.inf):
            continue
        for axis in range(len(mesh_shape)):
            for new in choices[axis]:
                if not step_is_valid(state, axis, new):
                    continue
                nxt = state[:axis] + (new,) + state[axis + 1 :]
                nc = c + step_cost(state, axis, new, mesh_shape, nbytes)
                if nc < best.get(nxt, math.inf) - 1e-9:
                    best[nxt] = nc
                    prev[nxt] = (state, axis, new)
                    tick += 1
                    heapq.heappush(heap, (nc, tick, nxt))
    if dst not in best:
        raise ValueError(f"no valid boxing sequence from {src} to {dst} on mesh {mesh_shape}")
    steps = []
    state = dst
    while state != src:
        state, axis, new = prev[state]
        steps.append((axis, new))
    return tuple(reversed(steps)), best[dst]
