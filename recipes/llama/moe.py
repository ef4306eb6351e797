"""Mixtral's and Qwen2-MoE's sparse MLP as plain torch: a top-k router and stacked SwiGLU experts, dispatched by
static slots, and Qwen2-MoE's gated shared expert.

Names and shapes follow ``transformers``' ``MixtralSparseMoeBlock``
(version 5): ``mlp.gate.weight`` ``[E, hidden]`` is the router, and the
experts are stacked, ``mlp.experts.gate_proj`` and ``.up_proj`` ``[E, F,
hidden]``, ``.down_proj`` ``[E, hidden, F]``. Hugging Face fuses the
first two into one ``gate_up_proj`` ``[E, 2F, hidden]`` (their
concatenation on dim 1); here they stay apart so that a tensor-parallel
rank's share of ``F`` holds matching gate and up columns.

Routing is Mixtral's: a softmax over the experts (in at least float32), the
``k`` most probable, their weights renormalised to sum to 1 (with
``norm_topk_prob`` false, Qwen2-MoE's default, the probabilities as they
are). With ``shared_expert_intermediate_size > 0`` every token also goes
through Qwen2-MoE's shared expert, a SwiGLU MLP (``mlp.shared_expert``)
whose output is scaled by ``sigmoid(x @ shared_expert_gate.weight.T)``
(``[1, hidden]``) and added to the routed experts'. Dispatch is
GShard's, with static shapes so that boxing can plan it: every sample is a
group whose experts have ``capacity`` slots each; the sample's tokens take
slots in order, each token its choices most probable first, and a choice
that finds its expert full is dropped (it adds nothing to the token's
output). Token order, not GShard's all-first-choices-first: a causal
model's drops must not depend on later tokens. ``capacity_factor = 0`` gives every expert room for every token of
the sample (no choice is dropped: the output is Hugging Face's), at ``E x
seq`` slots per sample, all of which the experts compute (``E / k`` times
the routed tokens' work); a factor ``c > 0`` gives ``ceil(c * k * seq / E)``.

The experts read a ``[E, batch, capacity, hidden]`` buffer. With the
experts split over the data-parallel ranks (``plan.py``'s ``EXPERTS``: the
buffer pinned ``S(0)`` at the experts' input, ``S(1)`` at their output),
boxing the buffer from samples to experts and back is the two all-to-alls
of expert parallelism; nothing here communicates.

The load-balancing loss is per sample (a sequence-wise Switch loss, as
DeepSeek-V3's): ``E * sum_e f_e * P_e`` with ``f_e`` the sample's choices
routed to expert ``e`` per token and ``P_e`` its mean router probability
over the sample's tokens, ``k`` when routing is uniform. Hugging Face's
Mixtral computes the same product over every token of the batch and every
layer pooled (equal for one sample and one layer); a per-sample loss is
what lets each pipeline stage add its own layers' to the activations it
sends on.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .mlp import MLP


def capacity(cfg, seq: int) -> int:
    """Slots per expert and sample: ``seq`` for ``capacity_factor == 0`` (none dropped), else
    ``ceil(capacity_factor * num_experts_per_tok * seq / num_local_experts)``, at most ``seq``."""
    if cfg.capacity_factor == 0:
        return seq
    return min(seq, math.ceil(cfg.capacity_factor * cfg.num_experts_per_tok * seq / cfg.num_local_experts))


class Router(nn.Module):
    """``weight`` ``[E, hidden]``: the logits ``x @ weight.T`` (Hugging Face's ``MixtralTopKRouter``'s)."""

    def __init__(self, cfg):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.num_local_experts, cfg.hidden_size))

    def forward(self, x):
        return F.linear(x, self.weight)


class Experts(nn.Module):
    """``E`` SwiGLU MLPs stacked: ``[E, n, hidden] -> [E, n, hidden]``, expert ``e`` on row block ``e``."""

    def __init__(self, cfg):
        super().__init__()
        e, f, h = cfg.num_local_experts, cfg.intermediate_size, cfg.hidden_size
        self.gate_proj = nn.Parameter(torch.empty(e, f, h))
        self.up_proj = nn.Parameter(torch.empty(e, f, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, f))

    def forward(self, x):
        e, b, c, h = x.shape
        x = x.reshape(e, b * c, h)
        hidden = F.silu(torch.bmm(x, self.gate_proj.transpose(1, 2))) * torch.bmm(x, self.up_proj.transpose(1, 2))
        return torch.bmm(hidden, self.down_proj.transpose(1, 2)).reshape(e, b, c, h)


class SparseMoE(nn.Module):
    """``forward(x [b, t, hidden]) -> (y [b, t, hidden], balance [b])``: the experts' weighted outputs (plus the
    gated shared expert's) and each sample's load-balancing loss (module docstring)."""

    def __init__(self, cfg):
        super().__init__()
        self.config = cfg
        self.gate = Router(cfg)
        self.experts = Experts(cfg)
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = MLP(cfg.hidden_size, cfg.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def forward(self, x):
        cfg = self.config
        b, t, h = x.shape
        n, k, c = cfg.num_local_experts, cfg.num_experts_per_tok, capacity(cfg, t)
        logits = self.gate(x)
        probs = torch.softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
        weights, chosen = probs.topk(k, dim=-1)  # [b, t, k]
        if cfg.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        # Token-major queues: choice j of token i at i * k + j. Whether a choice finds a free slot then depends
        # on earlier tokens alone, as a causal model's position must (GShard's choice-major order would let a
        # token's later neighbours, its own label among them, decide which of its second choices are dropped).
        chosen = chosen.reshape(b, t * k)
        # Buffers made "like" a tensor of the samples' layout, so that a rank allocates its own samples' rows.
        hits = torch.zeros_like(chosen.unsqueeze(-1).expand(b, t * k, n)).scatter(2, chosen.unsqueeze(-1), 1)
        slot = (hits.cumsum(1) * hits).sum(-1) - 1  # the choice's place in its expert's queue
        # Slot e * c + place in the sample's buffer; a dropped choice goes to the spare slot n * c, zeros.
        where = (chosen * c + slot).masked_fill(slot >= c, n * c).unsqueeze(-1).expand(b, t * k, h)
        spare = torch.zeros_like(x[:, :1])
        tokens = x.unsqueeze(2).expand(b, t, k, h).reshape(b, t * k, h)
        sent = torch.zeros_like(spare.expand(b, n * c + 1, h)).scatter_add(1, where, tokens)
        done = self.experts(sent[:, :n * c].reshape(b, n, c, h).transpose(0, 1))  # [E, b, c, hidden]
        done = torch.cat((done.transpose(0, 1).reshape(b, n * c, h), spare), dim=1)
        picked = done.gather(1, where).reshape(b, t, k, h)
        y = (picked * weights.unsqueeze(-1).to(x.dtype)).sum(2)
        if cfg.shared_expert_intermediate_size:
            y = y + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        share = hits.sum(1).to(probs.dtype) / t  # [b, E]: each expert's choices per token of the sample
        balance = n * (share * probs.mean(1)).sum(-1)
        return y, balance
