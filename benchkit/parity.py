"""Parity of a distributed run against one device training on its own: the MLP, tiny GPT-2 and tiny LLaMA
layouts of scripts/verify_parity.py (its docstring says what is compared and why the bars are what they are)."""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

import sbp_core as sc
from recipes.gpt2.model import GPT2Config, GPT2LMHeadModel
from recipes.gpt2.plan import RESIDUAL_WHOLE, SEQUENCE_PARALLEL, TENSOR_PARALLEL
from recipes.llama import plan as llama_plan
from recipes.llama.model import LlamaConfig, LlamaForCausalLM
from sbp_core.sbp import Broadcast, Split
from toolkit.mesh import context_plan, stage_ranks, with_context

WORLD = 4
STEPS = 3
ADAMW = dict(lr=1e-3, weight_decay=0.1)
# (loss, gradients, final parameters): scripts/verify_parity.py's docstring says why
# Bars (loss, gradients, final parameters) per precision; scripts/verify_parity.py says why. float32's gradient
# bar sits above the float32 floor: the one-device float32 run's gradients after an AdamW step differ from the
# float64 run's by up to 1.7e-4 (benchkit.pipeline_parity's GPT-2, steps 2-3).
TOLERANCE = {"float64": (1e-9, 1e-9, 1e-9), "float32": (1e-5, 1e-3, 1e-2)}
B, S0, S1, S2 = Broadcast(), Split(0), Split(1), Split(2)


class MLP(nn.Module):
    def __init__(self, d_in=32, hidden=64, classes=8):
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc2 = nn.Linear(hidden, classes)

    def forward(self, x, y):
        return F.cross_entropy(self.fc2(F.gelu(self.fc1(x), approximate="tanh")), y)


GPT_CFG = GPT2Config(vocab_size=256, n_positions=32, n_embd=64, n_layer=2, n_head=4,
                     embd_pdrop=0.0, resid_pdrop=0.0, attn_pdrop=0.0)

# The recipe's own Megatron layout of GPT-2 on the tp mesh axis (the tied lm_head is wte's parameter, named
# once in a whole model), and the residual stream kept whole.
GPT_TP = {k: v for k, v in TENSOR_PARALLEL.items() if k != "lm_head.weight"}
GPT_TP_PINS = RESIDUAL_WHOLE
# Sequence parallel: LayerNorm regions split along the sequence.
GPT_SP_PINS = SEQUENCE_PARALLEL
MLP_TP = {"fc1.weight": S0, "fc1.bias": S0, "fc2.weight": S1}
# LLaMA: grouped-query attention (4 query heads, 2 key/value heads), SwiGLU, RMSNorm, rotary embeddings.
LLAMA_CFG = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)


def _on_axis(plan, axis_sbp_other, tp_axis, ndim):
    """Put each plan entry's SBP on ``tp_axis`` of an ``ndim`` mesh, ``B`` elsewhere."""
    out = {}
    for k, v in plan.items():
        sbp = [axis_sbp_other] * ndim
        sbp[tp_axis] = v
        out[k] = tuple(sbp)
    return out


