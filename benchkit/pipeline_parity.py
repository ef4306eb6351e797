"""The pipelined tiny GPT-2 (or LLaMA, tied or not) of scripts/verify_pipeline.py and its one-device reference:
build a rank's pipeline step, run a layout, compare with one device training on its own, and read a step's
trace back (micro-batches held per stage, bubble)."""
from __future__ import annotations

from dataclasses import replace

import torch

import sbp_core as sc
from benchkit import parity
from benchkit.parity import TOLERANCE  # noqa: F401  (the pipelines are held to the same bars)
from recipes.gpt2.model import GPT2Config, GPT2LMHeadModel
from recipes.gpt2 import plan as gpt2_plan
from recipes.gpt2.plan import ACT_SBP, DATA_SBP, stage_forward
from recipes.llama import plan as llama_plan
from recipes.llama.model import LlamaForCausalLM
from runtime.pipeline import PipelineConfig, PipelineStep
from runtime.pipeline.schedule import chunk_ranks
from runtime.pipeline.timeline import bubble, peak_held
from runtime.trace import Trace
from toolkit.mesh import plan_for_module, stage_placements
from toolkit.stages import chunk_views, keep_stages, stage_ranges

WORLD = 8
STEPS = 3
MICRO = 8
BATCH, SEQ = 16, 16
ADAMW = dict(lr=1e-3, weight_decay=0.1)
CFG = GPT2Config(vocab_size=256, n_positions=32, n_embd=64, n_layer=4, n_head=4,
                 embd_pdrop=0.0, resid_pdrop=0.0, attn_pdrop=0.0)
# scripts/verify_parity.py's LLaMA (grouped-query attention) with 4 layers; "llama-tied" ties its LM head;
# "mixtral" has 4 experts, 2 per token, a capacity that drops choices, and a load-balancing weight of 0.01;
# "qwen-moe" adds every other option of the LLaMA recipe's experts and attention: Qwen2-MoE's gated shared expert,
# unnormalised routing weights and query/key/value biases, Qwen3's per-head query/key norms and heads of 24 on a
# width of 64 (no Hugging Face model has all of them; the reference is our own model on one device).
LLAMA_CFG = replace(parity.LLAMA_CFG, num_hidden_layers=4)
MIXTRAL_CFG = replace(LLAMA_CFG, num_local_experts=4, num_experts_per_tok=2, capacity_factor=1.0,
                      router_aux_loss_coef=0.01)
MODELS = {"gpt2": CFG, "llama": LLAMA_CFG, "llama-tied": replace(LLAMA_CFG, tie_word_embeddings=True),
          "mixtral": MIXTRAL_CFG,
          "qwen-moe": replace(MIXTRAL_CFG, shared_expert_intermediate_size=48, norm_topk_prob=False, qkv_bias=True,
                              qk_norm=True, head_dim=24)}
LAYOUTS = {"pp2": (1, 1, 2), "pp4": (1, 1, 4), "dp2_pp2": (2, 1, 2), "tp2_pp2": (1, 2, 2), "dp2_tp2_pp2": (2, 2, 2)}


def model_config(model: str = "gpt2", n_layer: int | None = None):
    """``MODELS[model]`` with ``n_layer`` layers (its own count by default)."""
    cfg = MODELS[model]
    if n_layer is None:
        return cfg
    return replace(cfg, n_layer=n_layer) if isinstance(cfg, GPT2Config) else replace(cfg, num_hidden_layers=n_layer)


def _recipe_parts(cfg) -> tuple:
    """``(model class, pipeline split, tied pairs, mesh plan, layers, hidden size)`` of a GPT-2 or LLaMA config,
    as the recipes have them."""
    if isinstance(cfg, GPT2Config):
        return GPT2LMHeadModel, gpt2_plan.PIPELINE, gpt2_plan.TIED, gpt2_plan.mesh_plan(), cfg.n_layer, cfg.n_embd
    tied = llama_plan.TIED if cfg.tie_word_embeddings else ()
    plan = llama_plan.mesh_plan(qkv_bias=cfg.qkv_bias, experts=cfg.num_local_experts > 0,
                                shared_expert=cfg.shared_expert_intermediate_size > 0,
                                qk_norm_projection=cfg.qk_norm and cfg.qk_norm_over == "projection",
                                post_norm=cfg.post_norm)
    return LlamaForCausalLM, llama_plan.PIPELINE, tied, plan, cfg.num_hidden_layers, cfg.hidden_size


