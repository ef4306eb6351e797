"""Regression guard for the per-op hot path, by counting instead of timing.

On a decision-cache hit an op on global tensors must cost a fixed, small
number of Python function calls and decide nothing again. The bounds below
are the counts measured when the hot path was tuned (``sys.setprofile``
``call`` events: Python frames entered, C functions excluded); a change that
adds a frame to the hot path, or re-validates a layout on a hit, makes the
count grow and this test fail. Nothing here is timed.
"""
from __future__ import annotations

import sys

import torch

import sbp_core as sc
from sbp_core import sbp
from sbp_core.boxing import _compiled
from sbp_core.dispatch import _cache
from toolkit.rank_pool import get_pool

aten = torch.ops.aten

WORLD = 5  # the shared pool of tests/sbp_core

# Python frames entered by one call on a cache hit, measured (torch 2.13, Python 3.11).
# An op on a GlobalTensor is 4: torch's own lookup of subclass rules
# (simple_registry.find_torch_dispatch_rule and two ``find``, which we cannot
# avoid) and our ``dispatch``. torch.autograd.Function.apply costs its own
# frames (6 with one argument, 7 with two: apply, _is_setup_context_defined,
# unwrap_dead_wrappers and its generator expressions, set_materialize_grads).
BOUNDS = {
    "add S(0)+S(0)": 4,
    "matmul B@S(1)": 4,  # aten.mm with the tp column-parallel signature B, S(1) -> S(1)
    "relu B": 4,
    "to_global B->S(0)": 1,  # to_global alone: box and wrap are inline, the planned narrow a C-level methodcaller
    "to_global B->S(0) grad": 11,  # to_global, apply (7), Boxing.forward, box, GlobalTensor.__new__
    "to_local grad": 8,  # to_local, apply (6), ToLocal.forward
}


def test_torch_dispatch_is_a_staticmethod():
    # torch calls __torch_dispatch__ per op; a classmethod would make a bound method object each time.
    assert isinstance(sc.GlobalTensor.__dict__["__torch_dispatch__"], staticmethod)


def _count_calls(fn) -> int:
    """Python frames entered while running ``fn()`` (the fewest over three runs: a gc
    finaliser firing inside a run is not the hot path's doing)."""
    counts = []
    for _ in range(3):
        n = 0

        def prof(frame, event, arg):
            nonlocal n
            if event == "call":
                n += 1

        sys.setprofile(prof)
        try:
            fn()
        finally:
            sys.setprofile(None)
        counts.append(n - 1)  # the lambda itself
    return min(counts)


def _hot_path_counts():
    # This pool rank's cache holds earlier tests' decisions too (an add that boxes is not plain):
    # start empty, so the fast-path check below sees this test's decisions only.
    _cache.clear()
    p = sc.placement("cpu", [0, 1])
    torch.manual_seed(0)
    x = sc.distribute(torch.randn(8, 4), p, sbp.split(0))
    y = sc.distribute(torch.randn(8, 4), p, sbp.split(0))
    a = sc.distribute(torch.randn(8, 4), p, sbp.broadcast)
    w = sc.distribute(torch.randn(4, 6), p, sbp.split(1))
    ag = sc.distribute(torch.randn(8, 4), p, sbp.broadcast).requires_grad_(True)
    s0 = sbp.split(0)
    cases = {
        "add S(0)+S(0)": lambda: x + y,
        "matmul B@S(1)": lambda: a @ w,
        "relu B": lambda: torch.relu(a),
        "to_global B->S(0)": lambda: a.to_global(sbp=s0),
    }
    out, misses = {}, {}
    with torch.no_grad():
        for name, fn in cases.items():
            fn(), fn()  # the first call decides and plans; the second is already a hit
            before = (len(_cache), len(_compiled))
            out[name] = _count_calls(fn)
            misses[name] = (len(_cache), len(_compiled)) != before
    fn = lambda: ag.to_global(sbp=s0)  # noqa: E731
    fn(), fn()
    out["to_global B->S(0) grad"] = _count_calls(fn)
    out["to_local grad"] = _count_calls(lambda: ag.to_local())
    sig = (a @ w).sbp
    # The three ops are plain (no boxing, no custom local) with one output: each decision must
    # take the hot path's single ``fast`` test, wrapping with dense strides passed as None.
    slow = [str(d.func) for d in _cache.values()
            if d.func in (aten.add.Tensor, aten.mm.default, aten.relu.default) and d.fast is None]
    dense = [d.fast[1] for d in _cache.values() if d.func is aten.add.Tensor and d.fast is not None]
    # The fast path takes the output's device from the decision: the wrapper's must be its local's.
    z = x + y
    devices = (z.device, z.to_local().device, [d.fast[4] for d in _cache.values() if d.fast is not None])
    return out, misses, sig, slow, dense, devices


def test_hot_path_call_counts_do_not_grow():
    res = get_pool(WORLD).run(_hot_path_counts)
    for rank in (0, 1):
        counts, misses, sig, slow, dense, (wrapper, local, cached) = res[rank]
        assert sig == (sbp.split(1),), sig  # the tp signature B, S(1) -> S(1), no boxing
        assert wrapper == local == torch.device("cpu") and cached and set(cached) == {local}, (wrapper, local, cached)
        assert not slow, f"plain one-output decisions off the fast path: {slow}"
        assert dense and all(s is None for s in dense), dense
        assert not any(misses.values()), misses
        grown = {k: (v, BOUNDS[k]) for k, v in counts.items() if v > BOUNDS[k]}
        assert not grown, f"Python calls per op on a cache hit (counted, bound): {grown}"
