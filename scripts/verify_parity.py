"""Train an MLP, a tiny GPT-2 and a tiny LLaMA (and Qwen2's kind) under many layouts; compare with one device.

    python scripts/verify_parity.py [--dtype float64|float32|both]

Each layout trains 3 AdamW steps (dropout 0 but in one layout) from the same
seed and the same batches as a single-device run in the same process. The
single-device run is independent: its own forward, backward and optimizer
step every step, never fed the distributed run's gradients. Compared, as the
max relative difference ``max|a-b| / max|b|`` per tensor: every step's loss
and every parameter's gradient, and every parameter after the last step.

Two modes (bars in ``TOLERANCE``: loss, gradients, final parameters).
``float64``: models and inputs in double precision, where the only
difference between the runs, the order of summation, is ~1e-16; Adam's
``g / (sqrt(v) + eps)`` can amplify it up to ``lr / (4 eps)``-fold (2.5e4
here) where a gradient is near ``eps``, so every bar is ``1e-9`` (measured:
at most ~2e-11). ``float32``: the same training in single precision, where
that amplification turns summation-order noise (~1e-7) into parameter
differences of ~1e-3 to 5e-3 after three steps, as large as those between the
float32 reference and the float64 one (the ``floor`` column: the one-device
float32 run against the one-device float64 run; its gradients after the
first step differ by up to ~2e-4); the bars are 1e-5 for the loss, 1e-3
for the gradients and 1e-2 for the parameters.

Layouts: data parallel on 2 and 4 ranks, Megatron tensor parallel on 2 and
4 ranks, data x tensor on a 2x2 mesh, the same with sequence-parallel
norm regions (GPT-2, LLaMA), a layout where the cost model chose every
activation layout from the weights' SBP alone, data x tensor with
dropout 0.1 (both runs draw from one RNG state), and context parallelism
(the sequence split, one sample per data shard: LLaMA cp2 and dp2 x cp2,
LLaMA cp2 with one head, whose attention runs query blocks against gathered
keys and values, and LLaMA and GPT-2 cp2 x tp2 with the sequence also split
over tp around their norms). Last line:
``parity: K/K layouts within their mode's bars``.
"""

from __future__ import annotations

import sys

from benchkit.parity import TOLERANCE, WORLD, layouts, run_layout


def main(argv=None):
    import argparse

    from toolkit.rank_pool import get_pool

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="both", choices=["float64", "float32", "both"])
    modes = ["float64", "float32"] if ap.parse_args(argv).dtype == "both" else [ap.parse_args(argv).dtype]
    pool = get_pool(WORLD)
    good = total = 0
    for dtype in modes:
        for name in layouts():
            res = [r for r in pool.run(run_layout, name, dtype) if r is not None]
            errs = [max(r[k] for r in res) for k in range(4)]
            ok = all(e <= bar for e, bar in zip(errs, TOLERANCE[dtype]))
            good, total = good + ok, total + 1
            floor = f"  (floor {errs[3]:.2e})" if dtype != "float64" else ""
            print(f"{dtype} {name:36s} loss {errs[0]:.2e}  grads {errs[1]:.2e}  params {errs[2]:.2e}{floor}  "
                  f"{'ok' if ok else 'FAIL'}")
    print(f"parity: {good}/{total} layouts within their mode's bars")
    return 0 if good == total else 1


if __name__ == "__main__":
    sys.exit(main())
