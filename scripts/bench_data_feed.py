"""What a step pays for its data: a plain loop's step fed preloaded, loaded in the step, by our read-ahead threads
and by ``DataLoader``'s worker processes.

    python scripts/bench_data_feed.py [--cases wide_deep_512,insightface,gpt2] [--workers 1]
                                      [--steps 20] [--rounds 8]

On a GPU, a step whose time is host work (Wide&Deep at batch 512, where a
plain loop's H100 step took about 6 ms of host time) pays for whatever
Python work runs beside it. ``scripts/bench_gpu.py`` compares our trainer
with a plain loop whose batches wait on the device before any timing,
while ours reads its batches ahead on worker threads
(``toolkit.data.ReadAhead``). A worker loads on another core, but each of
its numpy and torch calls may take the GIL while the step is in a torch
op, and the step then sleeps until the worker lets it go: the worker's
load costs the step wake-ups, not cores. ``bench_read_ahead.py`` times the
loads alone; this script times the step they feed.

Cases: ``bench_gpu.py``'s ``--host-only`` shapes (kernels cheap on a CPU,
so the step is host work, as on a GPU where it is host-bound). One
process; the step is ``toolkit.plain_loop.PlainLoop``'s (one device, the
CPU), its micro-batches from:

- ``preloaded``: loaded before any timing (the plain loop of ``bench_gpu``
  on a GPU);
- ``in step``: ``MicroBatches.load`` on the step's thread;
- ``ahead N``: ``ReadAhead`` with ``N`` threads and ``2N`` pieces ahead, as
  the trainer reads on a GPU (nothing is pinned or copied on a CPU);
- ``DataLoader N``: ``torch.utils.data.DataLoader`` over the same pieces
  (``batch_size=None``), ``N`` persistent worker processes,
  ``prefetch_factor=2``: the peer, whose workers have GILs of their own but
  hand their batches over through shared memory.

Every way's first batch is checked equal to ``load``'s. Each round runs
every way in a carryover-balanced order (``benchkit.paired``): two untimed
steps (a loader refilling from the round's first piece), then ``--steps``
timed steps, each way over its own pieces, from a synchronised start to
the loss read and, for ``ahead N``, the end of the loads its last steps
started past the round (``ReadAhead.settle``; a ``DataLoader`` round's
sampler ends with its pieces), so nothing of one way runs in another's
time. Times are wall clock: a step waiting for the GIL sleeps, so its
process CPU time would not show the wait. torch runs on one thread.
Printed per case: each way's median milliseconds a step, the data's cost
(the way's step less ``preloaded``'s), and each way's throughput against
``preloaded`` as a paired ratio with its 90% bootstrap interval (1.00: the
data costs the step nothing).

Last line: ``data feed: <case> ahead A.AAx, DataLoader B.BBx, in step
C.CCx; ...`` (of preloaded's throughput, the first ``--workers`` count).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

from benchkit.one_device_cases import COMMON, HOST
from benchkit.paired import balanced_orders, paired_ratio
from benchkit.pieces import Pieces, Window, same_batch
from toolkit.plain_loop import PlainLoop

WARM = 2  # untimed steps a round starts each way with


class Fed(PlainLoop):
    """The plain loop with its micro-batches from ``feed(piece)`` (piece ``step * accum + k``)."""

    feed = None

    def micro_batch(self, step: int, k: int) -> dict:
        return self.feed(step * self.layout.accumulation + k)


class Preloaded:
    def __init__(self, batches, n: int):
        self.pieces = Pieces(batches)
        self.held = [self.pieces[q] for q in range(n)]

    def start(self, q: int, n: int):
        return lambda p: self.held[p % len(self.held)]


class InStep:
    def __init__(self, batches):
        self.pieces = Pieces(batches)

    def start(self, q: int, n: int):
        return self.pieces.__getitem__


class Ahead:
    def __init__(self, batches, workers: int):
        from toolkit.data import ReadAhead

        self.ahead = ReadAhead(batches, 2 * workers, workers)

    def start(self, q: int, n: int):
        return self.ahead.get  # a jump outside its window starts loading from q

    def settle(self):
        self.ahead.settle()  # the round's last gets started loads past it: they end in its time

    def close(self):
        self.ahead.close()


class Loader:
    def __init__(self, batches, workers: int):
        self.window = Window(0)
        self.loader = torch.utils.data.DataLoader(Pieces(batches), batch_size=None, sampler=self.window,
                                                  num_workers=workers, persistent_workers=True, prefetch_factor=2)
        self.start(1 << 30, 1)(1 << 30)  # the workers start here, before any timing

    def start(self, q: int, n: int):
        self.window.start, self.window.n = q, n
        it = iter(self.loader)
        expected = iter(range(q, q + n))

        def feed(p):
            if p != next(expected):
                raise AssertionError(f"DataLoader feed asked for piece {p} out of its order")
            return next(it)

        return feed

    def close(self):
        del self.loader  # its workers exit


def bench_case(name: str, o) -> dict:
    """``{way: [seconds per step, per round]}`` of one case."""
    from recipes.registry import get
    from toolkit.config import compose

    with tempfile.TemporaryDirectory(prefix="bench-data-feed-") as root:
        cfg = compose([*HOST[name], *COMMON, "trainer.max_steps=1000000", "device=cpu"], run_dir=root)
        loop = Fed(cfg, get(cfg.recipe.name), "cpu")
        accum = loop.layout.accumulation
        per_round = (WARM + o.steps) * accum
        ways = {"preloaded": Preloaded(loop.batches, per_round), "in step": InStep(loop.batches)}
        for w in o.workers:
            ways[f"ahead {w}"] = Ahead(loop.batches, w)
            ways[f"DataLoader {w}"] = Loader(loop.batches, w)
        want = loop.batches.load(0, 0)
        for way_name, way in ways.items():
            if not same_batch(way.start(0, 1)(0), want):
                raise AssertionError(f"{name}: {way_name}'s first batch is not load's")
        loop.feed = ways["in step"].start(0, 0)
        for i in range(3):  # the model's own warm-up
            float(loop.step(i))
        times = {w: [] for w in ways}
        orders = balanced_orders(list(ways))
        step = 1000
        try:
            for r in range(o.rounds):
                for w in orders[r % len(orders)]:
                    loop.feed = ways[w].start(step * accum, per_round)
                    for i in range(step, step + WARM):
                        value = loop.step(i)
                    float(value)
                    t = time.perf_counter()
                    for i in range(step + WARM, step + WARM + o.steps):
                        value = loop.step(i)
                    float(value)
                    if hasattr(ways[w], "settle"):
                        ways[w].settle()
                    times[w].append((time.perf_counter() - t) / o.steps)
                    step += WARM + o.steps
        finally:
            for way in ways.values():
                if hasattr(way, "close"):
                    way.close()
    return times


def report(name: str, times: dict) -> tuple:
    """``(lines, {way: ratio})``: each way's step, the data's cost, throughput against preloaded."""
    base = statistics.median(times["preloaded"])
    lines = [f"{name}: ms a step (median), the data's cost to the step, throughput against preloaded (90% interval)"]
    ratios = {}
    for w, t in times.items():
        med = statistics.median(t)
        line = f"  {w:14s} {1e3 * med:8.2f} ms"
        if w != "preloaded":
            ratio, lo, hi = paired_ratio(times["preloaded"], t)
            ratios[w] = ratio
            line += f"  {1e3 * (med - base):+7.2f} ms  {ratio:.2f}x ({lo:.2f}-{hi:.2f})"
        lines.append(line)
    return lines, ratios


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default="wide_deep_512,insightface,gpt2", help=f"from {sorted(HOST)}")
    ap.add_argument("--workers", default="1", help="threads / worker processes, comma-separated")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per way per round")
    ap.add_argument("--rounds", type=int, default=8)
    o = ap.parse_args(argv)
    o.workers = [int(w) for w in o.workers.split(",")]
    cases = o.cases.split(",")
    unknown = [c for c in cases if c not in HOST]
    if unknown or not o.workers or min(o.workers) < 1 or o.steps < 1 or o.rounds < 1:
        ap.error(f"cases from {sorted(HOST)} (unknown: {unknown}); workers, steps and rounds >= 1")
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, {len(os.sched_getaffinity(0))} cores, {o.rounds} rounds of {o.steps} steps",
          flush=True)
    summary = []
    for name in cases:
        lines, ratios = report(name, bench_case(name, o))
        print("\n".join(lines), flush=True)
        w = o.workers[0]
        summary.append(f"{name} ahead {ratios[f'ahead {w}']:.2f}x, DataLoader {ratios[f'DataLoader {w}']:.2f}x, "
                       f"in step {ratios['in step']:.2f}x")
    print("data feed: " + "; ".join(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
