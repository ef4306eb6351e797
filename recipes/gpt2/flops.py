"""GPT-2's parameter count and training FLOPs per token (for TFLOP/s and MFU: ``toolkit.flops``).

FLOPs per token (forward + backward) follow PaLM's appendix B:

    flops_per_token = 6 * N + 12 * L * H * Q * T

- ``N``: the model's parameter count, *all* of it (token and position
  embeddings included, the tied ``lm_head`` counted once, as
  ``sum(p.numel() for p in model.parameters())`` counts it). PaLM uses the
  non-embedding count; counting every parameter makes MFU slightly higher
  for small models (for gpt2-tiny the embeddings are ~1/3 of ``N``).
- ``L`` layers, ``H`` heads, ``Q`` head dimension, ``T`` sequence length: the
  ``12·L·H·Q·T`` term is attention's ``QK^T`` and ``AV`` matmuls (2 × 2·T·H·Q
  per token per layer forward, times 3 for forward + backward).

Recomputation (activation checkpointing) is not counted: MFU counts the
model's FLOPs, not the hardware's.
"""
from __future__ import annotations

from typing import Any

from .model import padded_vocab_size


def gpt2_param_count(vocab_size: int, n_positions: int, n_embd: int, n_layer: int) -> int:
    """Parameters of ``recipes.gpt2.model.GPT2LMHeadModel`` (tied lm_head counted once).

    Per block: two LayerNorms (4C), c_attn (3C²+3C), attn c_proj (C²+C),
    c_fc (4C²+4C), mlp c_proj (4C²+C) -> 12C² + 13C. Plus wte (V·C), wpe (P·C)
    and ln_f (2C). GPT-2 small: 124,439,808.
    """
    c = n_embd
    return vocab_size * c + n_positions * c + n_layer * (12 * c * c + 13 * c) + 2 * c


def flops_per_token(n_params: int, n_layer: int, n_head: int, head_dim: int, seq_len: int) -> float:
    """Training FLOPs per token: ``6 * n_params + 12 * n_layer * n_head * head_dim * seq_len``."""
    for name, value in (("n_params", n_params), ("n_layer", n_layer), ("n_head", n_head),
                        ("head_dim", head_dim), ("seq_len", seq_len)):
        if value < 1:
            raise ValueError(f"{name}={value!r}: must be a positive count")
    return 6.0 * n_params + 12.0 * n_layer * n_head * head_dim * seq_len


def model_flops_per_token(model: Any, seq_len: int, n_params: int | None = None) -> float:
    """FLOPs per token for a ``model`` config node (``cfg.model``) at ``seq_len`` tokens.

    ``n_params`` defaults to :func:`gpt2_param_count` of the config, with
    the padded vocabulary's rows (``make_vocab_size_divisible_by``): the LM
    head's matmul computes them, as Megatron counts them.
    """
    if n_params is None:
        rows = padded_vocab_size(model.vocab_size, model.get("make_vocab_size_divisible_by", 1))
        n_params = gpt2_param_count(rows, model.n_positions, model.n_embd, model.n_layer)
    return flops_per_token(n_params, model.n_layer, model.n_head, model.n_embd // model.n_head, seq_len)
