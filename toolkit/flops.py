"""Achieved TFLOP/s and model FLOPs utilisation (MFU), for any recipe.

A recipe states its training FLOPs per throughput item
(``Recipe.flops_per_item``: per token for GPT-2, per image for
InsightFace); ``tflops = items_per_s * flops_per_item / 1e12`` for the
whole job and ``mfu = tflops / (peak_tflops * n_devices)`` with
``peak_tflops`` one device's peak, given (``trainer.peak_tflops``) or
measured on this machine by :func:`measured_peak_tflops`.
"""
from __future__ import annotations

import time
import torch


def tflops(items_per_s: float, flops_per_item: float) -> float:
    """Achieved model TFLOP/s of the whole job."""
    return items_per_s * flops_per_item / 1e12


def mfu(items_per_s: float, flops_per_item: float, peak_tflops: float, n_devices: int = 1) -> float:
    """Model FLOPs utilisation in [0, 1]-ish: achieved TFLOP/s over ``n_devices`` devices' peak."""
    if not peak_tflops > 0:
        raise ValueError(f"peak_tflops={peak_tflops!r}: must be > 0")
    if n_devices < 1:
        raise ValueError(f"n_devices={n_devices!r}: must be >= 1")
    return tflops(items_per_s, flops_per_item) / (peak_tflops * n_devices)


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
