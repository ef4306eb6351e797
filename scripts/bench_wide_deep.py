"""Wide&Deep as the vocabulary doubles: per-rank memory and step latency on 1, 2 and 4 ranks, and two peers.

    python scripts/bench_wide_deep.py [--budget-gib 1.0] [--start 16] [--batch 512] [--hidden 1024x7]
                                      [--steps 3] [--warmup 2] [--rounds 3]

For ``V = 2**start, 2**(start+1), ...`` rows (one shared vocabulary; wide
``[V, 1]`` and deep ``[V, 16]`` tables, 13 dense and 26 categorical
features, the recipe's MLP) one training step (forward, backward, global
norm clipping off, ``LazyAdamW``: AdamW on the MLP, lazy Adam on the table
rows looked up) runs on R = 1, 2, 4 local gloo ranks (``dpR``: tables split
over every rank, wide ``S(0)`` and deep ``S(1)``, the MLP data parallel, one
thread per process). Ids are uniform over ``V`` (each step looks up rows it
has not seen: no cache helps). Reported per (R, V):

- ``mem``: the peak, over building the model (each rank builds only its
  shard) and the steps, of the C heap in use above the process's baseline
  (``benchkit/heap.py``; the worst rank), in MiB;
- ``step``: the fastest step's wall seconds (other jobs only add time) of
  the slowest rank (4 ranks share 2 cores here: compare a column down the V
  axis, not across R).

Memory is predicted before each point from the two previous ones
(linear in V); the doubling stops when the prediction exceeds the budget
(``--budget-gib`` per process, default 1 GiB, far below the machine's
share). The largest V that fits is then the largest the last two points
predict within 98% of the budget (rounded down to 1/8 of a power of two),
run to confirm, or else the last doubling. The peers:

- torch: the same model as plain single-process PyTorch (``nn.EmbeddingBag``
  tables with ``sparse=True``, ``torch.optim.SparseAdam`` for them (its
  moments are dense: 3x the tables), AdamW for the MLP), on rank 0 with
  one thread, at each V that fits its budget;
- DDP: that model under ``DistributedDataParallel`` on 2 and 4 ranks (every
  rank holds whole tables; sparse gradients all-reduced) where it fits.

Last line: ``wide_deep: max vocab 1 rank A, 4 ranks B (B/A = X.Xx); latency
growth per vocab doubling Y%; vs torch single thr Z.ZZx`` where Y is the
geometric mean over every doubling of our runs (all R) of the step-time
ratio minus 1, and Z our 1-rank throughput over torch's single process at
the largest V both ran (the same one thread), run back to back for
``--rounds`` rounds, best of each. ``--json PATH`` also writes the table's
rows (one per series and V) and the largest V of each series.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import time

import torch
import torch.nn.functional as F
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import sbp_core as sc
from recipes.wide_deep.model import WideDeep, WideDeepConfig, bce_loss
from recipes.wide_deep.plan import DATA_SBP, mesh_plan
from benchkit.heap import HeapPeak, heap_bytes
from toolkit.lazy_adam import LazyAdamW
from toolkit.mesh import stage_ranks
from toolkit.rank_pool import get_pool

WORLD = 4
N_DENSE, N_FIELDS, DIM = 13, 26, 16
MIB = 2 ** 20


def _batches(n: int, batch: int, rows: int):
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(batch, N_DENSE, generator=gen), torch.randint(0, rows, (batch, N_FIELDS), generator=gen),
             torch.randint(0, 2, (batch,), generator=gen).float()) for _ in range(n)]


def _measure(build, step, batches, warmup: int) -> tuple:
    """(fastest step after ``warmup`` in seconds, peak heap above the start in bytes); builds inside the window.

    The fastest step, not the median: other jobs on the machine only ever add time.
    """
    gc.collect()
    base = heap_bytes()
    peak = HeapPeak()
    peak.start()
    try:
        state = build()
        times = []
        for k, b in enumerate(batches):
            t0 = time.perf_counter()
            step(state, b)
            if k >= warmup:
                times.append(time.perf_counter() - t0)
    finally:
        mem = peak.stop() - base
    del state
    gc.collect()
    return min(times), mem


def _cfg(rows: int, hidden, meta: bool) -> WideDeepConfig:
    return WideDeepConfig(table_rows=rows, embed_dim=DIM, hidden=list(hidden), dropout=0.0, meta_tables=meta)


def run_ours(rows: int, ranks: int, batch: int, hidden, steps: int, warmup: int):
    """Worker: our recipe model on ``ranks`` ranks (dp = ranks); (seconds, heap bytes) on members."""
    p = sc.placement("cpu", stage_ranks(ranks, 1, 1)[0])
    if torch.distributed.get_rank() not in p:
        return None

    def build():
        torch.manual_seed(0)
        model = sc.distribute_module(WideDeep(_cfg(rows, hidden, meta=True)), p, mesh_plan())
        return model, LazyAdamW(model.parameters(), lr=1e-3)

    def step(state, b):
        model, opt = state
        x, i, y = (sc.distribute(t, p, DATA_SBP) for t in b)
        bce_loss(model(x, i), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return _measure(build, step, _batches(warmup + steps, batch, rows), warmup)


class TorchWideDeep(nn.Module):
    """The same network as plain PyTorch: ``nn.EmbeddingBag`` tables (sum over fields; one row per bag for deep)."""

    def __init__(self, rows: int, hidden):
        super().__init__()
        self.wide = nn.EmbeddingBag(rows, 1, mode="sum", sparse=True)
        self.deep = nn.EmbeddingBag(rows, DIM, mode="sum", sparse=True)
        layers, width = [], N_DENSE + N_FIELDS * DIM
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        self.mlp = nn.Sequential(*layers, nn.Linear(width, 1))

    def forward(self, dense, ids):
        flat = ids.reshape(-1)
        deep = self.deep(flat, torch.arange(flat.numel(), device=ids.device)).reshape(ids.shape[0], -1)
        return self.wide(ids).squeeze(-1) + self.mlp(torch.cat([dense, deep], 1)).squeeze(-1)


def _torch_optimizers(model: TorchWideDeep):
    return (torch.optim.SparseAdam(list(model.wide.parameters()) + list(model.deep.parameters()), lr=1e-3),
            torch.optim.AdamW(model.mlp.parameters(), lr=1e-3))


_GROUPS: dict = {}


def _group(ranks: int):
    """The process group of ranks ``0..ranks-1`` (built once, by every rank, in the same order)."""
    import torch.distributed as dist

    if ranks > 1 and ranks not in _GROUPS:
        _GROUPS[ranks] = dist.new_group(list(range(ranks)))
    return _GROUPS.get(ranks)


def run_torch(rows: int, ranks: int, batch: int, hidden, steps: int, warmup: int):
    """Worker: the plain model on rank 0 (``ranks == 1``) or under DDP on ``ranks`` ranks."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    me = dist.get_rank()
    group = _group(ranks)
    if me >= ranks:
        return None

    def build():
        torch.manual_seed(0)
        model = TorchWideDeep(rows, hidden)
        net = DDP(model, process_group=group) if ranks > 1 else model
        return net, _torch_optimizers(model)

    def step(state, b):
        net, opts = state
        dense, ids, y = (t.tensor_split(ranks)[me] for t in b)
        F.binary_cross_entropy_with_logits(net(dense, ids), y).backward()
        for o in opts:
            o.step()
            o.zero_grad(set_to_none=True)

    return _measure(build, step, _batches(warmup + steps, batch, rows), warmup)


