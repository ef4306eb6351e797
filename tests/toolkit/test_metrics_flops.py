"""FLOPs per token, TFLOP/s, MFU and the measured peak."""
from __future__ import annotations

import pytest
import torch

from toolkit.config import compose
from recipes.gpt2.flops import flops_per_token, gpt2_param_count, model_flops_per_token
from toolkit.flops import measured_peak_tflops, mfu, tflops


def test_param_count_matches_the_model():
    from recipes.gpt2.model import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=512, n_positions=64, n_embd=32, n_layer=3, n_head=4)
    model = GPT2LMHeadModel(cfg)
    assert gpt2_param_count(512, 64, 32, 3) == sum(p.numel() for p in model.parameters())


def test_gpt2_small_is_124m():
    assert gpt2_param_count(50257, 1024, 768, 12) == 124_439_808


def test_formula():
    assert flops_per_token(100, 2, 3, 4, 5) == 6 * 100 + 12 * 2 * 3 * 4 * 5
    n = gpt2_param_count(50257, 1024, 768, 12)
    assert flops_per_token(n, 12, 12, 64, 1024) == pytest.approx(6 * n + 12 * 12 * 768 * 1024)
    with pytest.raises(ValueError, match="seq_len=0"):
        flops_per_token(1, 1, 1, 1, 0)


def test_model_flops_from_config():
    m = compose(run_dir="/tmp/run").model
    n = gpt2_param_count(8192, 256, 128, 4)
    assert model_flops_per_token(m, 256) == 6 * n + 12 * 4 * 4 * 32 * 256
    # GPT-2's preset pads 50257 tokens to 50304 rows, which the LM head computes.
    m = compose(["model=gpt2"], run_dir="/tmp/run").model
    n = gpt2_param_count(50304, 1024, 768, 12)
    assert model_flops_per_token(m, 1024) == 6 * n + 12 * 12 * 12 * 64 * 1024


def test_tflops_and_mfu():
    assert tflops(1e6, 2e6) == pytest.approx(2.0)
    assert mfu(1e6, 2e6, peak_tflops=4.0, n_devices=2) == pytest.approx(0.25)
    with pytest.raises(ValueError, match="peak_tflops"):
        mfu(1, 1, 0)


def test_measured_peak_is_plausible_and_cached():
    peak = measured_peak_tflops(torch.float32, size=256)
    assert 1e-4 < peak < 1e3
    assert measured_peak_tflops(torch.float32, size=256) == peak  # cached


def test_measured_peak_counts_two_n_cubed_per_product_per_thread_count(monkeypatch):
    """With a clock that ticks 1 s per read, each product takes 1 s: the peak is 2 n^3 FLOP/s. The cache
    keys on the thread count: another count measures again."""
    from toolkit import flops

    ticks = iter(range(10**6))
    monkeypatch.setattr(flops.time, "perf_counter", lambda: float(next(ticks)))
    monkeypatch.setattr(flops, "_PEAK_CACHE", {})
    threads = torch.get_num_threads()
    assert measured_peak_tflops(torch.float32, size=8, repeats=1) == 2 * 8**3 / 1e12
    calls = []
    monkeypatch.setattr(flops.torch, "mm", lambda a, b: calls.append(1))
    try:
        torch.set_num_threads(threads + 1)
        measured_peak_tflops(torch.float32, size=8, repeats=1)
    finally:
        torch.set_num_threads(threads)
    assert len(calls) == 2  # warm-up and one timed product: measured anew
