"""A LLaMA-style decoder as plain torch modules, with ``transformers``' ``LlamaForCausalLM`` names and shapes.

``LlamaForCausalLM(LlamaConfig(...))`` has ``model.embed_tokens``,
``model.layers.{i}.input_layernorm``, ``.self_attn.{q,k,v,o}_proj``,
``.post_attention_layernorm``, ``.mlp.{gate,up,down}_proj``, ``model.norm``
and ``lm_head`` (tied to ``model.embed_tokens`` with ``tie_word_embeddings``,
as Llama 3.2 1B/3B have it), each of the same shape as Hugging Face's
(``nn.Linear`` weights are ``[out, in]``): RMSNorm, rotary position
embeddings in the rotate-half form Hugging Face's weights use, grouped-query
attention (``num_key_value_heads`` key/value heads, each shared by
``num_attention_heads / num_key_value_heads`` query heads) and a SwiGLU MLP.
Mistral's decoder is this one (Mistral 7B v0.1's with ``sliding_window``:
each query attends to that many latest positions, its own included; a
Mixtral directory may have one too), and Qwen2's is this one with
``qkv_bias``: biases on the query, key and value projections.
With experts (``moe.py``) it is Mixtral's, or Qwen2-MoE's with a shared
expert, unnormalised routing weights and ``qkv_bias``. Qwen3's is this one
with ``qk_norm`` (an RMSNorm over each query and key head, ``q_norm`` and
``k_norm``, before the rotation) and its own ``head_dim`` (heads of 128
whatever the width); Qwen3-MoE's adds experts. OLMoE's has experts and
``qk_norm`` with ``qk_norm_over="projection"``: one RMSNorm over the whole
query projection and one over the whole key projection. OLMo 2's is this one
with those norms and ``post_norm``: each layer normalises the attention's and
the MLP's outputs (``post_attention_layernorm``, ``post_feedforward_layernorm``)
before adding them to the residual stream, and has no norm at their inputs.

No communication here: parallel layouts come from a plan (``plan.py``). A
pipeline stage is this model with the modules of other stages set to
``None`` (layers of ``model.layers`` included): ``forward`` skips what is
absent, so a stage's parameter names stay the whole model's.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from recipes.gpt2.model import _generator, next_token_loss, normal_box

from .mlp import MLP
from .moe import SparseMoE


@dataclass
class LlamaConfig:
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 32
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # Llama 3.1's rotary scaling (Hugging Face's rope_type "llama3"); a factor of 1 is none.
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position_embeddings: int = 8192
    initializer_range: float = 0.02
    tie_word_embeddings: bool = False
    # Biases on the query, key and value projections (Qwen2's; its output projection has none).
    qkv_bias: bool = False
    # Mixtral's sparse MLP (moe.py) in every layer when > 0: experts, experts per token, slots per expert and
    # sample (0: room for every token), and the load-balancing loss's weight.
    num_local_experts: int = 0
    num_experts_per_tok: int = 2
    capacity_factor: float = 0.0
    router_aux_loss_coef: float = 0.001
    # Whether the chosen experts' weights are renormalised to sum to 1 (Mixtral's; Qwen2-MoE's default is not),
    # and Qwen2-MoE's shared expert beside the routed ones: a SwiGLU MLP of this size, gated (0: none).
    norm_topk_prob: bool = True
    shared_expert_intermediate_size: int = 0
    # Each attention head's size; 0: hidden_size / num_attention_heads. An RMSNorm of the queries and keys before
    # the rotation, over each head ("head", Qwen3's) or over the whole projection ("projection", OLMoE's).
    head_dim: int = 0
    qk_norm: bool = False
    qk_norm_over: str = "head"
    # OLMo 2's layer: x + norm(attention(x)), then x + norm(mlp(x)) (no input norms); else LLaMA's pre-norm one.
    post_norm: bool = False
    # Mistral's sliding window: a query attends to the keys of its latest ``sliding_window`` positions, its own
    # included (0: to every earlier position).
    sliding_window: int = 0

    @property
    def head_size(self) -> int:
        """``head_dim``, or ``hidden_size / num_attention_heads`` where it is 0."""
        return self.head_dim or self.hidden_size // self.num_attention_heads


def llama3_scaled(inv_freq: torch.Tensor, cfg: LlamaConfig) -> torch.Tensor:
    """Llama 3.1's rotary frequencies: wavelengths longer than the original context over
    ``rope_low_freq_factor`` are stretched by ``rope_factor``, those shorter than it over
    ``rope_high_freq_factor`` kept, and those between interpolated (Hugging Face's arithmetic, term by term;
    written here rather than imported from ``transformers.modeling_rope_utils``, whose function reads a
    ``PretrainedConfig``: the model file needs torch alone)."""
    old_context = cfg.rope_original_max_position_embeddings
    low, high, factor = cfg.rope_low_freq_factor, cfg.rope_high_freq_factor, cfg.rope_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_context / high) * ~(wavelen > old_context / low)
    return torch.where(medium, smoothed, scaled)


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dim, computed in at least float32 (as Hugging Face's
    for half precision; float64 stays float64). Not ``torch.nn.RMSNorm``: it computes in the input's dtype, so
    bf16 weights loaded from Hugging Face would not reproduce its outputs."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        h = x.to(torch.promote_types(x.dtype, torch.float32))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def sliding_window_mask(cos, size: int):
    """``None`` where ``size`` is 0 or covers the ``t`` positions of ``cos`` (``[t, head_dim]``): causal attention;
    else the ``[t, t]`` boolean mask of Mistral's sliding window, query ``i`` attending to keys
    ``i - size < j <= i``. Built from ``cos`` (``ones_like``) so that it takes the rotary table's layout, not a
    device's; once per forward, for every layer (SDPA turns it into an additive mask in each call, which its
    backward keeps: ``[t, t]`` per layer, docs/recipes/llama.md)."""
    t = cos.shape[0]
    if not size or size >= t:
        return None
    position = torch.ones_like(cos[:, 0], dtype=torch.int64).cumsum(0)
    query, key = position.unsqueeze(1), position.unsqueeze(0)  # [t, 1] and [1, t]: the comparisons broadcast
    return (query >= key) & (query < key + size)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        hd, nh, nkv = cfg.head_size, cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim, self.groups = hd, nh // nkv
        self.q_proj = nn.Linear(cfg.hidden_size, nh * hd, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, nkv * hd, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, nkv * hd, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(nh * hd, cfg.hidden_size, bias=False)
        if cfg.qk_norm_over not in ("head", "projection"):
            raise ValueError(f"qk_norm_over={cfg.qk_norm_over!r}: 'head' or 'projection'")
        self.per_head = cfg.qk_norm_over == "head"
        if cfg.qk_norm:
            self.q_norm = RMSNorm(hd if self.per_head else nh * hd, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(hd if self.per_head else nkv * hd, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, window=None):
        """``window``: ``None`` (causal), or a ``[t, t]`` boolean mask of the keys each query attends to."""
        b, t, _ = x.shape
        normed = hasattr(self, "q_norm")
        q, k = self.q_proj(x), self.k_proj(x)
        if normed and not self.per_head:  # OLMoE: over the whole projection (split on tp: its sum is reduced there)
            q, k = self.q_norm(q), self.k_norm(k)
        # ``-1`` heads: a tensor-parallel rank's projections hold whole heads (plan.py), so the view is local.
        q, k = q.view(b, t, -1, self.head_dim), k.view(b, t, -1, self.head_dim)
        if normed and self.per_head:  # Qwen3: each head over its own dims (one weight shared by the heads)
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if self.groups > 1:  # query heads g*i .. g*i+g-1 share key/value head i
            k = k.repeat_interleave(self.groups, dim=1)
            v = v.repeat_interleave(self.groups, dim=1)
        if window is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=window)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class DecoderLayer(nn.Module):
    """LLaMA's pre-norm layer (``input_layernorm`` before the attention, ``post_attention_layernorm`` before the
    MLP), or with ``post_norm`` OLMo 2's (``post_attention_layernorm`` after the attention,
    ``post_feedforward_layernorm`` after the MLP, each before its residual add)."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.post_norm = cfg.post_norm
        if not cfg.post_norm:
            self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.post_norm:
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SparseMoE(cfg) if cfg.num_local_experts else MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x, cos, sin, window=None):
        """The layer's output; with experts, ``(output, each sample's load-balancing loss)``. ``window``: the
        attention's (``Attention.forward``)."""
        if self.post_norm:
            x = x + self.post_attention_layernorm(self.self_attn(x, cos, sin, window=window))
        else:
            x = x + self.self_attn(self.input_layernorm(x), cos, sin, window=window)
        out = self.mlp(x if self.post_norm else self.post_attention_layernorm(x))
        y, balance = (out, None) if isinstance(self.mlp, MLP) else out
        if self.post_norm:
            y = self.post_feedforward_layernorm(y)
        return x + y if balance is None else (x + y, balance)


