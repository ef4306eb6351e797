"""Batches a second: loading in the step (one thread), our read-ahead threads, and DataLoader's worker processes.

    python scripts/bench_read_ahead.py [--cases wide_deep,insightface,gpt2] [--workers 1,2,4]
                                       [--batches 16] [--rounds 4]

Per recipe, at the shapes ``scripts/bench_gpu.py`` trains on a GPU
(Wide&Deep: 16384 synthetic rows; InsightFace: 128 synthetic 112x112 face
images; GPT-2: 8 x 1024 tokens), the recipe's own ``MicroBatches`` (the
rows a one-rank job reads) loads ``--batches`` consecutive micro-batches:

- ``in step``: ``MicroBatches.load`` one after the other on this thread,
  what a step's data actors do inside its run;
- ``ahead N``: ``toolkit.data.ReadAhead`` with ``N`` threads and ``2N``
  pieces ahead (the default on a GPU with ``N`` threads), from an empty
  window, nothing pinned (no GPU is needed);
- ``DataLoader N``: ``torch.utils.data.DataLoader`` over the same pieces
  (a map-style dataset of ``load``, ``batch_size=None``), ``N`` persistent
  worker processes, ``prefetch_factor=2``: the peer. Its workers start
  before any timing (each loader is iterated once first), as the
  read-ahead's threads do.

Each round times every way once, in a carryover-balanced order
(``benchkit.paired.balanced_orders``), each over its own pieces (a window
or a worker's queue holds nothing of another round's). Printed per case:
each way's median milliseconds a batch, and ``ahead N`` against
``DataLoader N`` as a paired ratio (their throughput, above 1 favours
ours) with its 90% bootstrap interval. Every way's first batch is checked
equal to ``load``'s. The step itself runs on torch's intra-op threads
(``torch.set_num_threads(1)`` here, as DataLoader's workers do).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time

import torch

from benchkit.paired import balanced_orders, paired_ratio
from benchkit.pieces import Pieces, Window, same_batch

CASES = {
    "wide_deep": ["recipe=wide_deep", "trainer.micro_batch_size=16384", "trainer.global_batch_size=16384"],
    "insightface": ["recipe=insightface", "model=iresnet50", "model.num_classes=1000", "trainer.micro_batch_size=128",
                    "trainer.global_batch_size=128", "data.synthetic.images_per_identity=4"],
    "gpt2": ["recipe=gpt2", "model=gpt2", "trainer.micro_batch_size=8", "trainer.global_batch_size=8",
             "data.max_bytes=2000000"],
}


def micro_batches(overrides: list, root: str):
    """The recipe's ``MicroBatches`` of a one-rank job with ``overrides`` (on the CPU: nothing is copied)."""
    from recipes.registry import get
    from toolkit.config import compose
    from toolkit.config.schema import typed
    from toolkit.config.validate import validate

    cfg = compose([*overrides, "logger=none", "device=cpu"], run_dir=root)
    recipe = get(cfg.recipe.name)
    layout = validate(cfg, recipe, world_size=1)
    cfg = typed(cfg, recipe)
    return recipe.data(cfg, recipe.prepare(cfg), "train", 0, 1, layout)


class InStep:
    def __init__(self, batches):
        self.pieces = Pieces(batches)

    def load(self, start: int, n: int) -> list:
        return [self.pieces[q] for q in range(start, start + n)]


class Ahead:
    def __init__(self, batches, workers: int):
        from toolkit.data import ReadAhead

        self.batches, self.workers = batches, workers

        def make():
            return ReadAhead(batches, 2 * workers, workers)

        self.make = make

    def load(self, start: int, n: int) -> list:
        ahead = self.make()
        try:
            return [ahead.get(q) for q in range(start, start + n)]
        finally:
            ahead.close()


class Loader:
    def __init__(self, batches, workers: int, n: int):
        self.window = Window(n)
        self.loader = torch.utils.data.DataLoader(Pieces(batches), batch_size=None, sampler=self.window,
                                                  num_workers=workers, persistent_workers=True, prefetch_factor=2)
        self.load(1 << 30, n)  # the workers start here, before any timing

    def load(self, start: int, n: int) -> list:
        self.window.start = start
        return list(self.loader)


def bench_case(name: str, o) -> dict:
    """``{way: [seconds per batch, per round]}`` of one case."""
    with tempfile.TemporaryDirectory(prefix="bench-read-ahead-") as root:
        batches = micro_batches(CASES[name], root)
        ways = {"in step": InStep(batches)}
        for w in o.workers:
            ways[f"ahead {w}"] = Ahead(batches, w)
            ways[f"DataLoader {w}"] = Loader(batches, w, o.batches)
        want = InStep(batches).load(0, 1)[0]
        for way_name, way in ways.items():
            if not same_batch(way.load(0, 1 if isinstance(way, (InStep, Ahead)) else o.batches)[0], want):
                raise AssertionError(f"{name}: {way_name}'s first batch is not load's")
        times = {w: [] for w in ways}
        orders = balanced_orders(list(ways))
        start = 1000
        for r in range(o.rounds):
            for w in orders[r % len(orders)]:
                t = time.perf_counter()
                ways[w].load(start, o.batches)
                times[w].append((time.perf_counter() - t) / o.batches)
                start += o.batches
        for way in ways.values():
            if isinstance(way, Loader):
                del way.loader  # its workers exit
    return times


def report(name: str, times: dict, o) -> list:
    lines = [f"{name}: ms a batch, median of {o.rounds} rounds of {o.batches} batches"]
    lines += [f"  {w:14s} {1e3 * statistics.median(t):8.1f}" for w, t in times.items()]
    for w in o.workers:
        med, lo, hi = paired_ratio(times[f"DataLoader {w}"], times[f"ahead {w}"])
        lines.append(f"  ahead {w} / DataLoader {w} throughput {med:.2f}x ({lo:.2f}-{hi:.2f})")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default="wide_deep,insightface,gpt2")
    ap.add_argument("--workers", default="1,2,4", help="threads / worker processes, comma-separated")
    ap.add_argument("--batches", type=int, default=16, help="batches per way per round")
    ap.add_argument("--rounds", type=int, default=4)
    o = ap.parse_args(argv)
    o.workers = [int(w) for w in o.workers.split(",")]
    cases = o.cases.split(",")
    unknown = [c for c in cases if c not in CASES]
    if unknown or not o.workers or min(o.workers) < 1 or o.batches < 1 or o.rounds < 1:
        ap.error(f"cases from {sorted(CASES)} (unknown: {unknown}); workers, batches and rounds >= 1")
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, {len(__import__('os').sched_getaffinity(0))} cores", flush=True)
    for name in cases:
        for line in report(name, bench_case(name, o), o):
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