def layouts():
    """name -> (model kind, mesh ranks, plan, input SBP[, samples per batch: 4 unless given])."""
    out = {}
    for kind, tp_plan, pins in (("mlp", MLP_TP, {}), ("gpt2", GPT_TP, GPT_TP_PINS)):
        out[f"{kind} dp2"] = (kind, [0, 1], {}, (S0,))
        out[f"{kind} dp4"] = (kind, [0, 1, 2, 3], {}, (S0,))
        out[f"{kind} tp2"] = (kind, [0, 1], {**tp_plan, **pins}, (B,))
        out[f"{kind} tp4"] = (kind, [0, 1, 2, 3], {**tp_plan, **pins}, (B,))
        out[f"{kind} dp2 x tp2"] = (kind, [[0, 1], [2, 3]], _on_axis({**tp_plan, **pins}, B, 1, 2), (S0, B))
        out[f"{kind} tp2 cost-chosen"] = (kind, [0, 1], dict(tp_plan), (B,))
    out["llama dp2"] = ("llama", [0, 1], {}, (S0,))
    out["llama tp2"] = ("llama", [0, 1], {**llama_plan.TENSOR_PARALLEL, **llama_plan.RESIDUAL_WHOLE}, (B,))
    out["llama tp2 sequence-parallel"] = ("llama", [0, 1], {**llama_plan.TENSOR_PARALLEL,
                                                             **llama_plan.SEQUENCE_PARALLEL}, (B,))
    out["llama dp2 x tp2"] = ("llama", [[0, 1], [2, 3]], llama_plan.mesh_plan(), (S0, B))
    out["llama dp2 x tp2 cost-chosen"] = ("llama", [[0, 1], [2, 3]], _on_axis(llama_plan.TENSOR_PARALLEL, B, 1, 2),
                                          (S0, B))
    out["llama dp2 x tp2 tied"] = ("llama-tied", [[0, 1], [2, 3]], llama_plan.mesh_plan(), (S0, B))
    out["qwen2 dp2 x tp2"] = ("qwen2", [[0, 1], [2, 3]], llama_plan.mesh_plan(qkv_bias=True), (S0, B))
    out["gpt2 tp2 sequence-parallel"] = ("gpt2", [0, 1], {**GPT_TP, **GPT_SP_PINS}, (B,))
    out["gpt2 dp2 x tp2 sequence-parallel"] = ("gpt2", [[0, 1], [2, 3]], _on_axis({**GPT_TP, **GPT_SP_PINS}, B, 1, 2), (S0, B))
    out["gpt2 dp2 x tp2 cost-chosen"] = ("gpt2", [[0, 1], [2, 3]], _on_axis(GPT_TP, B, 1, 2), (S0, B))
    # Context parallelism, as the trainer lays it out (toolkit.mesh): a (dp, cp, tp) mesh, the sequence split on cp,
    # one sample per data shard (with more, linear layers fold batch and sequence and the split becomes a batch
    # split). With one head, neither heads nor the batch of one split over cp2: attention runs query blocks against
    # gathered keys and values (the CPU kernel's causal rows).
    cp_data, cp_plan = with_context((S0, B), 2, 1), context_plan(llama_plan.mesh_plan(), 2, 1)
    out["llama cp2"] = ("llama", stage_ranks(1, 1, 1, 2)[0], cp_plan, cp_data, 1)
    out["llama dp2 x cp2"] = ("llama", stage_ranks(2, 1, 1, 2)[0], cp_plan, cp_data, 2)
    out["llama cp2, one head"] = ("llama-1h", stage_ranks(1, 1, 1, 2)[0], cp_plan, cp_data, 1)
    out["llama cp2 x tp2 sequence-parallel"] = ("llama", stage_ranks(1, 2, 1, 2)[0],
                                                context_plan(llama_plan.mesh_plan(True), 2, 1), cp_data, 1)
    # Qwen3's attention: each query and key head RMS-normalised, heads of 24 on a width of 64.
    out["qwen3 cp2 x tp2 sequence-parallel"] = ("qwen3", stage_ranks(1, 2, 1, 2)[0],
                                                context_plan(llama_plan.mesh_plan(True), 2, 1), cp_data, 1)
    # OLMo 2's layer: norms after the attention and the MLP (the row-split projections' partial outputs reduced
    # into them; reduce-scattered with the sequence split), query and key norms over the whole projections (split
    # with the heads).
    out["olmo2 dp2 x tp2"] = ("olmo2", [[0, 1], [2, 3]], llama_plan.mesh_plan(qk_norm_projection=True,
                                                                              post_norm=True), (S0, B))
    out["olmo2 cp2 x tp2 sequence-parallel"] = ("olmo2", stage_ranks(1, 2, 1, 2)[0], context_plan(
        llama_plan.mesh_plan(True, qk_norm_projection=True, post_norm=True), 2, 1), cp_data, 1)
    # Mistral's sliding window (6 positions on 16): with tp the heads split and the mask stays whole; with one
    # head on cp2 the queries split on the sequence, and the mask's query rows with them.
    out["mistral-window cp2 x tp2 sequence-parallel"] = ("mistral-window", stage_ranks(1, 2, 1, 2)[0],
                                                         context_plan(llama_plan.mesh_plan(True), 2, 1), cp_data, 1)
    out["mistral-window cp2, one head"] = ("mistral-window-1h", stage_ranks(1, 1, 1, 2)[0], cp_plan, cp_data, 1)
    out["gpt2 cp2 x tp2 sequence-parallel"] = ("gpt2", stage_ranks(1, 2, 1, 2)[0],
                                               context_plan(_on_axis({**GPT_TP, **GPT_SP_PINS}, B, 1, 2), 2, 1),
                                               cp_data, 1)
    # Dropout 0.1 everywhere: masks drawn for the global shape equal one device's draws from the same RNG state.
    out["gpt2 dp2 x tp2 dropout"] = ("gpt2-dropout", [[0, 1], [2, 3]], _on_axis({**GPT_TP, **GPT_TP_PINS}, B, 1, 2),
                                     (S0, B))
    return out


