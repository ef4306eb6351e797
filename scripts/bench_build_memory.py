"""Host memory to build a tensor-parallel GPT-2 on each rank: ours against DTensor, built whole and built on meta.

    python scripts/bench_build_memory.py [--model gpt2-medium] [--tp 4] [--rounds 2]
    python scripts/bench_build_memory.py --zero3 [--model gpt2-medium] [--tp 4]   # ZeRO-3 over the ranks

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

With ``--zero3`` the ``--tp`` ranks are data-parallel instead, the model
sharded ZeRO-3 style over them:

- ``ours``: ``build_stage`` then ``apply_zero(stage=3)`` with the recipe's
  plan, as the trainer does for ``parallel.zero=3`` (a parameter on the meta
  device is built straight into its master layout: each rank draws its
  slice);
- ``FSDP2-meta``: torchtitan's path, the model built on the meta device,
  ``fully_shard`` on every block and the root, ``to_empty`` on the CPU and
  the same N(0, 0.02) init of every weight (each shard from the rank's own
  generator, so, again, only its memory is comparable).

Each figure is C heap bytes in use (glibc's ``mallinfo2``, not distorted by
freed pages that glibc keeps, as resident memory is): ``held``, what the
rank holds once the model is built, and ``peak``, the most it held while
building (sampled every 0.2 ms, ``benchkit.heap.HeapPeak``), both above what
it held before; the worst rank of each side, the median over ``--rounds``
rounds, the sides in a balanced order (each round reverses the last). Last
line: ``build memory (peak per rank): ours X MiB, DTensor Y MiB (R.RRx), DTensor-meta Z MiB (S.SSx)``, or
with ``--zero3`` ``build memory, ZeRO-3 (peak per rank): ours X MiB, FSDP2-meta Y MiB (R.RRx)``.
"""
from __future__ import annotations

import argparse
import gc
import statistics

SIDES = ("ours", "DTensor", "DTensor-meta")
ZERO3_SIDES = ("ours", "FSDP2-meta")


def _init_like_gpt2(module) -> None:
    """N(0, 0.02) weights, zero biases, unit norms: GPT-2's initialisation, in place, on whatever tensors
    ``module`` holds (DTensors included)."""
    import torch

    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif p.dim() == 1:
                p.fill_(1.0)
            else:
                torch.nn.init.normal_(p, 0.0, 0.02)


def _build_zero3(side: str, model: str):
    """This rank's ZeRO-3 (or FSDP2) model of ``side``, sharded over every rank of the pool."""
    import torch
    import torch.distributed as dist

    from recipes.gpt2.recipe import RECIPE
    from toolkit.config.run_config import compose
    from toolkit.config.schema import typed

    n = dist.get_world_size()
    cfg = typed(compose([f"model={model}", f"parallel.dp={n}", "parallel.tp=1", "parallel.zero=3"]), RECIPE)
    torch.manual_seed(0)
    if side == "ours":
        from toolkit.mesh import model_names, plan_for_module, stage_placements
        from toolkit.zero.apply import apply_zero

        module = RECIPE.build_stage(cfg.model, lambda m: m)
        plan = plan_for_module(module, RECIPE.mesh_plan(cfg), model_names(module))  # as the trainer's
        return apply_zero(module, stage_placements(n, 1, 1, "cpu")[0], plan, stage=3)
    import warnings

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    warnings.filterwarnings("ignore", message="DTensor random operators may not have complete support")
    mesh = init_device_mesh("cpu", (n,))
    with torch.device("meta"):
        module = RECIPE.build_model(cfg.model)
    for block in module.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(module, mesh=mesh)
    module.to_empty(device="cpu")
    _init_like_gpt2(module)
    return module


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
    _init_like_gpt2(module)
    return module


def measure(side: str, model: str, zero3: bool = False) -> tuple:
    """On every rank: ``(held, peak)`` heap bytes above the start while ``side`` builds its model."""
    from benchkit.heap import HeapPeak, heap_bytes

    gc.collect()
    base = heap_bytes()
    sampler = HeapPeak()
    sampler.start()
    module = (_build_zero3 if zero3 else _build)(side, model)
    peak = sampler.stop()
    held = heap_bytes()
    del module
    gc.collect()
    return held - base, peak - base


def main(argv=None) -> str:
    """Run the sides, print the table and return it."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="gpt2-medium")
    ap.add_argument("--tp", type=int, default=4, help="ranks (data-parallel ones with --zero3)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--zero3", action="store_true", help="ZeRO-3 over the ranks against FSDP2 (see above)")
    args = ap.parse_args(argv)

    from toolkit.rank_pool import get_pool

    sides = ZERO3_SIDES if args.zero3 else SIDES
    pool = get_pool(args.tp)
    for side in sides:  # imports and first-touch costs land outside the table, for every side
        pool.run(measure, side, args.model, args.zero3)
    got = {s: [] for s in sides}
    for r in range(args.rounds):
        for side in sides if r % 2 == 0 else sides[::-1]:
            ranks = pool.run(measure, side, args.model, args.zero3)
            got[side].append((max(h for h, _ in ranks), max(p for _, p in ranks)))
    mib = 2.0 ** 20
    held = {s: statistics.median(h for h, _ in got[s]) / mib for s in sides}
    peak = {s: statistics.median(p for _, p in got[s]) / mib for s in sides}
    how = f"ZeRO-3 over {args.tp}" if args.zero3 else f"tensor parallel over {args.tp}"
    lines = [f"{args.model}, {how} gloo ranks; heap MiB per rank above the start "
             f"(worst rank, median of {args.rounds} rounds)"]
    lines += [f"{s:14s} held {held[s]:8.0f}  peak {peak[s]:8.0f}  ours/this peak {peak['ours'] / peak[s]:.2f}x"
              for s in sides]
    if args.zero3:
        lines.append(f"build memory, ZeRO-3 (peak per rank): ours {peak['ours']:.0f} MiB, FSDP2-meta "
                     f"{peak['FSDP2-meta']:.0f} MiB ({peak['ours'] / peak['FSDP2-meta']:.2f}x)")
    else:
        lines.append(f"build memory (peak per rank): ours {peak['ours']:.0f} MiB, DTensor {peak['DTensor']:.0f} MiB "
                     f"({peak['ours'] / peak['DTensor']:.2f}x), DTensor-meta {peak['DTensor-meta']:.0f} MiB "
                     f"({peak['ours'] / peak['DTensor-meta']:.2f}x)")
    text = "\n".join(lines)
    print(text, flush=True)
    return text


if __name__ == "__main__":
    main()
