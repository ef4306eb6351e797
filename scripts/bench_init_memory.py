"""Host memory to start a tensor-parallel LLaMA from a Hugging Face directory: ours against DTensor's two ways.

    python scripts/bench_init_memory.py [--tp 4] [--rounds 2] [--layers 8] [--hidden 1024]
    python scripts/bench_init_memory.py --zero3 [--tp 4]     # ZeRO-3 (FSDP2) over the ranks instead

A LLaMA of ``--layers`` x ``--hidden`` (``--hidden / 64`` query heads, a
quarter of them key/value heads, a SwiGLU MLP 2.75 times as wide, 32000
tokens) is written once, in bf16, as a Hugging Face directory
(``config.json`` + ``model.safetensors``). On ``--tp`` local gloo ranks
(``toolkit.rank_pool``) each side then loads it in fp32, laid out by tensor
parallelism over all ranks, and drops it:

- ``ours``: what ``trainer.init_from=<the directory>`` runs:
  ``LlamaRecipe.build_stage`` (parameters on the meta device),
  ``init_weights`` and ``sc.distribute_module`` with the recipe's plan; each
  rank reads the boxes it keeps (``recipes.llama.hf.ShardReader``);
- ``from_pretrained``: ``transformers.LlamaForCausalLM.from_pretrained`` in
  fp32 on every rank, then DTensor's ``parallelize_module`` with
  torchtitan's Llama plan (``benchkit.llama_tp``): the usual path of a
  Hugging Face user;
- ``DCP``: torchtitan's path: the model built on the meta device,
  ``parallelize_module``, ``to_empty``, then
  ``torch.distributed.checkpoint.load`` with its
  ``HuggingFaceStorageReader``.

With ``--zero3`` the ranks are data-parallel, the model sharded ZeRO-3
style: ours by ``apply_zero(stage=3)`` (``parallel.zero=3``: each rank reads
its slice of the masters), the peers by FSDP2's ``fully_shard`` on every
layer and the root in place of ``parallelize_module``.

Each side's parameters, gathered whole afterwards, must equal the file's
(the run fails otherwise). Each figure is C heap bytes in use
(``benchkit.heap``: ``held`` once loaded, ``peak`` while loading, both
above the start; the file's pages, mapped and shared by the ranks, are not
heap); the worst rank of each side, the median over ``--rounds`` rounds,
the sides in a balanced order. Last line: ``init memory (peak per rank):
ours X MiB, from_pretrained Y MiB (R.RRx), DCP Z MiB (S.SSx)`` (``init memory, ZeRO-3 (peak per rank):
...`` with ``--zero3``).
"""
from __future__ import annotations

import argparse
import gc
import statistics
import tempfile

SIDES = ("ours", "from_pretrained", "DCP")


def dims(layers: int, hidden: int) -> dict:
    heads = hidden // 64
    return dict(vocab_size=32000, hidden_size=hidden, intermediate_size=hidden * 11 // 4, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=max(1, heads // 4), max_position_embeddings=2048,
                rms_norm_eps=1e-5)


def write_hf(path: str, model_dims: dict) -> None:
    """A bf16 ``LlamaForCausalLM`` directory of ``model_dims`` at ``path`` (our model's seeded values)."""
    import torch

    from recipes.gpt2.hf import write_hf_dir
    from recipes.llama.hf import hf_config
    from recipes.llama.model import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(**model_dims)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    write_hf_dir(path, {**hf_config(dict(cfg.__dict__)), "dtype": "bfloat16"}, model.state_dict())


def _fsdp2(model, mesh):
    """FSDP2's ZeRO-3: ``fully_shard`` on every decoder layer, then the root (torchtitan's wrapping)."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _load(side: str, path: str, model_dims: dict, zero3: bool = False):
    """This rank's model of ``side``, loaded from ``path`` and laid out over every rank of the pool."""
    import torch
    import torch.distributed as dist

    n = dist.get_world_size()
    if side == "ours" and zero3:
        from recipes.llama.recipe import RECIPE
        from toolkit.config.run_config import compose
        from toolkit.config.schema import typed
        from toolkit.mesh import model_names, plan_for_module, stage_placements
        from toolkit.zero.apply import apply_zero

        cfg = typed(compose(["recipe=llama", *(f"model.{k}={v}" for k, v in model_dims.items()),
                             f"trainer.init_from={path}", f"parallel.dp={n}", "parallel.tp=1", "parallel.zero=3"]),
                    RECIPE)
        module = RECIPE.build_stage(cfg.model, lambda m: m)
        assert RECIPE.init_weights(module, path, cfg)
        plan = plan_for_module(module, RECIPE.mesh_plan(cfg), model_names(module))  # as the trainer's
        module, _ = apply_zero(module, stage_placements(n, 1, 1, "cpu")[0], plan, stage=3)
        module.__dict__.pop("init_shard", None)  # as the trainer drops the reader
        return module
    if side == "ours":
        import sbp_core as sc
        from recipes.llama.recipe import RECIPE
        from toolkit.config.run_config import compose
        from toolkit.config.schema import typed
        from toolkit.mesh import model_names, plan_for_module, stage_placements

        cfg = typed(compose(["recipe=llama", *(f"model.{k}={v}" for k, v in model_dims.items()),
                             f"trainer.init_from={path}", f"parallel.tp={n}", "parallel.dp=1"]), RECIPE)
        module = RECIPE.build_stage(cfg.model, lambda m: m)
        assert RECIPE.init_weights(module, path, cfg)
        plan = plan_for_module(module, RECIPE.mesh_plan(cfg), model_names(module))  # as the trainer's
        module = sc.distribute_module(module, stage_placements(1, n, 1, "cpu")[0], plan)
        module.__dict__.pop("init_shard", None)  # as the trainer drops the reader
        return module
    from torch.distributed.device_mesh import init_device_mesh

    from benchkit.llama_tp import _torchtitan_tp

    mesh = init_device_mesh("cpu", (n,))
    if side == "from_pretrained":
        import transformers

        transformers.utils.logging.disable_progress_bar()
        whole = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32)
        return _fsdp2(whole, mesh) if zero3 else _torchtitan_tp(whole, mesh, False)
    import torch.distributed.checkpoint as dcp

    from recipes.llama.model import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        module = LlamaForCausalLM(LlamaConfig(**model_dims))
    _fsdp2(module, mesh) if zero3 else _torchtitan_tp(module, mesh, False)
    module.to_empty(device="cpu")
    dcp.load(module.state_dict(), storage_reader=dcp.HuggingFaceStorageReader(path))
    return module