def global_batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, CFG.vocab_size, (BATCH, SEQ), generator=g)


def build(dp: int, tp: int, pp: int, micro: int = MICRO, schedule: str = "1f1b", traced: bool = False,
          cfg=CFG, batch_of=global_batch, seq: int = SEQ, batch: int = BATCH, max_grad_norm=None,
          rows_weigh_equally: bool = True, loss_scale=None, dtype=torch.float32, virtual: int = 1,
          fused: bool = False, data=None):
    """This rank's pipelined GPT-2, or LLaMA for a ``LlamaConfig`` ``cfg``: ``(PipelineStep, its module or None)``;
    every rank calls it.

    ``loss_scale``: an ``sc.LossScaler`` the step scales the loss by (fp16's; here in fp32). ``fused``: AdamW's
    fused kernel (it skips an overflowed step by the loss scale's flag, on the device).
    ``dtype``: the model's and the stage boundaries' precision. ``virtual``: stages per pipeline rank
    (the model's layers split into ``virtual * pp`` stages, placed as ``schedule`` says). ``data(d)``:
    the step's batches for data shard ``d`` of ``dp`` (a ``toolkit.data.MicroBatches``) in place of
    ``batch_of``'s, sliced per micro-batch and shard.

    ``rows_weigh_equally``: GPT-2's loss is (``Recipe.rows_weigh_equally``), so dp stages (dp2_pp2) run plain
    after their audit."""
    me = torch.distributed.get_rank()
    placements = stage_placements(dp, tp, pp)
    rank = me // (dp * tp) if me < dp * tp * pp else None
    model_class, split, tied, plan, n_layer, hidden = _recipe_parts(cfg)
    torch.manual_seed(0)
    model = model_class(cfg).to(dtype)
    names = tuple({n for n, _ in model.named_parameters(remove_duplicate=False)} | {n for n, _ in model.named_modules()})
    module = opt = chunks = None
    if rank is not None:
        stages = [c for c, r in enumerate(chunk_ranks(schedule, pp, virtual)) if r == rank]
        ranges = stage_ranges(n_layer, pp * virtual)
        module = keep_stages(model, split, ranges, stages)
        chunks = chunk_views(module, split, ranges, stages)
        sc.distribute_module(module, placements[rank], plan_for_module(module, plan, names))
        opt = torch.optim.AdamW(module.parameters(), **ADAMW, fused=fused or None)
    d = (me % (dp * tp)) // tp

    def batches(step, k):
        return batch_of(step).tensor_split(micro)[k].tensor_split(dp)[d]

    if data is not None:
        batches = data(d)

    act = (((batch // micro, seq, hidden), dtype),)
    if getattr(cfg, "num_local_experts", 0):  # each sample's load-balancing loss travels with its hidden states
        act += (((batch // micro,), torch.promote_types(dtype, torch.float32)),)
    pcfg = PipelineConfig(placements, micro, {"input_ids": ((batch // micro, seq), torch.int64)},
                          [act] * (pp * virtual - 1), DATA_SBP, ACT_SBP,
                          ("input_ids",), ("input_ids",), schedule=schedule, tied=tied, max_grad_norm=max_grad_norm,
                          timeout=20, rows_weigh_equally=rows_weigh_equally, virtual=virtual)
    trace = (lambda: Trace(rank=me)) if traced else None
    return PipelineStep(pcfg, module, opt, stage_forward, batches, trace_factory=trace, loss_scale=loss_scale,
                        chunks=chunks), module


def run_pipeline(name: str, steps: int = STEPS, schedule: str = "1f1b", micro: int = MICRO, max_grad_norm=None,
                 loss_scale=None, dtype: str = "float32", virtual: int = 1, n_layer: int | None = None,
                 model: str = "gpt2"):
    """Worker: per step, the loss (where known), the stage leader's full gradients (as the optimizer sees them),
    the trace; after the last step, the leader's parameters (``params`` of the last entry).

    ``loss_scale``: a starting scale, or ``None`` for no loss scaling; ``virtual``: stages per pipeline rank
    of ``MODELS[model]`` with ``n_layer`` layers (its own count by default)."""
    dp, tp, pp = LAYOUTS[name]
    scaler = sc.LossScaler(loss_scale) if loss_scale else None
    step, module = build(dp, tp, pp, micro, schedule, traced=True, max_grad_norm=max_grad_norm, loss_scale=scaler,
                         dtype=getattr(torch, dtype), virtual=virtual, cfg=model_config(model, n_layer))
    grads = []
    if module is not None:
        opt_step = step.optimizer.step

        def capture(*a, **k):
            grads.append({n: q.grad.full_tensor() for n, q in module.named_parameters()})
            return opt_step(*a, **k)

        step.optimizer.step = capture
    out = []
    for i in range(steps):
        loss = step.step(i)
        loss = None if loss is None else float(loss)
        leader = step.stage is not None and torch.distributed.get_rank() == step.placement.ranks[0]
        # Per forward actor and per rank's stash pool (several stages per rank): most registers held at once.
        held = {n: s.max_live for n, s in step.last_stats.items() if ".F@" in n or n.startswith("stash@")}
        held.update({n: s.actions for n, s in step.last_stats.items() if ".W@" in n or ".T@" in n})  # actions
        out.append({"loss": loss, "grads": grads[-1] if leader else None, "stage": step.stage,
                    "events": step.last_trace.wall_events() if step.last_trace else [], "max_live": held})
    if module is not None:
        params = {n: q.full_tensor() for n, q in module.named_parameters()}
        out[-1]["params"] = params if leader else None
    return out


def _rel(a, b) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-300)).item()


def compare(per_rank: list, steps: int = STEPS, max_grad_norm=None, dtype: str = "float32",
            n_layer: int | None = None, model: str = "gpt2") -> tuple:
    """``(worst loss, worst grad, worst final parameter)`` relative differences against one device that
    trains on its own (its own forward, backward, clipping and AdamW steps), in ``dtype``.

    Each step's loss and gradients (as the pipeline's optimizer saw them) against the reference's own at
    that step; the parameters after the last step against the reference's.
    """
    cfg = model_config(model, n_layer)
    torch.manual_seed(0)
    ref = _recipe_parts(cfg)[0](cfg).to(getattr(torch, dtype))
    opt = torch.optim.AdamW(ref.parameters(), **ADAMW)
    worst_loss = worst_grad = 0.0
    for i in range(steps):
        ids = global_batch(i)
        loss = ref(ids, ids)[1]
        loss.backward()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), max_grad_norm)
        losses = [r[i]["loss"] for r in per_rank if r[i]["loss"] is not None]
        assert losses, "no rank reported the loss"
        worst_loss = max(worst_loss, max(abs(x - loss.item()) / abs(loss.item()) for x in losses))
        got = {}
        for r in per_rank:
            if r[i]["grads"]:
                got.update(r[i]["grads"])
        ref_params = dict(ref.named_parameters(remove_duplicate=False))
        missing = sorted(set(n for n, _ in ref.named_parameters()) - set(got))
        assert not missing, f"no stage reported gradients of {missing}"
        for n, g in got.items():
            worst_grad = max(worst_grad, _rel(g, ref_params[n].grad))
        opt.step()  # the reference's own gradients
        opt.zero_grad()
    final = {}
    for r in per_rank:
        if r[steps - 1].get("params"):
            final.update(r[steps - 1]["params"])
    ref_params = dict(ref.named_parameters(remove_duplicate=False))
    assert set(final) >= set(n for n, _ in ref.named_parameters()), "no stage reported some final parameters"
    worst_param = max(_rel(q, ref_params[n].detach()) for n, q in final.items())
    return worst_loss, worst_grad, worst_param


def schedule_report(per_rank: list, pp: int, micro: int, step: int = -1) -> tuple:
    """``({pipeline rank: peak held}, {pipeline rank: bubble})`` of one step (the last by default); a pipeline rank
    is named by its first stage, and its bubble read on its first device."""
    held, events = {}, {}
    for r in per_rank:
        st = r[step]["stage"]
        if st is None:
            continue
        held[st] = max(held.get(st, 0), peak_held(r[step]["events"]))
        events.setdefault(st, r[step]["events"])
    return held, bubble(events)