class LlamaModel(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """``forward(input_ids, labels=None) -> (logits, loss)``; ``loss`` is next-token cross-entropy when ``labels``
    is given.

    As a pipeline stage: without ``model.embed_tokens`` the first argument
    is the previous stage's hidden states ``[b, t, hidden_size]``; without
    ``lm_head`` it returns ``(hidden states, None)``. With experts
    (``num_local_experts > 0``) the hidden states travel with each sample's
    load-balancing loss summed over the layers so far (``[b]``), as a pair
    ``(hidden states, balance)``, and the loss is the next-token loss plus
    ``router_aux_loss_coef`` times the mean over samples and layers of the
    balance (``moe.py``) where autograd records; under ``torch.no_grad``
    (evaluation) it is the next-token loss alone. The rotary tables
    ``rope_cos``/``rope_sin`` (``[max_position_embeddings, head_dim]``,
    float32, not saved) are buffers of every stage.
    """

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()
        shape = (cfg.max_position_embeddings, cfg.head_size)
        self.register_buffer("rope_cos", torch.empty(shape), persistent=False)
        self.register_buffer("rope_sin", torch.empty(shape), persistent=False)
        self.reset_parameters()

    def tie_weights(self) -> None:
        """With ``tie_word_embeddings``, ``lm_head`` shares ``model.embed_tokens``' weight (where this model, or
        stage, holds both)."""
        if self.config.tie_word_embeddings and self.lm_head is not None and self.model.embed_tokens is not None:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.no_grad()
    def reset_parameters(self):
        """The initial value of every parameter and buffer this model, or pipeline stage of it, holds
        (``init_shard`` of the whole parameter); meta parameters and buffers are skipped."""
        for name, p in self.named_parameters():
            if not p.is_meta:
                p.copy_(self.init_shard(name, tuple((0, n) for n in p.shape)))
        self.reset_buffers()

    @torch.no_grad()
    def reset_buffers(self):
        """The rotary tables, as Hugging Face's rotary embedding computes them (float32): its default one, or
        with ``rope_factor != 1`` Llama 3.1's (``rope_type`` "llama3")."""
        if self.rope_cos.is_meta:
            return
        cfg = self.config
        exponents = torch.arange(0, cfg.head_size, 2, dtype=torch.int64).float() / cfg.head_size
        inv_freq = 1.0 / (cfg.rope_theta ** exponents)
        if cfg.rope_factor != 1.0:
            inv_freq = llama3_scaled(inv_freq, cfg)
        angles = torch.outer(torch.arange(cfg.max_position_embeddings).float(), inv_freq)
        angles = torch.cat((angles, angles), dim=-1)
        self.rope_cos.copy_(angles.cos())
        self.rope_sin.copy_(angles.sin())

    def init_shard(self, name: str, box) -> torch.Tensor:
        """The box ``((start, length), ...)`` of parameter ``name``'s initial value, on the CPU (``sbp_core``'s
        contract for a parameter left on the meta device: each rank builds only its shard).

        Norm weights are 1, biases 0; every other weight is drawn from N(0, ``initializer_range``) by a generator
        seeded from the global seed and the parameter's name alone (a tied LM head's is the embedding's;
        Hugging Face's initialisation), as the whole tensor draws it, keeping the box (``normal_box``): any
        stage, or shard of one, holds the values the whole model has on one device.
        """
        param = self.get_parameter(name)
        size = tuple(n for _, n in box)
        if name.endswith("norm.weight"):
            return torch.ones(size, dtype=param.dtype, device="cpu")
        if name.endswith(".bias"):
            return torch.zeros(size, dtype=param.dtype, device="cpu")
        if name == "lm_head.weight" and self.config.tie_word_embeddings:
            name = "model.embed_tokens.weight"
        return normal_box(tuple(param.shape), box, self.config.initializer_range, _generator(name), param.dtype)

    def forward(self, input_ids, labels=None):
        cfg, m = self.config, self.model
        experts = cfg.num_local_experts > 0
        x, balance = input_ids if isinstance(input_ids, tuple) else (input_ids, None)
        t = x.shape[1]  # the whole sequence: a peer's sequence-parallel embedding may return a shard of it
        if m.embed_tokens is not None:
            x = m.embed_tokens(x)
        cos, sin = self.rope_cos[:t].to(x.dtype), self.rope_sin[:t].to(x.dtype)
        window = sliding_window_mask(cos, cfg.sliding_window)
        for layer in m.layers:
            if layer is not None:
                x = layer(x, cos, sin, window=window)  # a keyword: module hooks see the same positional inputs
                if experts:
                    x, more = x
                    balance = more if balance is None else balance + more
        if self.lm_head is None:
            return ((x, balance) if experts else x), None
        logits = self.lm_head(m.norm(x))
        loss = None
        if labels is not None:
            loss = next_token_loss(logits, labels)
            if experts and cfg.router_aux_loss_coef and torch.is_grad_enabled():  # a training loss, not a metric
                loss = loss + cfg.router_aux_loss_coef * balance.mean() / cfg.num_hidden_layers
        return logits, loss
