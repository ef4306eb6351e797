"""Every recipe on one GPU: correct first, then how fast.

    python scripts/gpu_check.py             # one CUDA device; exits 2 where there is none

For GPT-2 124M (bf16, micro-batch 8 x 1024), iresnet50 at 112x112 (bf16,
1000 classes, batch 128, SGD), Wide&Deep at its default size (fp32,
batch 512) and a LLaMA of GPT-2 small's depth and width (12 layers, 768
wide, 12 query and 4 key/value heads, 32000 tokens; bf16, micro-batch
8 x 1024), in this process:

1. ours: ``toolkit.trainer.train`` as ``python train.py ... device=cuda``
   runs it (a one-rank process group, the runtime's data pipeline and
   copy stream), logging every step;
2. plain: ``toolkit.plain_loop.PlainLoop``, the same model class from the
   same seed (so the same initial weights), the same batches
   (``MicroBatches.load``, the rows ours reads, copied to the device before
   the first step), the recipe's optimizer and
   LR schedule, the same autocast and clipping, in a plain PyTorch loop;
3. the first ``--compare`` losses must agree within the precision's
   tolerance (bf16: 2e-2 relative; fp32: 1e-4), else the recipe fails.

It prints a table (losses, the largest relative difference, ours' and the
plain loop's throughput after the first step, ours' MFU) and a last line
``gpu check: gpt2 ok, insightface ok, wide_deep ok, llama ok; mfu X%`` (GPT-2's MFU).
Exit status 0 when every recipe agreed, 1 otherwise, 2 without a GPU; a
recipe whose check raises prints its traceback, fails, and the next one runs.
``--device cpu --tiny`` runs the same check with tiny models on the CPU
(what the test suite does).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import traceback

import torch


from recipes.registry import get
from toolkit.config import compose, validate
from toolkit.launcher import launch
from toolkit.plain_loop import PlainLoop
from toolkit.trainer import train

COMMON = ["logger=none", "trainer.log_every=1", "trainer.eval_every=0", "trainer.save_every=0",
          "trainer.warmup_steps=2"]
FULL = {
    "gpt2": ["recipe=gpt2", "model=gpt2", "trainer.precision=bf16", "trainer.micro_batch_size=8",
             "trainer.global_batch_size=8", "data.max_bytes=2000000"],
    "insightface": ["recipe=insightface", "model=iresnet50", "trainer.precision=bf16", "model.num_classes=1000",
                    "trainer.micro_batch_size=128", "trainer.global_batch_size=128",
                    "data.synthetic.images_per_identity=4"],
    "wide_deep": ["recipe=wide_deep", "model.dropout=0.0"],
    "llama": ["recipe=llama", "model.num_hidden_layers=12", "model.hidden_size=768", "model.intermediate_size=2048",
              "model.num_attention_heads=12", "model.num_key_value_heads=4", "model.vocab_size=32000",
              "model.max_position_embeddings=1024", "trainer.precision=bf16", "trainer.micro_batch_size=8",
              "trainer.global_batch_size=8", "data.max_bytes=2000000"],
}
TINY = {
    "gpt2": ["recipe=gpt2", "model.n_layer=2", "model.n_embd=64", "model.n_head=4", "model.vocab_size=512",
             "model.n_positions=64", "data.max_bytes=200000", "trainer.micro_batch_size=4",
             "trainer.global_batch_size=8"],
    "insightface": ["recipe=insightface", "trainer.micro_batch_size=16", "trainer.global_batch_size=32",
                    "data.synthetic.images_per_identity=4"],
    "wide_deep": ["recipe=wide_deep", "model=wide-deep-tiny", "trainer.micro_batch_size=64",
                  "trainer.global_batch_size=128", "data.train_rows=20000", "data.val_rows=1000"],
    "llama": ["recipe=llama", "model.num_hidden_layers=2", "model.hidden_size=64", "model.intermediate_size=96",
              "model.num_attention_heads=4", "model.num_key_value_heads=2", "model.vocab_size=512",
              "model.max_position_embeddings=64", "data.max_bytes=200000", "trainer.micro_batch_size=4",
              "trainer.global_batch_size=8"],
}
TOLERANCE = {"bf16": 2e-2, "fp16": 2e-2, "fp32": 1e-4}


def _rank_main(cfg):
    return train(cfg, get(cfg.recipe.name))


def ours(cfg, device: str) -> list:
    """Our trainer's per-step rows (``metrics.jsonl``) for ``cfg`` on one device."""
    from toolkit.metrics import read_metrics

    launch(_rank_main, cfg, 1, device=device)
    return [r for r in read_metrics(cfg.run_dir) if "loss" in r]


