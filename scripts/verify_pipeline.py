"""Pipelined GPT-2 and LLaMA under pp2, pp4, dp2_pp2, tp2_pp2, dp2_tp2_pp2 and every schedule against one device.

    python scripts/verify_pipeline.py

Each layout trains 3 AdamW steps of a tiny GPT-2 (4 layers, dropout 0) with
8 micro-batches per step under 1F1B, in float64 and in float32; then, in
float64, each layout under interleaved 1F1B (2 and 3 stages per rank),
looped BFS (2 per rank), ZB-H1, interleaved zero bubble (2 and 3 per rank)
and ZB-V (with a layer per stage where the stages are more than 4: pp4 v2
8 layers, pp2 v3 6, pp4 v3 12); then, in float64, a tiny LLaMA (4 layers,
grouped-query attention) in every layout under 1F1B, untied and with its LM
head tied to the embedding, and tied under ZB-V (both copies on one rank)
and interleaved 1F1B (2 stages per rank); every run compares
with one device training on its own on the whole batch (its own forward,
backward and AdamW, never fed the pipeline's gradients): per step the loss
and every parameter's gradient, and every parameter after the last step
(max relative difference ``max|a-b| / max|b|``), against the bars of
``TOLERANCE`` (float64 1e-9; float32 as scripts/verify_parity.py states them). From each step's trace it prints, per stage, the most micro-batches
whose activations were held (bound: the rank's budget, ``stash_budget``:
``pp - s`` under 1F1B, ``m`` under GPipe) and the measured bubble next to
1F1B's theory ``(p-1)/(v m+p-1)``. Last line: ``pipeline parity: K/K
layouts within their precision's bars``.
"""

from __future__ import annotations

import sys

from benchkit.pipeline_parity import LAYOUTS, MICRO, TOLERANCE, WORLD, compare, run_pipeline, schedule_report
from runtime.pipeline.schedule import stash_budget
from runtime.pipeline.timeline import theory

SCHEDULES = (("1f1b", 2), ("1f1b", 3), ("looped_bfs", 2), ("zb", 1), ("zb", 2), ("zb", 3),
             ("zbv", 2))  # (pp_schedule, stages per rank)


def _layers(pp: int, v: int) -> int:
    """Four layers, or one per stage where the ``v * pp`` stages are more."""
    return max(4, pp * v)


def main():
    from toolkit.rank_pool import get_pool

    pool = get_pool(WORLD)
    good = total = 0
    for dtype in ("float64", "float32"):
        for name in LAYOUTS:
            errs = compare(pool.run(run_pipeline, name, dtype=dtype), dtype=dtype)
            ok = all(e <= bar for e, bar in zip(errs, TOLERANCE[dtype]))
            good, total = good + ok, total + 1
            print(f"{dtype} {name:12s} loss {errs[0]:.2e}  grads {errs[1]:.2e}  params {errs[2]:.2e}  "
                  f"{'ok' if ok else 'FAIL'}")
    for schedule, v in SCHEDULES:
        for name in LAYOUTS:
            n_layer = _layers(LAYOUTS[name][2], v)
            res = pool.run(run_pipeline, name, 3, schedule, MICRO, None, None, "float64", v, n_layer)
            errs = compare(res, dtype="float64", n_layer=n_layer)
            ok = all(e <= bar for e, bar in zip(errs, TOLERANCE["float64"]))
            good, total = good + ok, total + 1
            print(f"float64 {name:12s} {schedule:10s} v={v} loss {errs[0]:.2e}  grads {errs[1]:.2e}  "
                  f"params {errs[2]:.2e}  {'ok' if ok else 'FAIL'}")
    for model, schedule, v in (("llama", "1f1b", 1), ("llama-tied", "1f1b", 1), ("llama-tied", "zbv", 2),
                               ("llama-tied", "1f1b", 2)):
        for name in LAYOUTS:
            n_layer = _layers(LAYOUTS[name][2], v)
            res = pool.run(run_pipeline, name, 3, schedule, MICRO, None, None, "float64", v, n_layer, model)
            errs = compare(res, dtype="float64", n_layer=n_layer, model=model)
            ok = all(e <= bar for e, bar in zip(errs, TOLERANCE["float64"]))
            good, total = good + ok, total + 1
            print(f"float64 {model:10s} {name:12s} {schedule:10s} v={v} loss {errs[0]:.2e}  grads {errs[1]:.2e}  "
                  f"params {errs[2]:.2e}  {'ok' if ok else 'FAIL'}")
    for schedule, v in (("1f1b", 1), ("gpipe", 1), *SCHEDULES):
        name = "pp4"
        pp = LAYOUTS[name][2]
        n_layer = _layers(pp, v)
        held, bub = schedule_report(pool.run(run_pipeline, name, 2, schedule, MICRO, None, None, "float32", v,
                                             n_layer), pp, MICRO)
        bound = {s: stash_budget(schedule, pp, v, s, MICRO) for s in range(pp)}
        print(f"{name} {schedule} v={v}: held per rank {held} (budget {bound}); bubble "
              + ", ".join(f"s{s} {b:.2f}" for s, b in bub.items()) + f"; 1F1B's theory {theory(pp, MICRO, v):.2f}")
    print(f"pipeline parity: {good}/{total} layouts within their precision's bars")
    return 0 if good == total else 1


if __name__ == "__main__":
    sys.exit(main())
