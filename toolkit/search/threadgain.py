"""How much faster one local call runs with a process's intra-op threads than with one, measured per call.

A process that has cores to spare (fewer processes than cores) runs its
kernels on ``threads`` intra-op threads. What that buys depends on the call:
torch splits an elementwise or reduction kernel over threads only from
``GRAIN`` elements on (``at::internal::GRAIN_SIZE``), a small matmul gains
little, a memory-bound one is capped by the shared memory bandwidth, a
compute-bound one nearly doubles. One number for the machine cannot say
that (a probe model with different shapes gained 1.1x where a gpt2-tiny
step gains 1.6x), so ``MeasuredThreadGain`` measures each distinct call the
simulator prices, like ``opcost.MeasuredOpCosts`` measures its seconds:

    gain = (least wall time with 1 thread) / (least wall time with ``threads``)

over interleaved repeats of the same call on fresh tensors, clamped to
``[1, threads]`` (more threads never make torch slower on purpose, and
cannot more than divide the work). Wall time, because the helper threads'
work is not the calling thread's CPU time; the least of the repeats, because
that is the call when its threads had their cores (the simulator shares the
cores out itself, ``Cluster.thread_rate``). Calls below ``GRAIN`` elements
run on one thread in torch and get 1 without being measured. Under heavy
load the second thread seldom gets a core and the gain comes out low, so
the cache file (one per thread count) keeps with each gain the load average
it was measured at, and a gain measured at a load more than one above
today's is measured again (and replaced): the cache converges to the
quietest measurement instead of keeping the first.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

from .opcost import _writes, call_args, save_table
from .rehearsal import OpCall, TensorSpec

GRAIN = 32768  # elements below which torch's CPU kernels run on one thread (at::internal::GRAIN_SIZE)


def largest_elements(spec) -> int:
    """Elements of the largest tensor among a call's argument specs."""
    if isinstance(spec, TensorSpec):
        n = 1
        for s in spec.shape:
            n *= s
        return n
    if isinstance(spec, tuple):
        return max((largest_elements(s) for s in spec), default=0)
    return 0


def threadable(call: OpCall) -> bool:
    """Whether torch may split ``call`` over intra-op threads (its largest tensor has ``GRAIN`` elements or more)."""
    return largest_elements(call.args) >= GRAIN


class MeasuredThreadGain:
    """Per-call speedup from ``threads`` intra-op threads over one, measured on this machine, cached in ``path``."""

    def __init__(self, path: str | os.PathLike, threads: int = 2, repeats: int = 5, budget_s: float = 0.1):
        if threads < 2:
            raise ValueError(f"threads={threads}: a thread gain compares 2 or more threads with 1")
        self.path, self.threads = Path(path), threads
        self.repeats, self.budget_s = repeats, budget_s
        self._table: dict = json.loads(self.path.read_text()) if self.path.exists() else {}  # key -> [gain, load]
        self._hot: dict = {}
        self._dirty = False

    def gain(self, call: OpCall) -> float:
        got = self._hot.get(call.key)
        if got is None:
            if not threadable(call):
                got = 1.0
            else:
                key = repr(call.key)
                entry = self._table.get(key)
                stored, load = entry if isinstance(entry, list) else (entry, float("inf"))  # a bare gain: load unknown
                if stored is None or load > os.getloadavg()[0] + 1.0:
                    stored = self.measure(call)
                    self._table[key] = [stored, round(os.getloadavg()[0], 2)]
                    self._dirty = True
                got = stored
            self._hot[call.key] = got
        return got

    def measure(self, call: OpCall) -> float:
        before = torch.get_num_threads()
        best = {1: float("inf"), self.threads: float("inf")}
        try:
            func, args, kwargs = call_args(call, "cpu")
            spent, n = 0.0, 0
            while n < self.repeats or (spent < self.budget_s and n < 30):
                for threads in best:  # interleaved, so drifting load hits both alike
                    torch.set_num_threads(threads)
                    a, kw = call_args(call, "cpu")[1:] if _writes(func) else (args, kwargs)
                    if n == 0:
                        func(*a, **kw)  # warm up this thread count (thread pool, allocator)
                    t0 = time.perf_counter()
                    func(*a, **kw)
                    dt = time.perf_counter() - t0
                    best[threads] = min(best[threads], dt)
                    spent += dt
                n += 1
        finally:
            torch.set_num_threads(before)
        return round(min(float(self.threads), max(1.0, best[1] / best[self.threads])), 4)

    def save(self) -> None:
        """Write new measurements to the cache file (atomically)."""
        if self._dirty:
            save_table(self.path, self._table)
            self._dirty = False
