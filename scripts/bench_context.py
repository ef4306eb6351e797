"""Context parallelism: what one long sequence costs each rank when ``parallel.cp`` splits it.

``python scripts/bench_context.py [--seq 4096] [--cp 2,4] [--rounds 3]``

A LLaMA (grouped-query attention) reads one sample of ``--seq`` tokens,
fp32, forward and backward, on one device and split over ``cp`` ranks as the
trainer lays it out (``toolkit.mesh.context_plan`` of the recipe's plan:
parameters ``B`` on the cp axis, the batch and the residual stream split on
the sequence; attention and the loss take whatever layout the dispatcher
finds cheapest). Per side, on the worst rank, the median over ``--rounds``
rounds in a balanced order:

- **memory**: the C heap's peak during the step above what it held before
  (``benchkit.heap``: activations, gradients and what the step allocates);
- **time**: the step's wall time (two cores shared by every rank on this VM:
  read it as the cost of the collectives, not as a speed-up);
- **bytes**: what the rank sends in the step (``sc.comm_ledger``), the
  gradients' reduction over cp included.

Every side's loss must equal one device's within 1e-5 (relative), or the
script exits with 1. torch's own ``context_parallel``
(``torch.distributed.tensor.experimental``) handles the CUDA attention
kernels only, so on a CPU host there is no peer to run beside ours. Last
line: ``context: cp2 A.AAx memory, B.Bx time; cp4 ...`` (of one device's).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit("/scripts/", 1)[0])

import sbp_core as sc  # noqa: E402
from benchkit.heap import HeapPeak, heap_bytes  # noqa: E402
from sbp_core.sbp import Broadcast, Split  # noqa: E402
from toolkit.mesh import context_plan, stage_ranks, with_context  # noqa: E402
from toolkit.rank_pool import get_pool  # noqa: E402


def build(seq: int):
    from recipes.llama.model import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=2048, hidden_size=256, intermediate_size=688, num_hidden_layers=2,
                                        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=seq))


def _side(cp: int, seq: int, ids: torch.Tensor):
    """``(loss, heap peak above the start, seconds, bytes sent)`` of one step on this rank, or ``None`` off the
    side's ranks. Every rank builds the side's placement (a collective over the world)."""
    from recipes.llama.plan import mesh_plan

    model = build(seq)
    p = sc.placement("cpu", stage_ranks(1, 1, 1, cp)[0]) if cp > 1 else None
    me = torch.distributed.get_rank()
    if cp == 1 and me != 0 or cp > 1 and me not in p:
        return None
    x = ids
    if p is not None:
        sc.distribute_module(model, p, context_plan(mesh_plan(), cp, 1))
        x = sc.distribute(ids, p, with_context((Split(0), Broadcast()), cp, 1))
    peak = HeapPeak()
    before = heap_bytes()
    with sc.comm_ledger() as ledger:
        peak.start()
        t0 = time.perf_counter()
        loss = model(x, x)[1]
        loss.backward()
        seconds = time.perf_counter() - t0
        top = peak.stop()
    value = float((loss.full_tensor() if p is not None else loss).detach())
    return value, max(top - before, 0), seconds, ledger.bytes


def _round(sides: list, seq: int):
    ids = torch.randint(0, 2048, (1, seq), generator=torch.Generator().manual_seed(1))
    return {cp: _side(cp, seq, ids) for cp in sides}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--cp", default="2,4", help="context-parallel degrees, comma-separated")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    cps = [int(c) for c in args.cp.split(",")]
    if any(c < 2 or args.seq % c for c in cps):
        ap.error(f"--cp {args.cp}: each degree >= 2 and dividing --seq {args.seq}")
    pool = get_pool(max(cps))
    rows: dict = {c: [] for c in [1, *cps]}
    for r in range(args.rounds):
        order = [1, *cps] if r % 2 == 0 else [1, *cps][::-1]
        per_rank = pool.run(_round, order, args.seq)
        for c in order:
            got = [x[c] for x in per_rank if x[c] is not None]
            rows[c].append((got[0][0], max(g[1] for g in got), max(g[2] for g in got), max(g[3] for g in got)))
    ref = rows[1][0][0]
    bad = [c for c in cps if any(abs(x[0] - ref) > 1e-5 * abs(ref) for x in rows[c])]
    print(f"one sample of {args.seq} tokens, LLaMA 2 x 256 (8 heads, 4 key/value), fp32; worst rank, median of "
          f"{args.rounds} rounds")
    print(f"{'side':>6} {'loss':>10} {'memory MiB':>11} {'time ms':>8} {'sent MiB':>9}")
    med = {}
    for c, xs in rows.items():
        med[c] = [statistics.median(x[i] for x in xs) for i in (1, 2, 3)]
        print(f"{'one' if c == 1 else f'cp{c}':>6} {xs[0][0]:>10.6f} {med[c][0] / 2**20:>11.1f} {med[c][1] * 1e3:>8.1f} "
              f"{med[c][2] / 2**20:>9.2f}")
    if bad:
        print(f"context: cp{bad[0]}'s loss differs from one device's ({rows[bad[0]][0][0]} vs {ref})")
        return 1
    print("context: " + "; ".join(f"cp{c} {med[c][0] / med[1][0]:.2f}x memory, {med[c][1] / med[1][1]:.1f}x time"
                                  for c in cps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