def measure(side: str, path: str, model_dims: dict, zero3: bool = False) -> tuple:
    """On every rank: ``(held, peak, every parameter equals the file's)``."""
    import torch
    from safetensors import safe_open

    from benchkit.heap import HeapPeak, heap_bytes

    gc.collect()
    base = heap_bytes()
    sampler = HeapPeak()
    sampler.start()
    module = _load(side, path, model_dims, zero3)
    peak = sampler.stop()
    held = heap_bytes()
    with safe_open(f"{path}/model.safetensors", framework="pt") as f:  # every parameter (ZeRO: the masters)
        same = all(torch.equal(p.full_tensor() if hasattr(p, "full_tensor") else p.detach(), f.get_tensor(name).float())
                   for name, p in module.named_parameters())  # a plan leaves the norms plain tensors
    del module
    gc.collect()
    return held - base, peak - base, same


def main(argv=None) -> str:
    """Run the sides, print the table and return it."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tp", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024, help="a multiple of 256 (64-wide heads, 4 per key/value head)")
    ap.add_argument("--zero3", action="store_true", help="ZeRO-3 (FSDP2) over the ranks in place of tp")
    args = ap.parse_args(argv)
    if args.hidden % 256 or args.layers < 1:
        ap.error("--hidden must be a positive multiple of 256 and --layers positive")
    model_dims = dims(args.layers, args.hidden)
    if not args.zero3 and model_dims["num_key_value_heads"] % args.tp:
        ap.error(f"--tp {args.tp} must divide the {model_dims['num_key_value_heads']} key/value heads")

    from toolkit.rank_pool import get_pool

    with tempfile.TemporaryDirectory(prefix="bench-init-") as path:
        write_hf(path, model_dims)
        pool = get_pool(args.tp)
        for side in SIDES:  # imports and first-touch costs land outside the table
            pool.run(measure, side, path, model_dims, args.zero3)
        got = {s: [] for s in SIDES}
        for r in range(args.rounds):
            for side in SIDES if r % 2 == 0 else SIDES[::-1]:
                ranks = pool.run(measure, side, path, model_dims, args.zero3)
                if not all(same for _, _, same in ranks):
                    raise SystemExit(f"{side}: its parameters are not the file's")
                got[side].append((max(h for h, _, _ in ranks), max(p for _, p, _ in ranks)))
    mib = 2.0 ** 20
    held = {s: statistics.median(h for h, _ in got[s]) / mib for s in SIDES}
    peak = {s: statistics.median(p for _, p in got[s]) / mib for s in SIDES}
    n_params = sum(v for v in _param_counts(model_dims))
    how = "ZeRO-3" if args.zero3 else "tensor parallel"
    lines = [f"LLaMA {args.layers}x{args.hidden} ({n_params / 1e6:.0f}M parameters, bf16 file, fp32 model), {how} "
             f"over {args.tp} gloo ranks; heap MiB per rank above the start (worst rank, median of "
             f"{args.rounds} rounds)"]
    lines += [f"{s:16s} held {held[s]:8.0f}  peak {peak[s]:8.0f}  ours/this peak {peak['ours'] / peak[s]:.2f}x"
              for s in SIDES]
    lines.append(f"init memory{', ZeRO-3' if args.zero3 else ''} (peak per rank): ours {peak['ours']:.0f} MiB, from_pretrained "
                 f"{peak['from_pretrained']:.0f} MiB ({peak['ours'] / peak['from_pretrained']:.2f}x), DCP "
                 f"{peak['DCP']:.0f} MiB ({peak['ours'] / peak['DCP']:.2f}x)")
    text = "\n".join(lines)
    print(text, flush=True)
    return text


def _param_counts(model_dims: dict):
    """The parameter tensors' sizes of a LLaMA of ``model_dims`` (counted on the meta device)."""
    import torch

    from recipes.llama.model import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**model_dims))
    return [p.numel() for p in model.parameters()]


if __name__ == "__main__":
    main()
