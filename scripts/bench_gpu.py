"""Our trainer against a plain PyTorch loop on one device, recipe by recipe: how much host work we add.

    python scripts/bench_gpu.py                 # one GPU, the shapes users train: about 8 minutes on an H100
    python scripts/bench_gpu.py --host-only     # CPU, shapes where kernels are cheap and host work dominates
    python scripts/bench_gpu.py --profile 2 --trace-dir traces   # and where each way's step time goes

Cases (GPU / ``--host-only``):

- ``gpt2``: GPT-2 124M, micro-batch 8 x 1024, bf16, AdamW / 2 layers x 64,
  seq 64, batch 8, fp32; eager, and ``compiled`` (ours ``trainer.compile=true``
  against the plain loop's ``torch.compile``);
- ``insightface``: iresnet50 at 112x112, 1000 classes, batch 128, bf16, SGD /
  iresnet18-tiny at 32x32, batch 16, fp32;
- ``wide_deep``: the default 7 x 1024 MLP, V = 10^5, fp32, batch 512 and
  16384 / the tiny model (hidden 32, 16), batch 512 and 16384.

One process, one device (a 1-rank process group, as ``train.py`` on one
device). ``ours``: ``toolkit.trainer.Job`` stepping ``job.pipe.step(i)``,
its data read by the runtime's pipeline.
``plain``: ``toolkit.plain_loop.PlainLoop``, the same model class, seed,
optimizer (GPT-2's AdamW fused on CUDA; InsightFace's Partial FC SGD and
Wide&Deep's lazy Adam are the recipes' own on both sides), schedule,
precision and clipping; on a
GPU its batches are copied to the device before any timing (ours reads
its batches ahead on worker threads, ``toolkit.data.ReadAhead``, which also
copy them to the device on a side stream, beside the GPU's work); with
``--host-only`` it reads each step's batches as ours does (on a CPU host
nothing overlaps the step, so data work is on every loop's critical path
and the ratio is the runtime's own host work per step); there torch runs
on one thread and each way's time is the process's CPU time
(``time.process_time``), not the wall clock, which on a shared VM also
counts the time the process waits for a core (the same code's GPT-2 step
read 9.8 ms and 13.7 ms of wall time in two runs minutes apart). CPU time
still moves with what the neighbours do to caches and memory: runs of one
tree differ by about 0.03 in the ratio either way. Each way first runs
``--warmup`` steps; then ``--rounds`` rounds, each running ``--steps`` steps
of every way of a case in a carryover-balanced order
(``benchkit.paired.balanced_orders``), timed from a synchronised start to a
synchronised end (the loss read and ``torch.cuda.synchronize``), so every
kernel a way queued is inside its time; ours' time also ends after the
loads its read-ahead started in the round (``MicroBatches.settle``), so a
round of ours counts as many loads as steps, and none of them runs beside
the plain loop's steps, where its threads would take the GIL from them.
Per case: the median step time of each way, and the paired ratio
plain/ours (ours' throughput over the plain loop's; above 1 favours ours)
with its 90% bootstrap interval.

``--profile N`` then runs N more steps of each way under
``benchkit.device_profile`` and prints, per step, the wall time, how long
the device was busy (the rest of the step it waited for the host), the
kernel launches, the copies by direction, the CUDA calls that blocked a
thread, and where each synchronizing op was called; ``--trace-dir`` keeps
each way's Chrome trace. Those steps are not in the ratios; a case's
profile runs after its ratio is printed, so a profiler that fails or hangs
loses no timing.

Last line: ``gpu bench: gpt2 A.AAx eager, B.BBx compiled; insightface C.CCx;
wide_deep D.DDx (512), E.EEx (16384)`` (``-`` where a case did not run). The
same line follows every case but the last with what has run so far, so a
run cut short by a time limit still has one (its last ``gpu bench:`` line).
A case that raises prints its traceback and the next case runs; the exit
status is then 1.
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
import traceback

import torch

from benchkit.device_profile import profile_steps
from benchkit.one_device_cases import COMMON, GPU, HOST
from benchkit.paired import balanced_orders, paired_ratio


class Ours:
    def __init__(self, cfg):
        from recipes.registry import get
        from toolkit.trainer import Job

        self.job = Job(cfg, get(cfg.recipe.name))

    def step(self, i):
        return self.job.pipe.step(i)

    def settle(self):
        """Wait for the batches our read-ahead is loading for later steps: a round of ours ends when its
        loads do, and none of its work runs in the plain loop's time."""
        self.job.pipe.batches.settle()

    def close(self):
        self.job.close()  # its read-ahead threads


