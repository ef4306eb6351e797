"""LLaMA's ``cfg.model`` and ``cfg.data``: the typed schemas and the model's checks.

``configs/model/llama*.yaml`` fill the model; the data is GPT-2's token
stream (``recipes.gpt2.config.DataConfig``: ``configs/data/{stdlib,text}.yaml``)
with ``data.seq_len`` defaulting to ``${model.max_position_embeddings}``.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from omegaconf import II

from recipes.gpt2.config import DataConfig as GPT2DataConfig
from recipes.gpt2.config import data_problems

from .model import LlamaConfig


@dataclass
class ModelConfig(LlamaConfig):
    """LLaMA dimensions (Hugging Face's ``LlamaConfig`` names).

    ``num_key_value_heads`` below ``num_attention_heads`` is grouped-query
    attention (it must divide them). ``rope_factor`` other than 1 scales the
    rotary frequencies as Llama 3.1 does (Hugging Face's ``rope_scaling``
    of type ``llama3``, whose ``low_freq_factor``, ``high_freq_factor`` and
    ``original_max_position_embeddings`` are the other ``rope_*`` keys).
    ``tie_word_embeddings``: the LM head is the token embedding (one
    parameter). ``qkv_bias``: biases on the query, key and value
    projections (Qwen2's). ``num_local_experts > 0``: Mixtral's sparse MLP
    in every layer (``recipes/llama/moe.py``), ``num_experts_per_tok`` of
    them per token, each of ``intermediate_size``; ``capacity_factor`` sets
    each expert's slots per sample (0: room for every token, none dropped),
    ``router_aux_loss_coef`` the load-balancing loss's weight in the loss.
    ``norm_topk_prob``: the chosen experts' weights renormalised to sum to
    1 (Mixtral's; Qwen2-MoE's are the probabilities as they are).
    ``shared_expert_intermediate_size > 0``: Qwen2-MoE's gated shared
    expert of that size beside the routed ones. ``head_dim``: each
    attention head's size (0: ``hidden_size / num_attention_heads``; Qwen3's
    is 128 whatever the width). ``qk_norm``: an RMSNorm of the queries and
    keys before the rotation, over each head (``qk_norm_over="head"``,
    Qwen3's) or over the whole projection (``"projection"``, OLMoE's and
    OLMo 2's). ``post_norm``: OLMo 2's layer, which normalises the
    attention's and the MLP's outputs before adding them to the residual
    stream (and not their inputs). ``sliding_window > 0``: Mistral's
    window, each query attending to the keys of its latest ``sliding_window``
    positions (its own included; 0: every earlier one). ``name`` labels
    the preset (run names, W&B); the dimensions are what count.
    """

    # The model's fields (``LlamaConfig``) with the recipe's default model's dimensions (``llama-tiny``).
    name: str = "llama-tiny"
    vocab_size: int = 8192
    hidden_size: int = 128
    intermediate_size: int = 352
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 256
    rms_norm_eps: float = 1e-5


@dataclass
class DataConfig(GPT2DataConfig):
    seq_len: int = II("model.max_position_embeddings")


def llama_config_kwargs(model: Any) -> dict:
    """Keyword arguments of ``recipes.llama.model.LlamaConfig`` for a ``model`` config node."""
    return {f.name: type(f.default)(model.get(f.name, f.default)) for f in fields(LlamaConfig)}


def expert_problems(m, layout) -> list:
    """The experts' keys: experts per token among the experts, whole experts per data-parallel rank (expert
    parallelism splits them over dp), a capacity and a loss weight >= 0, a shared expert only beside routed ones;
    no context parallelism."""
    n, shared = m.get("num_local_experts", 0), m.get("shared_expert_intermediate_size", 0)
    if shared < 0 or (shared and n == 0):
        return [f"model.shared_expert_intermediate_size={shared}: must be >= 0, and 0 without routed experts "
                f"(model.num_local_experts={n}; a dense model's MLP is model.intermediate_size)"]
    if n == 0:
        return []
    if n < 0:
        return [f"model.num_local_experts={n}: must be >= 0 (0: the dense MLP)"]
    p = []
    if not 1 <= m.num_experts_per_tok <= n:
        p.append(f"model.num_experts_per_tok={m.num_experts_per_tok}: must be between 1 and "
                 f"model.num_local_experts={n}")
    if n % layout.dp:
        p.append(f"model.num_local_experts={n}: must divide by parallel.dp={layout.dp} (expert parallelism: whole "
                 f"experts per data-parallel rank); valid dp: {[d for d in range(1, n + 1) if n % d == 0]}")
    if not (m.capacity_factor >= 0 and m.router_aux_loss_coef >= 0):
        p.append(f"model.capacity_factor={m.capacity_factor}, model.router_aux_loss_coef="
                 f"{m.router_aux_loss_coef}: both must be >= 0 (capacity 0: no token dropped)")
    if layout.cp > 1:
        p.append(f"parallel.cp={layout.cp} with model.num_local_experts={n}: each sample's tokens take their "
                 "experts' slots in sequence order, which a sequence split over cp would gather whole on every rank; "
                 "valid: cp=1")
    return p


def problems(cfg, layout, trains_tokenizer: bool = True) -> list:
    """LLaMA's rules: dimensions, whole (key/value) heads, MLP columns and vocabulary per tp rank, then the data's."""
    p: list = []
    m, tp = cfg.model, layout.tp
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "max_position_embeddings")
    bad = [k for k in keys if m[k] < 1]
    p += [f"model.{k}={m[k]!r}: must be >= 1" for k in bad]
    if bad:
        return p
    heads, kv, head_dim = m.num_attention_heads, m.num_key_value_heads, m.get("head_dim", 0)
    if head_dim and (head_dim < 0 or head_dim % 2):
        p.append(f"model.head_dim={head_dim}: must be even and > 0 (rotary embeddings rotate pairs; 0: "
                 "model.hidden_size / model.num_attention_heads)")
    elif not head_dim and (m.hidden_size % heads or (m.hidden_size // heads) % 2):
        p.append(f"model.hidden_size={m.hidden_size}: must divide by model.num_attention_heads={heads} into an "
                 "even head dim (rotary embeddings rotate pairs), or set model.head_dim")
    if heads % kv:
        p.append(f"model.num_key_value_heads={kv}: must divide model.num_attention_heads={heads} (query heads per "
                 "key/value head)")
    if m.get("qk_norm_over", "head") not in ("head", "projection"):
        p.append(f"model.qk_norm_over={m.qk_norm_over!r}: valid: 'head' (Qwen3's norm of each query and key head) or "
                 "'projection' (OLMoE's, of the whole query and key projections)")
    if m.get("sliding_window", 0) < 0:
        p.append(f"model.sliding_window={m.sliding_window}: must be >= 0 (0: every earlier position)")
    if not m.rms_norm_eps > 0 or not m.rope_theta > 0:
        p.append(f"model.rms_norm_eps={m.rms_norm_eps}, model.rope_theta={m.rope_theta}: both must be > 0")
    if m.rope_factor != 1.0 and not (m.rope_factor > 0 and 0 < m.rope_low_freq_factor < m.rope_high_freq_factor
                                     and m.rope_original_max_position_embeddings > 0):
        p.append(f"model.rope_factor={m.rope_factor}, model.rope_low_freq_factor={m.rope_low_freq_factor}, "
                 f"model.rope_high_freq_factor={m.rope_high_freq_factor}, model.rope_original_max_position_"
                 f"embeddings={m.rope_original_max_position_embeddings}: Llama 3.1's scaling needs a factor > 0, "
                 "0 < low < high, and a context > 0")
    p += expert_problems(m, layout)
    for key, what in (("num_key_value_heads", "whole key/value heads per rank"),
                      ("intermediate_size", "MLP columns per rank"),
                      ("shared_expert_intermediate_size", "shared expert columns per rank"),
                      ("vocab_size", "vocab-parallel embedding and loss")):
        if m.get(key, 0) % tp:
            p.append(f"model.{key}={m[key]}: must divide by parallel.tp={tp} ({what}); valid tp: "
                     f"{[d for d in range(1, min(m[key], 64) + 1) if m[key] % d == 0]}")
    return p + data_problems(cfg, layout, "max_position_embeddings", trains_tokenizer)
