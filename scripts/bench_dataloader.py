"""Training throughput with data from the actor pipeline, DataLoader, or memory.

    python scripts/bench_dataloader.py

Trains the tiny GPT-2 (``recipes/gpt2`` with ``scripts/verify_parity.GPT_CFG``,
batch 16 x 32 tokens, AdamW) for ``STEPS`` steps four ways, each from the same
seed and over the same batches:

- actor pipeline: ``runtime.data_pipeline`` stages (read -> decode -> collate,
  2 registers each, with no to_device as there is nothing to copy; on the
  data queue, which on a CPU-only host the compute thread runs:
  ``runtime.executor.thread_homes``) reading a raw
  token file on disk, and the training step as an actor on the compute queue
  consuming the last stage (``run(plan, STEPS)``; with every actor on one
  thread, the executor runs that thread's loop on the caller's, here the
  main thread);
- DataLoader with 0 (loading on the training thread, as our pipeline does
  on a CPU host), 1 and 2 persistent worker processes over the same
  ``TokenFile`` as a map-style dataset (``batch_size=None``: each item is one
  batch made by the same read, decode and collate calls). Each loader is
  built and iterated once before any timing, so its workers' start-up is
  outside every timed loop, as the executor's threads' is;
- synthetic: the same batches built in memory beforehand, a plain step loop;
- synthetic again (``synthetic'``), timed as a way of its own: the ratio
  ``synthetic'/synthetic`` is what two identical loops read here, the bench's
  noise floor.

The process keeps freed host memory (``runtime.host_memory``) as a training
run does (``train.py`` sets it first thing): without it a thread other than
the main one allocates from a malloc arena of its own, which glibc unmaps
and trims as the step frees. Timed from inside (24 balanced repeats, paired
to the main thread) the same step read 0.95-0.98x on other threads without
the policy, 0.96-1.03x with it (two runs); on a long-lived worker 0.94x,
1.01x and 1.02x in three processes (16 repeats each), which is why a run
on one thread now stays on the caller's.

The training step runs with ``torch.set_num_threads(1)`` (DataLoader workers
use one thread each too) so that on a 2-core machine data loading has a core
to overlap with instead of competing with intra-op threads. Each time is the
whole loop (the executor's threads and the loaders' workers already
running), median of ``REPEATS`` runs interleaved across the six ways, each repeat in
an order of a carryover-balanced design (``benchkit.paired.balanced_orders``:
over every 10 repeats each way runs twice in each slot and twice right after
each other way). A fixed order put the synthetic loop right after the
2-worker DataLoader, whose worker processes were still exiting; a seeded
random order per repeat did so 8 times in 15, every run alike. On this 2-core
host one loop of ~1 s varies by 5-10% from run to run, and the paired ratio
comes with a 90% bootstrap interval (repeats resampled): a bar inside it is
not resolved by that run.

The repeats are split over ``PROCESSES`` fresh processes run one after the
other (``--processes``; each a whole balanced block of 10 repeats by
default) and pooled. Within one process the ways' steps run at speeds
that differ by up to ~6% for the whole process, identical ways included,
and differ the other way in the next process: the steps timed from inside
read synthetic'/synthetic 0.94-1.06x over 40-repeat and 20-repeat runs of
one process each, and in three processes of 16 repeats (a plain loop that
reads the file each step beside them, notes ``layout.py``) the pipeline's
steps read 1.00x, 1.00x and 1.05x the synthetic loop's, the reading loop's
1.00x, 1.00x and 0.96x. One process's whole-loop ratio then read 0.92x and
the next 1.02x (``--repeats 40``, both with the pipeline's time outside its
steps at 0.991x). Pooling processes averages that luck instead of keeping
one draw of it.

Each loop's time outside its training steps (the steps timed inside, the
same function in every way) is what a way adds besides the steps, without
the steps' drift between turns; the line before the last sets those beside
the synthetic loop's median step time for a ratio the drift does not reach
(it does not see a way that makes the steps themselves slower, a thread
taking the GIL from them, say; the whole-loop ratios do). The last line is
measured, whole-loop, paired per repeat: ``data: actor pipeline A.AAx
synthetic (lo-hi), B.BBx DataLoader(0), C.CCx DataLoader(best of 1, 2)``.

``--steps``, ``--repeats`` and ``--processes`` override ``STEPS``,
``REPEATS`` and ``PROCESSES``; ``--json PATH`` also writes the printed rows
as JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time


from runtime.host_memory import keep_freed_host_memory

keep_freed_host_memory()  # as train.py: first thing, so every thread (the executor's too) shares one arena

import torch
from torch.utils.data import DataLoader

from recipes.gpt2.model import GPT2LMHeadModel
from benchkit.token_file import TokenFile, write_tokens
from runtime.executor import run
from runtime.plan import ActorSpec, Plan
from benchkit.paired import balanced_orders, paired_ratio
from benchkit.parity import GPT_CFG

STEPS, BATCH, SEQ, REPEATS, PROCESSES = 60, 16, 32, 40, 4


IN_STEP = [0.0]  # seconds spent inside training steps since the last reset (every way's steps add here)


def _trainer():
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT_CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(batch) -> float:
        t = time.perf_counter()
        ids = batch["input_ids"]
        loss = model(ids, ids)[1]
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        out = loss.item()
        IN_STEP[0] += time.perf_counter() - t
        return out

    return step


def actor_pipeline(data: TokenFile) -> list:
    step = _trainer()
    stages = data.stages(device=None, quota=2)
    plan = Plan(stages + [ActorSpec("train.step", lambda k, batch: step(batch), inputs=(stages[-1].name,),
                                    queue="compute")])
    return run(plan, STEPS, timeout=60).outputs["train.step"]


def loader(data: TokenFile, workers: int) -> DataLoader:
    """A DataLoader as its users configure it for a long run (persistent workers), iterated once: started."""
    kw = dict(prefetch_factor=2, persistent_workers=True) if workers else {}
    dl = DataLoader(data, batch_size=None, shuffle=False, num_workers=workers, **kw)
    for _ in dl:
        pass
    return dl


def dataloader(dl: DataLoader) -> list:
    step = _trainer()
    return [step(b) for b in dl]


def synthetic(batches: list) -> list:
    step = _trainer()
    return [step(b) for b in batches]


def _args(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--repeats", type=int, default=REPEATS)
    ap.add_argument("--processes", type=int, default=PROCESSES,
                    help="fresh processes the repeats are split over, one after the other (1: this one)")
    ap.add_argument("--json", default=None, help="also write the rows to this JSON file")
    ap.add_argument("--raw", default=None, help=argparse.SUPPRESS)  # a child: write its raw times here
    ap.add_argument("--order-seed", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.steps < 1 or args.repeats < 1 or args.processes < 1:
        ap.error("--steps, --repeats and --processes must be >= 1")
    return args


def _measure(order_seed: int) -> tuple:
    """``(times, outside, losses)`` of ``REPEATS`` repeats in this process: per way, each repeat's seconds."""
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "tokens.bin")
        torch.manual_seed(1)
        write_tokens(path, torch.randint(0, GPT_CFG.vocab_size, (STEPS * BATCH, SEQ)))
        data = TokenFile(path, SEQ, BATCH)
        assert len(data) == STEPS
        batches = [data[k] for k in range(STEPS)]
        loaders = {w: loader(data, w) for w in (0, 1, 2)}
        ways = {
            "actor pipeline": lambda: actor_pipeline(data),
            "DataLoader (0 workers)": lambda: dataloader(loaders[0]),
            "DataLoader (1 worker)": lambda: dataloader(loaders[1]),
            "DataLoader (2 workers)": lambda: dataloader(loaders[2]),
            "synthetic (in memory)": lambda: synthetic(batches),
            "synthetic' (again)": lambda: synthetic(batches),
        }
        synthetic(batches[:10])  # warm up allocator and kernels before any timing
        actor_pipeline(data)  # and the executor's queue threads
        times = {name: [] for name in ways}
        outside = {name: [] for name in ways}
        losses = {}
        orders = balanced_orders(list(ways))
        random.Random(order_seed).shuffle(orders)
        for k in range(REPEATS):
            for name in orders[k % len(orders)]:
                fn = ways[name]
                IN_STEP[0] = 0.0
                t = time.perf_counter()
                losses[name] = fn()
                times[name].append(time.perf_counter() - t)
                outside[name].append(times[name][-1] - IN_STEP[0])
    return times, outside, losses