class Plain:
    def __init__(self, cfg, device, preload: int, compile: bool):
        from recipes.registry import get
        from toolkit.plain_loop import PlainLoop

        self.loop = PlainLoop(cfg, get(cfg.recipe.name), device, preload=preload, compile=compile)

    def step(self, i):
        return self.loop.step(i)

    def settle(self):
        pass  # nothing of the plain loop's runs after its step

    def close(self):
        pass


def _clock(device):
    """Wall time on a GPU (the device works beside the host); the process's CPU time on a CPU host."""
    return time.perf_counter if device == "cuda" else time.process_time


def _sync(device, value):
    if value is not None:
        float(value)  # the loss on the host: every step before it is done
    if device == "cuda":
        torch.cuda.synchronize()


def _case(name, overrides, o, root):
    """``({way: [seconds per step, per round]}, the ways, the first step left)`` of one case (ways: ours,
    plain)."""
    from toolkit.config import compose

    device = "cpu" if o.host_only else "cuda"
    compiled = name.endswith("+compile")
    total = o.warmup + o.rounds * o.steps + o.profile
    args = [*overrides, *COMMON, f"trainer.max_steps={total}", f"device={device}"]
    if compiled:
        args.append("trainer.compile=true")
    cfg = compose(args, run_dir=os.path.join(root, name))
    # On a GPU the plain loop's batches wait on the device (ours reads ahead on worker threads while
    # the GPU works). On a CPU host nothing can overlap the step, so there both loops read
    # their batches each step and the ratio is the runtime's own host work.
    ways = {"ours": Ours(cfg)}
    try:
        ways["plain"] = Plain(cfg, device, 0 if o.host_only else total, compiled)
        return _timed(ways, o, device)
    except BaseException:
        _close(ways)  # a case that fails leaves no read-ahead threads behind
        raise


def _timed(ways, o, device):
    """``_case``'s result for built ``ways``: warm-up, then the balanced rounds."""
    for way in ways.values():
        for i in range(o.warmup):
            _sync(device, way.step(i))
        way.settle()
    times = {w: [] for w in ways}
    orders = balanced_orders(list(ways))
    clock = _clock(device)
    for r in range(o.rounds):
        for w in orders[r % len(orders)]:
            first = o.warmup + r * o.steps
            _sync(device, None)
            start = clock()
            value = None
            for i in range(first, first + o.steps):
                value = ways[w].step(i)
            _sync(device, value)
            ways[w].settle()
            times[w].append((clock() - start) / o.steps)
    return times, ways, o.warmup + o.rounds * o.steps


def _profile(name, ways, o, first: int) -> None:
    """Print each way's ``benchkit.device_profile`` of ``o.profile`` steps from ``first`` (after the case's
    ratio is printed: a profiler that fails or hangs loses no timing)."""
    device = "cpu" if o.host_only else "cuda"
    for w in ways:
        trace = os.path.join(o.trace_dir, f"{name}-{w}.json.gz") if o.trace_dir else None
        try:
            prof = profile_steps(ways[w].step, range(first, first + o.profile), device, trace)
        except Exception as e:  # the case's timings stand without its profile
            print(f"  {w:6s} profile failed: {type(e).__name__}: {e}", flush=True)
            continue
        finally:
            ways[w].settle()
        print("\n".join(prof.lines(w)), flush=True)


