"""LLaMA under tensor parallelism both ways, on one model class: ours (``recipes.llama.plan``) and DTensor's
``parallelize_module`` with torchtitan's Llama plan (``apply_tp``), as ``scripts/bench_llama_tp.py`` runs them.

The peer parallelises the very module ours lays out (``recipes.llama.model.LlamaForCausalLM``: its
attention views ``-1`` heads, so a rank's column shard of the projections runs as a smaller model, as
torchtitan's does): ``ColwiseParallel`` on the query, key, value, gate and up projections,
``RowwiseParallel`` on the output and down projections, the embedding ``RowwiseParallel`` (vocabulary
rows) and the LM head ``ColwiseParallel`` with ``Shard(-1)`` logits under ``loss_parallel``. Between the
blocks the activations are ``Replicate`` (torchtitan's plan without its sequence parallelism; ours:
``RESIDUAL_WHOLE``), or with ``sequence_parallel`` ``Shard(1)``: ``SequenceParallel`` norms and
``PrepareModuleInput`` gathering the attention's and the MLP's input, torchtitan's plan as it is (ours:
``SEQUENCE_PARALLEL``). Norms and the rotary tables are replicated.
"""
from __future__ import annotations


import torch
import torch.nn.functional as F

from benchkit.dtensor_gpt import collectives_of
from benchkit.paired import timed_steps

ADAMW = dict(lr=1e-3, weight_decay=0.1)


def _torchtitan_tp(model, mesh, sequence_parallel: bool):
    """torchtitan's ``apply_tp`` on ``model``; without ``sequence_parallel`` its layouts between the blocks are
    ``Replicate`` (the residual stream whole, Megatron's plan without sequence parallelism)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    between = Shard(1) if sequence_parallel else Replicate()
    plan = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=between),
        "lm_head": ColwiseParallel(input_layouts=between, output_layouts=Shard(-1), use_local_output=False),
    }
    if sequence_parallel:
        plan["model.norm"] = SequenceParallel()
    for i in range(len(model.model.layers)):
        layer = f"model.layers.{i}"
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            plan[f"{layer}.{name}"] = ColwiseParallel()
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            plan[f"{layer}.{name}"] = RowwiseParallel(output_layouts=between)
        if sequence_parallel:
            plan[f"{layer}.input_layernorm"] = SequenceParallel()
            plan[f"{layer}.post_attention_layernorm"] = SequenceParallel()
            plan[f"{layer}.self_attn"] = PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                                            desired_input_layouts=(Replicate(), None, None))
            plan[f"{layer}.mlp"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    return parallelize_module(model, mesh, plan)


def tp_worker(dims: dict, batch: int, seq: int, steps: int, warmup: int, sequence_parallel: bool = False) -> dict:
    """On every rank: each way's step times (s) and first losses, and the collectives of one step each.

    Both ways are built from one seed (the same initial weights), train on the same batch with AdamW, and
    run in balanced order round by round, each step after a barrier."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel

    import sbp_core as sc
    from recipes.llama import plan as llama_plan
    from recipes.llama.model import LlamaConfig, LlamaForCausalLM
    from sbp_core import sbp

    n = dist.get_world_size()
    cfg = LlamaConfig(**dims)
    torch.manual_seed(0)
    ours = LlamaForCausalLM(cfg)
    torch.manual_seed(0)
    peer = LlamaForCausalLM(cfg)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1))
    p = sc.placement("cpu", list(range(n)))
    pins = llama_plan.SEQUENCE_PARALLEL if sequence_parallel else llama_plan.RESIDUAL_WHOLE
    sc.distribute_module(ours, p, {**llama_plan.TENSOR_PARALLEL, **pins})
    ours_opt = torch.optim.AdamW(ours.parameters(), **ADAMW)
    gids = sc.distribute(ids, p, sbp.broadcast)
    _torchtitan_tp(peer, init_device_mesh("cpu", (n,)), sequence_parallel)
    peer_opt = torch.optim.AdamW(peer.parameters(), **ADAMW)

    def ours_step():
        loss = ours(gids, gids)[1]
        loss.backward()
        ours_opt.step()
        ours_opt.zero_grad()
        return loss

    def peer_step():
        logits = peer(ids)[0]
        with loss_parallel():  # the labels shifted in the step, as ours' forward shifts them
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
            loss.backward()
        peer_opt.step()
        peer_opt.zero_grad()
        return loss

    times, losses = timed_steps({"ours": ours_step, "dtensor": peer_step}, steps, warmup, dist.barrier,
                                lambda loss: loss.full_tensor().item())  # the loss on every rank
    return {"times": times, "losses": losses, "params": sum(q.numel() for q in ours.parameters()),
            "collectives": collectives_of(ours_step, peer_step)}
