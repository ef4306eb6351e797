"""One-device pipeline stages on plain tensors against the dispatched path and ``Schedule1F1B``, in one process tree.

    python scripts/bench_one_device.py [bench_pipeline.py's options, e.g. --steps 8]

On ``--pp`` ranks, ``bench_pipeline.py``'s GPT-2 split (same options, same
defaults) trains under three variants that live on the same ranks for the
whole run: ``local``, our 1F1B as the trainer runs it (every stage's
placement is one device, so ``sc.runs_local`` holds and each stage runs its
micro-batches on plain tensors, ``sc.LocalParameters``); ``dispatched``,
the same with the stages' ``LocalParameters`` removed, so every op goes
through ``GlobalTensor.__torch_dispatch__``;
``torch``, ``Schedule1F1B``. After two untimed steps each, ``--steps``
steps of each run round-robin (the order rotates every round); a step's
wall and process CPU time are the max over ranks, a variant's the median
over its steps. CPU time is the figure to read on a shared machine.

Last line: ``cpu: local A ms, dispatched B ms, torch C ms; torch/local X.XXx, torch/dispatched
Y.YYx, dispatched/local Z.ZZx`` (above 1, the first named is slower).
"""
from __future__ import annotations

import statistics
import time

import torch.distributed as dist

from benchkit.pipeline_peers import Ours, Theirs, parse

VARIANTS = ("local", "dispatched", "torch")


def worker(o):
    tied = dist.new_group([0, o.pp - 1])
    variants = {"local": Ours(o, "1f1b"), "dispatched": Ours(o, "1f1b"), "torch": Theirs(o, "1f1b", tied)}
    variants["dispatched"].step_._shards = None  # no LocalParameters: every op dispatched
    for v in variants.values():
        for i in range(2):
            v.step(i)
    wall, cpu = {n: [] for n in VARIANTS}, {n: [] for n in VARIANTS}
    for k in range(o.steps):
        for name in VARIANTS[k % 3:] + VARIANTS[:k % 3]:
            dist.barrier()
            t, c = time.perf_counter(), time.process_time()
            variants[name].step(2 + k)
            wall[name].append(time.perf_counter() - t)
            cpu[name].append(time.process_time() - c)
    return wall, cpu


def main(argv=None) -> str:
    from toolkit.rank_pool import get_pool

    o = parse(argv, __doc__.split("\n")[0])
    res = get_pool(o.pp, timeout=120.0).run(worker, o, call_timeout=900.0)
    lines = [f"GPT-2 {o.layers} layers x {o.embd}, pp={o.pp}, m={o.micro}, 1F1B; {o.steps} timed steps after 2"]
    for kind, i in (("wall", 0), ("cpu", 1)):
        med = {n: statistics.median(max(r[i][n][k] for r in res) for k in range(o.steps)) for n in VARIANTS}
        lines.append(f"{kind}: " + ", ".join(f"{n} {med[n] * 1e3:.0f} ms" for n in VARIANTS) +
                     f"; torch/local {med['torch'] / med['local']:.2f}x, torch/dispatched "
                     f"{med['torch'] / med['dispatched']:.2f}x, dispatched/local {med['dispatched'] / med['local']:.2f}x")
    text = "\n".join(lines)
    print(text, flush=True)
    return text


if __name__ == "__main__":
    main()
