"""Host memory to build a tensor-parallel GPT-2 on each rank: ours against DTensor, built whole and built on meta.

    python scripts/bench_build_memory.py [--model gpt2-medium] [--tp 4] [--rounds 2]

On ``--tp`` local gloo ranks (``toolkit.rank_pool``), each side builds the
model preset ``--model`` (``configs/model``) laid out by Megatron's tensor
parallel plan over all ranks, then drops it:

- ``ours``: ``GPT2Recipe.build_stage`` then ``sc.distribute_module`` with the
  recipe's plan, as the trainer does (parameters on the meta device until
  each rank builds its box with ``GPT2LMHeadModel.init_shard``);
- ``DTensor``: ``benchkit.dtensor_gpt.DTGPT2`` (the same GPT-2 with
  ``nn.Linear``) built whole with its values, then ``parallelize_module``
  (the usual DTensor path);
- ``DTensor-meta``: torchtitan's path, the model built on the meta device,
  ``parallelize_module``, ``to_empty`` on the CPU and an N(0, 0.02) init of
  every weight (``nn.init.normal_`` on the DTensors; on the CPU it draws
  each shard from the rank's own generator, so only its memory is
  comparable, not its values).

Each figure is C heap bytes in use (glibc's ``mallinfo2``, not distorted by
freed pages that glibc keeps, as resident memory is): ``held``, what the
rank holds once the model is built, and ``peak``, the most it held while
building (sampled every 0.2 ms, ``benchkit.heap.HeapPeak``), both above what
it held before; the worst rank of each side, the median over ``--rounds``
rounds, the sides in a balanced order (each round reverses the last). Last
line: ``build memory (peak per rank): ours X MiB, DTensor Y MiB (R.RRx), DTensor-meta Z MiB (S.SSx)``.
"""
from __future__ import annotations

import argparse
import gc
import statistics

SIDES = ("ours", "DTensor", "DTensor-meta")


def _build(side: str, model: str):
    """This rank's model of ``side``, laid out over every rank of the pool."""
    import torch
    import torch.distributed as dist

    from recipes.gpt2 import config
    from recipes.gpt2.model import GPT2Config
    from recipes.gpt2.recipe import RECIPE
    from toolkit.config.run_config import compose
    from toolkit.config.schema import typed

    n = dist.get_world_size()
    cfg = typed(compose([f"model={model}", f"parallel.tp={n}", "parallel.dp=1"]), RECIPE)
    torch.manual_seed(0)
    if side == "ours":
        import sbp_core as sc
        from toolkit.mesh import model_names, plan_for_module, stage_placements

        module = RECIPE.build_stage(cfg.model, lambda m: m)
        plan = plan_for_module(module, RECIPE.mesh_plan(cfg), model_names(module))  # as the trainer's
        return sc.distribute_module(module, stage_placements(1, n, 1, "cpu")[0], plan)
    from torch.distributed.device_mesh import init_device_mesh

    from benchkit.dtensor_gpt import DTGPT2, _dtensor_tp

    gpt = GPT2Config(**config.gpt2_config_kwargs(cfg.model))
    gpt.vocab_size = gpt.padded_vocab_size  # DTGPT2 has no padding mask; the same rows as ours
    mesh = init_device_mesh("cpu", (n,))
    if side == "DTensor":
        return _dtensor_tp(DTGPT2(gpt), mesh)
    import warnings

    warnings.filterwarnings("ignore", message="DTensor random operators may not have complete support")
    with torch.device("meta"):
        module = DTGPT2(gpt)
    _dtensor_tp(module, mesh)
    module.to_empty(device="cpu")
    module.lm_head.weight = module.wte.weight  # to_empty gives the tied pair two tensors
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif p.dim() == 1:
                p.fill_(1.0)
            else:
                torch.nn.init.normal_(p, 0.0, 0.02)
    return module


def measure(side: str, model: str) -> tuple:
    """On every rank: ``(held, peak)`` heap bytes above the start while ``side`` builds its model."""
    from benchkit.heap import HeapPeak, heap_bytes

    gc.collect()
    base = heap_bytes()
    sampler = HeapPeak()
    sampler.start()
    module = _build(side, model)
    peak = sampler.stop()
    held = heap_bytes()
    del module
    gc.collect()
    return held - base, peak - base


def main(argv=None) -> str:
    """Run the sides, print the table and return it."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="gpt2-medium")
    ap.add_argument("--tp", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args(argv)

    from toolkit.rank_pool import get_pool

    pool = get_pool(args.tp)
    pool.run(measure, "ours", args.model)  # imports and first-touch costs land outside the table
    got = {s: [] for s in SIDES}
    for r in range(args.rounds):
        for side in SIDES if r % 2 == 0 else SIDES[::-1]:
            ranks = pool.run(measure, side, args.model)
            got[side].append((max(h for h, _ in ranks), max(p for _, p in ranks)))
    mib = 2.0 ** 20
    held = {s: statistics.median(h for h, _ in got[s]) / mib for s in SIDES}
    peak = {s: statistics.median(p for _, p in got[s]) / mib for s in SIDES}
    lines = [f"{args.model}, tensor parallel over {args.tp} gloo ranks; heap MiB per rank above the start "
             f"(worst rank, median of {args.rounds} rounds)"]
    lines += [f"{s:14s} held {held[s]:8.0f}  peak {peak[s]:8.0f}  ours/this peak {peak['ours'] / peak[s]:.2f}x"
              for s in SIDES]
    lines.append(f"build memory (peak per rank): ours {peak['ours']:.0f} MiB, DTensor {peak['DTensor']:.0f} MiB "
                 f"({peak['ours'] / peak['DTensor']:.2f}x), DTensor-meta {peak['DTensor-meta']:.0f} MiB "
                 f"({peak['ours'] / peak['DTensor-meta']:.2f}x)")
    text = "\n".join(lines)
    print(text, flush=True)
    return text


if __name__ == "__main__":
    main()