def plain(cfg, device: str) -> tuple:
    """``(losses, seconds per step)`` of ``toolkit.plain_loop.PlainLoop`` on ``cfg``, reading the loss every step,
    its batches on the device before the first (ours reads ahead while the device works)."""
    loop = PlainLoop(cfg, get(cfg.recipe.name), device, preload=int(cfg.trainer.max_steps))
    losses, seconds = [], []
    for step in range(int(loop.cfg.trainer.max_steps)):
        start = time.perf_counter()
        losses.append(float(loop.step(step)))  # the host reads the loss every step, as ours logs it every step
        seconds.append(time.perf_counter() - start)
    return losses, seconds


def check(name: str, overrides: list, device: str, steps: int, compare: int, root: str) -> dict:
    run_dir = os.path.join(root, name)
    cfg = compose([*overrides, *COMMON, f"trainer.max_steps={steps}", f"device={device}"], run_dir=run_dir)
    recipe = get(cfg.recipe.name)
    lay = validate(cfg, recipe)
    rows = ours(cfg, device)
    plain_losses, plain_seconds = plain(cfg, device)
    ours_losses = [r["loss"] for r in rows]
    tol = TOLERANCE[str(cfg.trainer.precision)]
    diff = max(abs(a - b) / abs(b) for a, b in zip(ours_losses[:compare], plain_losses[:compare]))
    unit = f"{recipe.throughput_unit}_per_s"
    items = lay.items_per_step
    later = rows[1:] or rows
    mfu = [r["mfu"] for r in later if r.get("mfu") is not None]
    return {
        "recipe": name, "precision": str(cfg.trainer.precision), "ours": ours_losses[:compare],
        "plain": plain_losses[:compare], "diff": diff, "tol": tol,
        "ok": len(ours_losses) >= compare and diff <= tol, "unit": recipe.throughput_unit,
        "ours_rate": statistics.median(r[unit] for r in later),
        "plain_rate": items / statistics.median(plain_seconds[1:] or plain_seconds),
        "mfu": statistics.median(mfu) if mfu else None,
    }


def _table(results: list) -> str:
    lines = [f"{'recipe':12s} {'prec':5s} {'ours losses':28s} {'plain losses':28s} {'max rel':>8s} "
             f"{'ours/s':>12s} {'plain/s':>12s} {'ratio':>6s} {'mfu':>6s}"]
    for r in results:
        if "error" in r:
            lines.append(f"{r['recipe']:12s} FAIL: {r['error']}")
            continue
        fmt = " ".join(f"{x:.4f}" for x in r["ours"])
        pfmt = " ".join(f"{x:.4f}" for x in r["plain"])
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "-"
        lines.append(f"{r['recipe']:12s} {r['precision']:5s} {fmt:28s} {pfmt:28s} {r['diff']:8.1e} "
                     f"{r['ours_rate']:12,.0f} {r['plain_rate']:12,.0f} {r['ours_rate'] / r['plain_rate']:6.2f} "
                     f"{mfu:>6s}  {r['unit']}/s{'' if r['ok'] else '  FAIL (tolerance ' + format(r['tol'], 'g') + ')'}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--tiny", action="store_true", help="tiny models (a CPU check of the check itself)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--compare", type=int, default=3, help="leading losses that must agree")
    ap.add_argument("--recipes", default="gpt2,insightface,wide_deep,llama")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu check: no CUDA device here (torch.cuda.is_available() is False); nothing was run")
        return 2
    if args.steps < args.compare:
        ap.error(f"--steps {args.steps} must be >= --compare {args.compare}")
    if args.device == "cuda":
        print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    sets = TINY if args.tiny else FULL
    results = []
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as root:
        for name in args.recipes.split(","):
            if name not in sets:
                ap.error(f"--recipes: unknown {name!r}; valid: {', '.join(sets)}")
            start = time.perf_counter()
            try:
                results.append(check(name, sets[name], args.device, args.steps, args.compare, root))
            except Exception as e:  # the next recipes still run: one GPU session gives one try
                traceback.print_exc()
                results.append({"recipe": name, "ok": False, "error": f"{type(e).__name__}: {e}"})
            row = _table(results[-1:]).splitlines()[-1]  # each as it comes: a run cut short keeps the rows so far
            print(f"{name}: checked in {time.perf_counter() - start:.0f} s: {row}", flush=True)
    print(_table(results))
    gpt2 = next((r for r in results if r["recipe"] == "gpt2"), None)
    mfu = f"{gpt2['mfu']:.1%}" if gpt2 is not None and gpt2.get("mfu") is not None else "-"
    print("gpu check: " + ", ".join(f"{r['recipe']} {'ok' if r['ok'] else 'FAIL'}" for r in results)
          + f"; mfu {mfu}")
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
