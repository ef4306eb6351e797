"""Pipelined GPT-2 under pp2, pp4, dp2_pp2, tp2_pp2, dp2_tp2_pp2 against one device.

    python scripts/verify_pipeline.py

Each layout trains 3 AdamW steps of a tiny GPT-2 (4 layers, dropout 0) with
8 micro-batches per step under 1F1B, in float64 and in float32, and compares
with one device training on its own on the whole batch (its own forward,
backward and AdamW, never fed the pipeline's gradients): per step the loss
and every parameter's gradient, and every parameter after the last step
(max relative difference ``max|a-b| / max|b|``), against the bars of
``TOLERANCE`` (float64 1e-9; float32 as scripts/verify_parity.py states them). From each step's trace it prints, per stage, the most micro-batches
whose activations were held (bound: ``pp - s`` under 1F1B, ``m`` under
GPipe) and the measured bubble next to the theory ``(p-1)/(m+p-1)``. Last
line: ``pipeline parity: K/K layouts within their precision's bars``.
"""

from __future__ import annotations

import sys

from benchkit.pipeline_parity import LAYOUTS, MICRO, TOLERANCE, WORLD, compare, run_pipeline, schedule_report
from runtime.pipeline.timeline import theory


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
    for name, schedule in (("pp4", "1f1b"), ("pp4", "gpipe")):
        dp, tp, pp = LAYOUTS[name]
        held, bub = schedule_report(pool.run(run_pipeline, name, 2, schedule), pp, MICRO)
        bound = {s: (pp - s if schedule == "1f1b" else MICRO) for s in range(pp)}
        print(f"{name} {schedule}: held per stage {held} (bound {bound}); bubble "
              + ", ".join(f"s{s} {b:.2f}" for s, b in bub.items()) + f"; theory {theory(pp, MICRO):.2f}")
    print(f"pipeline parity: {good}/{total} layouts within their precision's bars")
    return 0 if good == total else 1


if __name__ == "__main__":
    sys.exit(main())
