"""InsightFace's FC at scale: per-rank memory and images/s vs identities, DDP vs our class-split FC vs Partial FC.

    python scripts/bench_insightface.py [--ranks 4] [--classes 10000,100000,300000,1000000]
                                        [--budget-mib 1024] [--steps 3] [--batch 64] [--rounds 3]

On ``--ranks`` local gloo ranks, a small iResNet-18 (width 8, 32x32 images,
128-d embeddings) with an ArcFace head over C identities, global batch
``--batch``, SGD with momentum, for each C:

- ``ddp``: plain data parallel, the FC replicated on every rank
  (``torch.nn.parallel.DistributedDataParallel``; each rank's softmax over
  its own images and all C classes), torch's SGD;
- ``mp``: our plan (``recipes/insightface/plan.py``): backbone data parallel,
  FC ``S(0)`` over the classes on every rank, embeddings all-gathered, the
  class-split softmax (``PartialFCSGD`` = SGD here);
- ``pfc``: the same with Partial FC, ``sample_rate=0.1``.

Memory: the peak C-heap bytes of the worst rank during warmup and the timed
steps, above the heap before the model was built (``benchkit/heap.py``):
parameters, gradients (DDP's buckets too), momentum and activations.
Throughput: the global batch over the median step time of the worst rank.
At each C the kinds run back to back ``--rounds`` times, each round in an
order of a carryover-balanced design (``benchkit.paired``), so they see the
same machine load and none always goes first; a kind's figures at C are the
medians over rounds, and the mp/ddp throughput ratio is the median of the
rounds' paired ratios. A run whose memory the measured points predict
(linear fit in C) above ``--budget-mib`` is not started ("over budget", as
InsightFace's table shows DP running out first). The largest C each kind
would fit in the budget is a prediction from that fit, and is printed as
one. Last line, every C both ran:
``insightface mp/ddp: thr C1 X.XXx, C2 Y.YYx, ...; mem C1 0.XXx, ...; predicted max classes (linear fit) ddp A, mp B, pfc C``.
``--json PATH`` also writes the rows (one per classes and kind) and the predictions.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import sbp_core as sc
from recipes.insightface.head import MarginSoftmaxHead
from recipes.insightface.iresnet import iresnet
from recipes.insightface.margin import CombinedMargin
from recipes.insightface.model import FaceModel
from recipes.insightface.optim import PartialFCSGD
from recipes.insightface.plan import DATA_SBP, PLAN
from benchkit.heap import HeapPeak, heap_bytes
from benchkit.paired import balanced_orders, paired_ratio

KINDS = ("ddp", "mp", "pfc")
WIDTH, IMAGE, EMB = 8, 32, 128
SGD = dict(lr=0.1, momentum=0.9, weight_decay=5e-4)


def _model(classes: int, sample_rate: float) -> FaceModel:
    torch.manual_seed(0)
    backbone = iresnet("iresnet18", width=WIDTH, image_size=IMAGE, embedding_size=EMB)
    return FaceModel(backbone, MarginSoftmaxHead(classes, EMB, CombinedMargin.named("arcface"), sample_rate))


def run(kind: str, classes: int, batch: int, steps: int, warmup: int = 1) -> dict:
    """On every rank: ``{"peak": bytes above the start, "step_s": median step seconds}``."""
    gc.collect()
    world = torch.distributed.get_world_size()
    base = heap_bytes()
    peak = HeapPeak()
    peak.start()
    gen = torch.Generator().manual_seed(1)
    images = torch.randn(batch, 3, IMAGE, IMAGE, generator=gen)
    labels = torch.randint(0, classes, (batch,), generator=gen)
    model = _model(classes, 0.1 if kind == "pfc" else 1.0)
    if kind == "ddp":
        rank = torch.distributed.get_rank()
        x, y = images.tensor_split(world)[rank], labels.tensor_split(world)[rank]
        model = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(model.parameters(), **SGD)
    else:
        p = sc.placement("cpu", [[r] for r in range(world)])
        model = sc.distribute_module(model, p, PLAN)
        x, y = sc.distribute(images, p, DATA_SBP), sc.distribute(labels, p, DATA_SBP)
        opt = PartialFCSGD(model.parameters(), {model.head.weight: model.head.sampled_rows}, **SGD)
    times = []
    for i in range(warmup + steps):
        torch.distributed.barrier()
        start = time.perf_counter()
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    out = {"peak": peak.stop() - base, "step_s": statistics.median(times)}
    del model, opt, loss
    gc.collect()
    return out


def _fit(points: dict):
    """``(a, b)`` of ``mem = a + b * C`` through the measured ``{C: mem}`` (least squares; None with < 2 points)."""
    if len(points) < 2:
        return None
    cs, ms = list(points), list(points.values())
    mc, mm = statistics.fmean(cs), statistics.fmean(ms)
    b = sum((c - mc) * (m - mm) for c, m in zip(cs, ms)) / sum((c - mc) ** 2 for c in cs)
    return mm - b * mc, b


def _max_classes(points: dict, budget: float) -> str:
    fit = _fit(points)
    if fit is None or fit[1] <= 0:
        return "?"
    return f"{int((budget - fit[0]) / fit[1]):,}"


def _over(points: dict, classes: int, budget: float) -> bool:
    """Does the fit through the measured points put ``classes`` above the budget (so the run is not started)?"""
    fit = _fit(points)
    return fit is not None and fit[0] + fit[1] * classes > budget


def _mib(n: float) -> str:
    return f"{n / 2 ** 20:8.1f}"


def main(argv=None) -> int:
    from toolkit.rank_pool import get_pool

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--classes", default="10000,100000,300000,1000000")
    ap.add_argument("--budget-mib", type=float, default=1024.0, help="per-rank memory budget for 'fits'")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=64, help="global batch (images)")
    ap.add_argument("--rounds", type=int, default=3, help="back-to-back rounds of the kinds at each C")
    ap.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = ap.parse_args(argv)
    classes = [int(c) for c in args.classes.split(",")]
    budget = args.budget_mib * 2 ** 20
    pool = get_pool(args.ranks, timeout=900)
    print(f"iResNet-18 width {WIDTH}, {IMAGE}x{IMAGE} images, {EMB}-d embeddings, ArcFace; global batch "
          f"{args.batch} on {args.ranks} gloo ranks; SGD momentum; budget {args.budget_mib:.0f} MiB per rank; "
          f"load {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(f"{'classes':>9} | {'ddp MiB':>8} {'img/s':>7} | {'mp MiB':>8} {'img/s':>7} | {'pfc0.1 MiB':>10} {'img/s':>7}")
    measured = {k: {} for k in KINDS}
    speed = {k: {} for k in KINDS}
    thr_ratio = {}
    orders = balanced_orders(list(KINDS))
    for ci, c in enumerate(classes):
        kinds = [k for k in KINDS if not _over(measured[k], c, budget)]
        rounds = {k: [] for k in kinds}  # (peak bytes, step s) per round
        for r in range(args.rounds):
            for kind in (k for k in orders[(ci * args.rounds + r) % len(orders)] if k in kinds):
                res = pool.run(run, kind, c, args.batch, args.steps)
                rounds[kind].append((max(x["peak"] for x in res), max(x["step_s"] for x in res)))
        cells = []
        for kind in KINDS:
            if kind not in kinds:
                cells.append(f"{'over budget':>16}")
                continue
            mem = statistics.median(m for m, _ in rounds[kind])
            step_s = statistics.median(t for _, t in rounds[kind])
            measured[kind][c], speed[kind][c] = mem, args.batch / step_s
            cells.append(f"{_mib(mem)} {args.batch / step_s:7.1f}")
        if "ddp" in kinds and "mp" in kinds:
            thr_ratio[c] = paired_ratio([t for _, t in rounds["ddp"]], [t for _, t in rounds["mp"]])[0]
        print(f"{c:>9,} | {cells[0]} | {cells[1]} | {'  ' + cells[2]}")
    both = [c for c in classes if c in thr_ratio]
    print(f"MiB: peak heap of the worst rank above its start; img/s: global batch / median step of the worst rank; "
          f"medians over {args.rounds} rounds. Predicted max classes: a linear fit of the measured MiB, "
          "extrapolated to the budget (not run)")
    print("insightface mp/ddp: thr " + ", ".join(f"{c:,} {thr_ratio[c]:.2f}x" for c in both)
          + "; mem " + ", ".join(f"{c:,} {measured['mp'][c] / measured['ddp'][c]:.2f}x" for c in both)
          + f"; predicted max classes (linear fit) ddp {_max_classes(measured['ddp'], budget)}, "
          f"mp {_max_classes(measured['mp'], budget)}, pfc {_max_classes(measured['pfc'], budget)}")
    if args.json:
        _write_json(args.json, args, classes, measured, speed, budget)
    return 0


def _write_json(path: str, args, classes: list, measured: dict, speed: dict, budget: float) -> None:
    """One row per (classes, kind): peak bytes and images/s, or ``None`` for both when over budget."""
    rows = [{"classes": c, "kind": k, "peak_bytes": measured[k].get(c), "images_per_s": speed[k].get(c)}
            for c in classes for k in KINDS]
    most = {k: _max_classes(measured[k], budget).replace(",", "") for k in KINDS}
    with open(path, "w") as f:
        json.dump({"setting": vars(args), "budget_bytes": budget, "rows": rows,
                   "predicted_max_classes": {k: int(v) if v.isdigit() else None for k, v in most.items()}}, f,
                  indent=1)


if __name__ == "__main__":
    sys.exit(main())
