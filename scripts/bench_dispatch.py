"""Dispatch overhead of global tensors vs DTensor, and a 2-way tensor-parallel GPT-2 step.

    python scripts/bench_dispatch.py [--reps 200] [--inner 5] [--steps 15]

Runs on pools of local gloo ranks (CPU, one thread per rank).

**Per-op overhead.** A chain of common ops on small tensors (activations
``x`` 16x64, a 64x64 weight, a bias and LayerNorm affine of 64), each op timed
on its own, in two layouts: ``S0`` (``x`` split along rows, every other
input broadcast) and ``B`` (every input broadcast). Neither layout needs any
communication for these ops, so the time beyond plain torch is the cost of
dispatching. Ops run under ``torch.no_grad()`` (no autograd recording);
``linear`` is two aten ops (``t``, ``addmm``), ``matmul`` is ``mm``. On each
of 1 and 2 ranks, three implementations run the op:

- ``torch``: plain torch on the rank's local tensors (the same local shapes);
- ``ours``: ``sbp_core`` GlobalTensors (``sc.distribute``) in that layout;
- ``DTensor``: ``DTensor.from_local`` of the same locals on
  ``init_device_mesh("cpu", (n,))`` with ``Shard(0)``/``Replicate()``.

Before timing, each implementation's output shard is checked against plain
torch's. Then, after ``--warmup`` untimed calls of each (our decision cache is
hot), ``--reps`` blocks of ``--inner`` back-to-back calls are timed with
``time.perf_counter``; the implementations take turns block by block (the
order rotates), so a noisy machine slows them alike; blocks are short so
that the median skips the ones a preempted rank stretched. A rank's time per op is
the **median** over blocks; the reported time is the **max over ranks**.
Overhead = (time per op) - (plain torch time per op), in microseconds. The
table's ``ratio`` is ours/DTensor overhead. The summary ``dispatch overhead
vs DTensor`` is (sum of our overheads) / (sum of DTensor overheads) over all
ops, both layouts and both rank counts.

**TP step.** The tiny GPT-2 of ``scripts/verify_parity.py`` (``GPT_CFG``,
fp32, dropout 0), batch ``--batch`` x seq ``--seq`` tokens, forward +
backward + AdamW step + zero_grad, on 2 ranks:

- ``ours``: ``recipes.gpt2.model.GPT2LMHeadModel`` with
  ``sc.distribute_module(model, p, {**GPT_TP, **GPT_TP_PINS})`` (Megatron:
  column-parallel ``c_attn``/``c_fc``, row-parallel ``c_proj``s,
  vocab-parallel tied ``wte``/``lm_head`` with vocab-parallel cross-entropy);
  input ids ``B``.
- ``DTensor``: the same GPT-2 written here with ``nn.Linear`` (weights are
  the transposes of our ``Conv1D`` weights, copied from the same initial
  model, so both compute the same function), parallelised with
  ``parallelize_module``: ``ColwiseParallel`` on ``c_attn`` and ``c_fc``,
  ``RowwiseParallel`` on both ``c_proj``s, ``RowwiseParallel`` on ``wte``
  (vocab-parallel embedding), ``ColwiseParallel(output_layouts=Shard(-1))`` on
  ``lm_head`` with ``loss_parallel``; ``lm_head.weight`` is re-tied to the
  sharded ``wte.weight`` after parallelising (both ``Shard(0)``). As in
  torchtitan, the c_attn output is used as a local tensor
  (``use_local_output=True``) whose columns are grouped per head, exactly our
  model's order, so each rank views its own heads. Parameters outside the
  parallel modules (LayerNorms, ``wpe``) stay plain tensors in DTensor's
  idiom, while ours are ``B`` global tensors (every op on them dispatches).

Both steps take turns (barrier before each); each rank takes the median
over ``--steps`` steps after ``--tp-warmup`` untimed ones; the reported
time is the max over ranks. The warmup steps' losses of both are printed
(they agree to ~1e-7: the same math), and one extra untimed step of each
counts its collectives.

Last line: ``dispatch overhead vs DTensor: X.XXx; tp2 step vs DTensor:
Y.YYx`` (ours / DTensor; lower is better).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from benchkit.dtensor_gpt import HID, IMPLS, ROWS, op_worker, tp_worker


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=200, help="timed blocks per op and implementation")
    ap.add_argument("--inner", type=int, default=5, help="calls per timed block")
    ap.add_argument("--warmup", type=int, default=50, help="untimed calls per op and implementation")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--steps", type=int, default=15, help="timed TP steps per implementation")
    ap.add_argument("--tp-warmup", type=int, default=3, help="untimed TP steps per implementation")
    args = ap.parse_args(argv)

    from toolkit.rank_pool import get_pool

    started = time.perf_counter()
    print(f"per-op dispatch overhead (x {ROWS}x{HID} fp32; S0: x split on rows, weights B; B: all B), "
          f"median of {args.reps} blocks x {args.inner} calls, max over ranks")
    print(f"{'op':14s} {'layout':6s} {'ranks':>5s} {'torch us':>9s} {'ours ovh us':>12s} {'DTensor ovh us':>15s} {'ratio':>7s}")
    ours_total = dt_total = 0.0
    tp_rank = None
    for n in (1, 2):
        pool = get_pool(n, timeout=300.0)
        try:
            per_rank = pool.run(op_worker, args.reps, args.inner, args.warmup)
            if n == 2:  # reuse the 2-rank pool for the TP step
                tp_rank = pool.run(tp_worker, args.batch, args.seq, args.steps, args.tp_warmup)
        finally:
            pool.close()
        sub_ours = sub_dt = 0.0
        for i, (name, layout, _) in enumerate(per_rank[0]):
            t = {impl: max(r[i][2][impl] for r in per_rank) for impl in IMPLS}
            ours_ovh, dt_ovh = t["ours"] - t["torch"], t["dtensor"] - t["torch"]
            sub_ours += ours_ovh
            sub_dt += dt_ovh
            ratio = f"{ours_ovh / dt_ovh:6.2f}x" if dt_ovh > 0 else "    n/a"
            print(f"{name:14s} {layout:6s} {n:5d} {t['torch']:9.1f} {ours_ovh:12.1f} {dt_ovh:15.1f} {ratio:>7s}")
        print(f"{'sum':14s} {'':6s} {n:5d} {'':9s} {sub_ours:12.1f} {sub_dt:15.1f} {sub_ours / sub_dt:6.2f}x")
        ours_total += sub_ours
        dt_total += sub_dt
    dispatch_ratio = ours_total / dt_total
    print(f"{'sum':14s} {'':6s} {'1+2':>5s} {'':9s} {ours_total:12.1f} {dt_total:15.1f} {dispatch_ratio:6.2f}x")
    print("(DTensor dispatches through a C++ fast path with a C++ sharding cache; ours is Python __torch_dispatch__)")

    per_rank = tp_rank
    med = {impl: max(statistics.median(r["times"][impl]) for r in per_rank) * 1e3 for impl in ("ours", "dtensor")}
    lo, ld = per_rank[0]["losses"]["ours"], per_rank[0]["losses"]["dtensor"]
    loss_diff = max(abs(a - b) / abs(b) for a, b in zip(lo, ld))
    step_ratio = med["ours"] / med["dtensor"]
    print()
    print(f"GPT-2 tp2 step: {per_rank[0]['params']} params, batch {args.batch} x seq {args.seq}, fp32, "
          f"fwd+bwd+AdamW, median of {args.steps} steps after {args.tp_warmup}, max over 2 ranks")
    print("  ours: Megatron plan GPT_TP + GPT_TP_PINS; LayerNorm/wpe params are B global tensors")
    print("  DTensor: parallelize_module Colwise(c_attn, c_fc, lm_head)/Rowwise(c_proj, wte) + loss_parallel; "
          "LayerNorm/wpe params plain tensors")
    print(f"  warmup losses ours    {', '.join(f'{v:.6f}' for v in lo)}")
    print(f"  warmup losses DTensor {', '.join(f'{v:.6f}' for v in ld)}  (max rel diff {loss_diff:.1e})")
    coll = per_rank[0]["collectives"]
    print(f"  collectives per step (rank 0): ours {coll['ours']}, DTensor {coll['dtensor']}")
    print(f"  {'ours ms':>9s} {'DTensor ms':>11s} {'ratio':>7s}")
    print(f"  {med['ours']:9.2f} {med['dtensor']:11.2f} {step_ratio:6.2f}x")
    print(f"(total {time.perf_counter() - started:.0f} s)")
    print(f"dispatch overhead vs DTensor: {dispatch_ratio:.2f}x; tp2 step vs DTensor: {step_ratio:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