def _worst(results) -> tuple:
    got = [r for r in results if r is not None]
    return max(r[0] for r in got), max(r[1] for r in got)


def _predict(points: dict, rows: int) -> float:
    """Heap bytes at ``rows`` from the line through the last two measured points."""
    (v1, m1), (v2, m2) = sorted(points.items())[-2:]
    slope = (m2 - m1) / (v2 - v1)
    return m2 + slope * (rows - v2)


def _run_point(pool, fn, rows: int, ranks: int, args) -> tuple:
    return _worst(pool.run(fn, rows, ranks, args.batch, args.hidden, args.steps, args.warmup))


def sweep(pool, fn, ranks: int, args, budget: float) -> tuple:
    """``({rows: (seconds, bytes)}, largest rows that fit)``: ``rows`` doubles until the predicted heap exceeds
    ``budget``; then the largest V the last two points predict to fit (rounded down to 1/8 of a power of two)
    is run too, and is the maximum if it stays within the budget."""
    out, mem = {}, {}
    rows = 2 ** args.start
    _run_point(pool, fn, rows, ranks, args)  # warm-up: first-call allocations and caches
    while not (len(mem) >= 2 and _predict(mem, rows) > budget):
        res = _run_point(pool, fn, rows, ranks, args)
        if res[1] > budget:  # measured over: not a fit (the prediction was optimistic)
            break
        out[rows], mem[rows] = res, res[1]
        print(f"  {fn.__name__:9s} R={ranks} V=2^{int(math.log2(rows))}: {res[0] * 1e3:8.1f} ms/step  "
              f"{res[1] / MIB:8.1f} MiB", flush=True)
        rows *= 2
    best = max(out)
    if len(mem) >= 2:
        (v1, m1), (v2, m2) = sorted(mem.items())[-2:]
        guess = v2 + (0.98 * budget - m2) * (v2 - v1) / (m2 - m1)
        grain = 2 ** max(int(math.log2(guess)) - 3, 0)
        guess = int(guess // grain * grain)
        if guess > best:
            res = _run_point(pool, fn, guess, ranks, args)
            print(f"  {fn.__name__:9s} R={ranks} V={guess}: {res[0] * 1e3:8.1f} ms/step  {res[1] / MIB:8.1f} MiB "
                  f"({'fits' if res[1] <= budget else 'over'})", flush=True)
            if res[1] <= budget:
                best = guess
    return out, best


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--budget-gib", type=float, default=1.0, help="heap per process a point may use (GiB)")
    ap.add_argument("--start", type=int, default=16, help="first V = 2**start")
    ap.add_argument("--batch", type=int, default=512, help="global batch (samples)")
    ap.add_argument("--hidden", default="1024x7", help="MLP widths, e.g. 1024x7 or 512,256")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3, help="back-to-back rounds of ours vs torch single")
    ap.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = ap.parse_args()
    if "x" in args.hidden:
        width, depth = args.hidden.split("x")
        args.hidden = [int(width)] * int(depth)
    else:
        args.hidden = [int(h) for h in args.hidden.split(",")]
    budget = args.budget_gib * 2 ** 30
    print(f"uptime: {os.popen('uptime').read().strip()}")
    print(f"budget {args.budget_gib} GiB heap per process; batch {args.batch}; MLP {args.hidden}; "
          f"{args.warmup}+{args.steps} steps per point")
    pool = get_pool(WORLD)
    ours, peers, most = {}, {}, {}
    for r in (1, 2, 4):
        ours[r], most[f"ours{r}"] = sweep(pool, run_ours, r, args, budget)
    peers["torch"], most["torch"] = sweep(pool, run_torch, 1, args, budget)
    for r in (2, 4):
        peers[f"DDP{r}"], most[f"DDP{r}"] = sweep(pool, run_torch, r, args, budget)
    all_rows = sorted({v for d in list(ours.values()) + list(peers.values()) for v in d})
    names = [f"ours{r}" for r in (1, 2, 4)] + list(peers)
    table = {**{f"ours{r}": ours[r] for r in (1, 2, 4)}, **peers}
    print()
    print(f"{'V':>6s} " + " ".join(f"{n + ' ms':>11s} {n + ' MiB':>11s}" for n in names))
    for v in all_rows:
        cells = []
        for n in names:
            t = table[n].get(v)
            cells.append(f"{t[0] * 1e3:11.1f} {t[1] / MIB:11.1f}" if t else f"{'-':>11s} {'-':>11s}")
        print(f"2^{int(math.log2(v)):<4d} " + " ".join(cells))
    print()
    ratios = [series[2 * v][0] / series[v][0] for series in ours.values() for v in series if 2 * v in series]
    growth = (math.exp(sum(math.log(x) for x in ratios) / len(ratios)) - 1) * 100 if ratios else float("nan")
    print("largest V within the budget: " + "; ".join(f"{k} {v} ({v / 2 ** 20:.1f}M rows)" for k, v in most.items()))
    both = max(set(ours[1]) & set(peers["torch"]))
    best = {"ours": math.inf, "torch": math.inf}
    for _ in range(args.rounds):  # back to back, best of rounds: the same load for both
        for name, fn in (("ours", run_ours), ("torch", run_torch)):
            best[name] = min(best[name], _worst(pool.run(fn, both, 1, args.batch, args.hidden, args.steps,
                                                         args.warmup))[0])
    thr = best["torch"] / best["ours"]
    a, b = most["ours1"], most["ours4"]
    print(f"throughput ours R=1 / torch single at V=2^{int(math.log2(both))}, best of {args.rounds} rounds: "
          f"{thr:.2f}x ({best['ours'] * 1e3:.1f} vs {best['torch'] * 1e3:.1f} ms/step)")
    print(f"wide_deep: max vocab 1 rank {a}, 4 ranks {b} (B/A = {b / a:.1f}x); latency growth per vocab doubling "
          f"{growth:.0f}%; vs torch single thr {thr:.2f}x")
    if args.json:
        rows = [{"series": n, "rows": v, "step_s": t[0], "peak_bytes": t[1]} for n in names for v, t in table[n].items()]
        with open(args.json, "w") as f:
            json.dump({"setting": vars(args), "budget_bytes": budget, "rows": rows, "max_rows": most,
                       "growth_pct": growth, "thr_vs_torch": thr}, f, indent=1)


if __name__ == "__main__":
    main()
