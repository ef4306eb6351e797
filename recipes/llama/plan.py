"""The LLaMA recipe's parallel plan as data: Megatron's layout (torchtitan's for Llama) in SBP terms.

On a stage's ``(dp, tp)`` mesh parameters are ``B`` on the dp axis (but
routed experts: ``EXPERTS``, split over it) and, on
the tp axis: the query, key, value, gate and up projections column-split
(``nn.Linear`` weights are ``[out, in]``: ``S(0)``, whole heads per rank,
and with grouped-query attention whole key/value heads, so their query
heads stay on the same rank; Qwen2's query, key and value biases ``S(0)``
with them), the output and down projections row-split
``S(1)``, the token embedding and the LM head vocabulary-split ``S(0)``,
norms ``B`` (but OLMoE's query and key norms over the whole projections:
``QK_NORM_PROJECTION``, split with the heads). Activations: ``S(0)`` batch on dp, and ``B`` on tp at RMSNorm
inputs (the residual stream whole), or ``S(1)`` there with
``sequence_parallel``, which then gathers the attention's and the MLP's
input once each (``B`` pins); OLMo 2's layer (``post_norm``) has its norms
after the attention and the MLP, and the same pins sit there and at the
embedding's output, where its residual stream starts. With
``tie_word_embeddings`` the LM head is the embedding (``TIED``): both names
have the same SBP.
"""
from __future__ import annotations

from sbp_core.sbp import Broadcast, Partial, Split

B, S0, S1 = Broadcast(), Split(0), Split(1)

TENSOR_PARALLEL = {
    "*.self_attn.q_proj.weight": S0, "*.self_attn.k_proj.weight": S0, "*.self_attn.v_proj.weight": S0,
    "*.self_attn.o_proj.weight": S1,
    "*.mlp.gate_proj.weight": S0, "*.mlp.up_proj.weight": S0, "*.mlp.down_proj.weight": S1,
    "model.embed_tokens.weight": S0, "lm_head.weight": S0,
}
RESIDUAL_WHOLE = {"*.input_layernorm:input": B, "*.post_attention_layernorm:input": B, "model.norm:input": B}
# With the sequence split, the attention's and the MLP's input is gathered once, at the module: each of their
# separate projections (q, k, v; gate, up) would otherwise gather the same normalized rows for itself, and
# reduce-scatter its own input gradient back (torchtitan's PrepareModuleInput does the same).
SEQUENCE_PARALLEL = {"*.input_layernorm:input": S1, "*.post_attention_layernorm:input": S1, "model.norm:input": S1,
                     "*.self_attn:input": B, "*.mlp:input": B}
# OLMo 2's layer normalises the attention's and the MLP's outputs (``post_norm``): the pins sit at those norms,
# where the row-split projections' partial outputs arrive (an all-reduce into them, or with the sequence split a
# reduce-scatter), and at the attention's and the MLP's inputs, which read the residual stream itself. No norm
# reads the stream, so it is pinned where it starts, at the vocabulary-split embedding's partial output: whole
# (or sequence-split) from there on, each residual add adds two such, and a layer costs Megatron's two
# reductions (with the sequence split, two all-gathers and two reduce-scatters), not one more per block input.
POST_NORM_WHOLE = {"model.embed_tokens:output": B, "*.self_attn:input": B, "*.post_attention_layernorm:input": B,
                   "*.mlp:input": B, "*.post_feedforward_layernorm:input": B, "model.norm:input": B}
POST_NORM_SEQUENCE_PARALLEL = {"model.embed_tokens:output": S1, "*.post_attention_layernorm:input": S1,
                               "*.post_feedforward_layernorm:input": S1, "model.norm:input": S1,
                               "*.self_attn:input": B, "*.mlp:input": B}

TIED = (("model.embed_tokens.weight", "lm_head.weight"),)
PIPELINE = {"layers": "model.layers", "first": ["model.embed_tokens"], "last": ["model.norm", "lm_head"]}

DATA_SBP = (S0, B)
ACT_SBP = (S0, B)


# Qwen2's query, key and value biases: split with their projections' output features.
QKV_BIAS = {"*.self_attn.q_proj.bias": S0, "*.self_attn.k_proj.bias": S0, "*.self_attn.v_proj.bias": S0}


# Mixtral's experts (moe.py), already on the (dp, tp) mesh: expert parallelism over the data-parallel ranks (each
# holds E / dp whole experts) and Megatron's tensor parallelism inside each expert (gate and up column-split,
# down row-split). The dispatched buffer [E, b, capacity, hidden] is pinned to the experts on the way in and back
# to the samples on the way out: boxing it is expert parallelism's two all-to-alls (dp axis). On the tp axis the
# down projection's partial outputs stay partial through the gather and the weighted sum, so the sum over tp
# is taken of the tokens' outputs [b, t, hidden], not of the buffer (E * capacity / t times as large). The router
# is replicated.
EXPERTS = {"*.mlp.gate.weight": (B, B), "*.mlp.experts.gate_proj": (S0, S1), "*.mlp.experts.up_proj": (S0, S1),
           "*.mlp.experts.down_proj": (S0, Split(2)), "*.mlp.experts:input": (S0, B),
           "*.mlp.experts:output": (S1, Partial())}
# Qwen2-MoE's shared expert: the dense MLP's layout (replicated over dp, Megatron's split on tp), so its output
# is partial on tp as the routed experts' is, and the two are summed before tp's one all-reduce. Its gate
# [1, hidden] is replicated.
SHARED_EXPERT = {"*.mlp.shared_expert.gate_proj.weight": (B, S0), "*.mlp.shared_expert.up_proj.weight": (B, S0),
                 "*.mlp.shared_expert.down_proj.weight": (B, S1), "*.mlp.shared_expert_gate.weight": (B, B)}


# OLMoE's query and key norms over the whole projections: their weights split with the projections' columns (a
# rank's heads), so each rank scales its own heads; the mean of squares over the split columns is a partial sum
# that boxing reduces on tp, [batch, seq, 1] per norm.
QK_NORM_PROJECTION = {"*.self_attn.q_norm.weight": S0, "*.self_attn.k_norm.weight": S0}


def mesh_plan(sequence_parallel: bool = False, qkv_bias: bool = False, experts: bool = False,
              shared_expert: bool = False, qk_norm_projection: bool = False, post_norm: bool = False) -> dict:
    """The plan on a ``(dp, tp)`` mesh: parameters ``(B, tp SBP)``; activation pins ``(S(0), tp SBP)``; with
    ``experts``, ``EXPERTS`` in place of the dense MLP's entries (and ``SHARED_EXPERT`` with a shared one); with
    ``qk_norm_projection``, ``QK_NORM_PROJECTION``; with ``post_norm``, OLMo 2's layer's pins."""
    if post_norm:
        pins = POST_NORM_SEQUENCE_PARALLEL if sequence_parallel else POST_NORM_WHOLE
    else:
        pins = SEQUENCE_PARALLEL if sequence_parallel else RESIDUAL_WHOLE
    params = {**TENSOR_PARALLEL, **(QKV_BIAS if qkv_bias else {}), **(QK_NORM_PROJECTION if qk_norm_projection else {})}
    if experts:
        params = {k: v for k, v in params.items() if ".mlp." not in k}
    return {**{k: (B, v) for k, v in params.items()}, **{k: (S0, v) for k, v in pins.items()},
            **(EXPERTS if experts else {}), **(SHARED_EXPERT if experts and shared_expert else {})}