def bench(o) -> list:
    """Every case on this process's one device; rows of results (runs inside a 1-rank process group)."""
    shapes = HOST if o.host_only else GPU
    cases = list(shapes.items())
    if o.compile:  # last: compiling takes the longest, and a run cut short keeps the other cases' lines
        cases.append(("gpt2+compile", shapes["gpt2"]))
    cases = [(k, v) for k, v in cases if k.removesuffix("+compile") in o.only]
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-gpu-") as root:
        for name, overrides in cases:
            start = time.perf_counter()
            error = None
            try:
                times, ways, first = _case(name, overrides, o, root)
            except Exception as e:  # the next cases still run: one GPU session gives one try
                traceback.print_exc()
                error = f"{type(e).__name__}: {e}"
            if error is not None:
                _release(o)  # out of the except block: its traceback no longer holds the case's frames
                rows.append({"case": name, "error": error})
                print(f"{name:18s} failed: {error}", flush=True)
                continue
            med, lo, hi = paired_ratio(times["plain"], times["ours"])
            rows.append({"case": name, "ours_ms": 1e3 * statistics.median(times["ours"]),
                         "plain_ms": 1e3 * statistics.median(times["plain"]), "ratio": med, "low": lo, "high": hi,
                         "seconds": time.perf_counter() - start})
            r = rows[-1]
            print(f"{name:18s} ours {r['ours_ms']:9.2f} ms  plain {r['plain_ms']:9.2f} ms  "
                  f"ours/plain throughput {med:.2f}x ({lo:.2f}-{hi:.2f})  [{r['seconds']:.0f} s]", flush=True)
            if name != cases[-1][0] or o.profile:  # main prints the last one, after any profile
                print(summary(rows), flush=True)
            if o.profile:
                try:
                    _profile(name, ways, o, first)
                except Exception:  # the case's timings stand, and the next cases still run
                    traceback.print_exc()
            _close(ways)
            del ways
            _release(o)
    return rows


def _close(ways) -> None:
    """Close every way (its threads; its device memory goes with it), whatever one raises."""
    for way in ways.values():
        try:
            way.close()
        except Exception:  # the others still close; the case's timings stand
            traceback.print_exc()


def _release(o) -> None:
    """Free what a case left behind (its ways, its cached GPU blocks) before the next one."""
    gc.collect()
    if not o.host_only:
        torch.cuda.empty_cache()


def _main_in_group(o):
    if o.host_only:
        torch.set_num_threads(1)  # every op's CPU time on the stepping thread (see _clock)
    return bench(o)


def summary(rows: list) -> str:
    got = {r["case"]: f"{r['ratio']:.2f}x" for r in rows if "error" not in r}

    def g(k):
        return got.get(k, "-")

    return (f"gpu bench: gpt2 {g('gpt2')} eager, {g('gpt2+compile')} compiled; insightface {g('insightface')}; "
            f"wide_deep {g('wide_deep_512')} (512), {g('wide_deep_16384')} (16384)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--host-only", action="store_true", help="CPU, small shapes: the host work per step")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=5, help="steps per way per round")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--no-compile", dest="compile", action="store_false", help="skip the compiled GPT-2 pair")
    ap.add_argument("--only", default="gpt2,insightface,wide_deep_512,wide_deep_16384")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="after the timed rounds, profile N more steps of each way (benchkit.device_profile)")
    ap.add_argument("--trace-dir", help="with --profile: write each way's Chrome trace here (.json.gz)")
    o = ap.parse_args(argv)
    o.only = set(o.only.split(","))
    if o.trace_dir and not o.profile:
        ap.error("--trace-dir needs --profile N")
    if o.trace_dir:
        os.makedirs(o.trace_dir, exist_ok=True)
    if not o.host_only and not torch.cuda.is_available():
        print("gpu bench: no CUDA device here; run with --host-only for the CPU proxy")
        return 2
    from toolkit.launcher import launch

    where = "CPU (host-only proxy, process CPU time, torch on 1 thread)" if o.host_only \
        else torch.cuda.get_device_name()
    print(f"{where}, torch {torch.__version__}; {o.rounds} rounds x {o.steps} steps after {o.warmup}", flush=True)
    rows = launch(_main_in_group, o, 1, device="cpu" if o.host_only else "cuda")
    failed = [r["case"] for r in rows if "error" in r]
    if failed:
        print(f"failed: {', '.join(failed)} (tracebacks above)")
    print(summary(rows))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
