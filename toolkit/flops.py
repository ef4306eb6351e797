"""Model FLOPs, achieved TFLOP/s and model FLOPs utilisation (MFU).

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

``tflops = tokens_per_s * flops_per_token / 1e12`` for the whole job;
``mfu = tflops / (peak_tflops * n_devices)`` with ``peak_tflops`` one device's
peak, given (``trainer.peak_tflops``) or measured on this machine by
:func:`measured_peak_tflops`.
"""
from __future__ import annotations

import time
from typing import Any

import torch


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

    ``n_params`` defaults to :func:`gpt2_param_count` of the config; pass the
    real model's count when it differs (e.g. a padded vocabulary is already in
    the config, so usually it does not).
    """
    if n_params is None:
        n_params = gpt2_param_count(model.vocab_size, model.n_positions, model.n_embd, model.n_layer)
    return flops_per_token(n_params, model.n_layer, model.n_head, model.n_embd // model.n_head, seq_len)


def tflops(tokens_per_s: float, flops_per_tok: float) -> float:
    """Achieved model TFLOP/s of the whole job."""
    return tokens_per_s * flops_per_tok / 1e12


def mfu(tokens_per_s: float, flops_per_tok: float, peak_tflops: float, n_devices: int = 1) -> float:
    """Model FLOPs utilisation in [0, 1]-ish: achieved TFLOP/s over ``n_devices`` devices' peak."""
    if not peak_tflops > 0:
        raise ValueError(f"peak_tflops={peak_tflops!r}: must be > 0")
    if n_devices < 1:
        raise ValueError(f"n_devices={n_devices!r}: must be >= 1")
    return tflops(tokens_per_s, flops_per_tok) / (peak_tflops * n_devices)


_PEAK_CACHE: dict = {}


def measured_peak_tflops(dtype: torch.dtype = torch.float32, device: str = "cpu", size: int | None = None,
                         repeats: int = 3) -> float:
    """Best TFLOP/s of an ``n x n`` matmul on ``device`` in ``dtype`` (``2 n³`` FLOPs per product).

    The default peak for MFU when ``trainer.peak_tflops`` is null: what this
    machine reaches with this process's thread count (``torch.get_num_threads()``),
    so on a CPU shared by several ranks it is the per-rank share. ``size``
    defaults to 1024 on CPU (about 2 GFLOP per product) and 8192 on CUDA.
    Cached per (dtype, device, size, threads) for the life of the process.
    """
    size = size or (8192 if device.startswith("cuda") else 1024)
    key = (dtype, device, size, torch.get_num_threads())
    if key in _PEAK_CACHE:
        return _PEAK_CACHE[key]
    gen = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(size, size, generator=gen).to(device=device, dtype=dtype)
    b = torch.randn(size, size, generator=gen).to(device=device, dtype=dtype)

    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)

    torch.mm(a, b)  # warm-up: kernels, thread pool, allocator
    sync()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        sync()
        best = min(best, time.perf_counter() - start)
    _PEAK_CACHE[key] = 2.0 * size ** 3 / best / 1e12
    return _PEAK_CACHE[key]