def _model_and_batches(kind, dtype=torch.float64, rows: int = 4):
    torch.manual_seed(0)
    if kind == "mlp":
        model = MLP()
        batches = [(torch.randn(16, 32).to(dtype), torch.randint(0, 8, (16,))) for _ in range(STEPS)]
    elif kind in ("llama", "llama-tied", "qwen2", "llama-1h", "qwen3", "olmo2", "mistral-window",
                  "mistral-window-1h"):  # Qwen2: q/k/v biases and a tied head
        heads = {"num_attention_heads": 1, "num_key_value_heads": 1} if kind.endswith("-1h") else {}
        if kind == "qwen3":  # each query and key head normalised, heads of 24 on a width of 64
            heads = {"head_dim": 24, "qk_norm": True}
        if kind == "olmo2":
            heads = {"qk_norm": True, "qk_norm_over": "projection", "post_norm": True}
        if kind.startswith("mistral-window"):
            heads = {**heads, "sliding_window": 6}
        model = LlamaForCausalLM(dataclasses.replace(LLAMA_CFG, tie_word_embeddings=kind in ("llama-tied", "qwen2"),
                                                     qkv_bias=kind == "qwen2", **heads))
        batches = [(ids, ids) for ids in (torch.randint(0, LLAMA_CFG.vocab_size, (rows, 16)) for _ in range(STEPS))]
    else:
        p = 0.1 if kind == "gpt2-dropout" else 0.0
        model = GPT2LMHeadModel(dataclasses.replace(GPT_CFG, embd_pdrop=p, resid_pdrop=p, attn_pdrop=p))
        batches = [(ids, ids) for ids in (torch.randint(0, GPT_CFG.vocab_size, (rows, 16)) for _ in range(STEPS))]
    return model.to(dtype), batches


def _loss(kind, model, x, y):
    return model(x, y) if kind == "mlp" else model(x, y)[1]


def _rel(a, b) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-300)).item()


def run_layout(name, dtype: str = "float64"):
    """Worker: train ``name`` and, on its own, the single-device reference; the max relative differences
    ``(loss, gradients, final parameters)`` on the layout's first rank (``None`` elsewhere). Every rank of the
    layout gathers the same whole values, so one of them trains the reference and compares (on a CPU host the
    ranks share its cores: a reference per rank would cost the layout's ranks times one device's run)."""
    kind, ranks, plan, in_sbp, *rest = layouts()[name]
    rows = rest[0] if rest else 4
    dt = getattr(torch, dtype)
    p = sc.placement("cpu", ranks)
    me = torch.distributed.get_rank()
    leader = me == p.ranks[0]
    ref, batches = _model_and_batches(kind, dt, rows)
    ref_opt = torch.optim.AdamW(ref.parameters(), **ADAMW)
    model, _ = _model_and_batches(kind, dt, rows)
    sc.distribute_module(model, p, plan)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    worst_loss = worst_grad = 0.0
    for x, y in batches:
        rng = torch.get_rng_state()  # both runs draw their dropout masks from one state
        if leader:
            ref_loss = _loss(kind, ref, x, y)
            ref_loss.backward()
            torch.set_rng_state(rng)
        gx = sc.distribute(x, p, in_sbp)
        gy = sc.distribute(y, p, in_sbp)
        loss = _loss(kind, model, gx, gy)
        loss.backward()
        value = loss.full_tensor()
        grads = {n: q.grad.full_tensor() for n, q in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        if leader:
            worst_loss = max(worst_loss, _rel(value, ref_loss.detach()))
            for n, q in ref.named_parameters():
                worst_grad = max(worst_grad, _rel(grads[n], q.grad))
            ref_opt.step()  # the reference's own gradients, its own step
            ref_opt.zero_grad()
    params = {n: q.full_tensor() for n, q in model.named_parameters()}
    if not leader:
        return None
    worst_param = max(_rel(params[n], q.detach()) for n, q in ref.named_parameters())
    return worst_loss, worst_grad, worst_param, _floor(kind, ref, rows) if dt != torch.float64 else 0.0


def _floor(kind, ref, rows: int = 4) -> float:
    """How far the one-device run in ``ref``'s precision ends from the same run in float64 (its parameters)."""
    exact, batches = _model_and_batches(kind, torch.float64, rows)
    opt = torch.optim.AdamW(exact.parameters(), **ADAMW)
    for x, y in batches:
        _loss(kind, exact, x, y).backward()
        opt.step()
        opt.zero_grad()
    theirs = dict(exact.named_parameters())
    return max(_rel(q.detach(), theirs[n].detach()) for n, q in ref.named_parameters())