def _in_processes(processes: int) -> tuple:
    """``_measure`` in ``processes`` fresh processes one after the other, pooled (each way's losses must agree)."""
    share = [REPEATS // processes + (i < REPEATS % processes) for i in range(processes)]
    times, outside, losses = {}, {}, None
    with tempfile.TemporaryDirectory() as tmp:
        for i, repeats in enumerate(share):  # processes <= REPEATS: every share >= 1
            raw = os.path.join(tmp, f"raw{i}.json")
            subprocess.run([sys.executable, os.path.abspath(__file__), "--steps", str(STEPS), "--repeats", str(repeats),
                            "--processes", "1", "--raw", raw, "--order-seed", str(i)], check=True)
            with open(raw) as f:
                got = json.load(f)
            for name in got["times"]:
                times.setdefault(name, []).extend(got["times"][name])
                outside.setdefault(name, []).extend(got["outside"][name])
            if losses is None:
                losses = got["losses"]
            elif got["losses"] != losses:
                raise RuntimeError(f"process {i}'s losses differ from process 0's: the ways are not deterministic")
    return times, outside, losses


def main(argv=None) -> None:
    global STEPS, REPEATS
    args = _args(argv)
    STEPS, REPEATS = args.steps, args.repeats
    processes = min(args.processes, REPEATS)
    if processes > 1:
        times, outside, losses = _in_processes(processes)
    else:
        times, outside, losses = _measure(args.order_seed)
        if args.raw:
            with open(args.raw, "w") as f:
                json.dump({"times": times, "outside": outside, "losses": losses}, f)
            return
    ways = list(times)
    ref = losses["synthetic (in memory)"]
    print(f"tiny GPT-2 {GPT_CFG.n_layer} layers, batch {BATCH} x {SEQ}, {STEPS} steps, "
          f"torch threads 1, median of {REPEATS} over {processes} process{'es' if processes > 1 else ''}, "
          f"{os.cpu_count()} cores")
    rate = {}
    for name in ways:
        med = statistics.median(times[name])
        rate[name] = STEPS / med
        same = "same losses" if losses[name] == ref else "LOSSES DIFFER"
        print(f"  {name:24s} {med * 1e3:8.1f} ms (min {min(times[name]) * 1e3:7.1f})  "
              f"{rate[name]:6.1f} steps/s  ({same} as synthetic)")
    actor = rate["actor pipeline"]
    if args.json:
        _write_json(args.json, times, losses, ref, processes)
    again = "synthetic' (again)"
    floor = rate[again] / rate["synthetic (in memory)"]
    base = times["synthetic (in memory)"]
    mid, lo, hi = paired_ratio(base, times["actor pipeline"])
    print(f"paired, the median over repeats of each repeat's own ratio (drift between repeats cancels): "
          f"actor pipeline / synthetic {mid:.2f} (90% interval {lo:.2f}-{hi:.2f}), "
          f"synthetic'/synthetic {paired_ratio(base, times[again])[0]:.2f}")
    print(f"ratio of medians: actor pipeline / synthetic {actor / rate['synthetic (in memory)']:.2f}; "
          f"noise floor (synthetic'/synthetic): {floor:.2f}")
    out = {name: statistics.median(v) for name, v in outside.items()}
    inside = {name: statistics.median(t - o for t, o in zip(times[name], outside[name])) for name in ways}
    steps = inside["synthetic (in memory)"]
    print("outside the training steps, median ms per loop (model set-up, data, hand-offs, start-up): "
          + ", ".join(f"{name} {v * 1e3:.1f}" for name, v in out.items())
          + "; inside them: " + ", ".join(f"{name} {v * 1e3:.0f}" for name, v in inside.items())
          + f"; with the synthetic loop's steps as the common cost, actor pipeline / "
          f"synthetic {(steps + out['synthetic (in memory)']) / (steps + out['actor pipeline']):.3f}")
    best = max(("DataLoader (1 worker)", "DataLoader (2 workers)"), key=lambda n: rate[n])
    dl0 = paired_ratio(times["DataLoader (0 workers)"], times["actor pipeline"])[0]
    dlb = paired_ratio(times[best], times["actor pipeline"])[0]
    print(f"data: actor pipeline {mid:.2f}x synthetic ({lo:.2f}-{hi:.2f}), {dl0:.2f}x DataLoader(0), "
          f"{dlb:.2f}x DataLoader(best of 1, 2: {best.split('(')[1].split()[0]})")


def _write_json(path: str, times: dict, losses: dict, ref: list, processes: int) -> None:
    rows = [{"way": name, "median_s": statistics.median(t), "min_s": min(t),
             "steps_per_s": STEPS / statistics.median(t), "tokens_per_s": STEPS * BATCH * SEQ / statistics.median(t),
             "same_losses": losses[name] == ref} for name, t in times.items()]
    setting = {"n_layer": GPT_CFG.n_layer, "batch": BATCH, "seq": SEQ, "steps": STEPS, "repeats": REPEATS,
               "processes": processes}
    with open(path, "w") as f:
        json.dump({"setting": setting, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
