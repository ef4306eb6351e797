"""MFU's denominator: the override, the datasheet table by device name, a measurement otherwise; never >100%."""
from __future__ import annotations

import json

import pytest
import torch

from toolkit import peak
from toolkit.metrics import MetricsLogger


@pytest.mark.parametrize("name,precision,want", [
    ("NVIDIA H100 80GB HBM3", "bf16", 989.4),
    ("NVIDIA H100 PCIe", "bf16", 756.5),
    ("NVIDIA H100 NVL", "bf16", 835.5),
    ("NVIDIA H200 NVL", "tf32", 417.5),
    ("NVIDIA H200", "fp16", 989.4),
    ("NVIDIA A100-SXM4-80GB", "tf32", 156.0),
    ("NVIDIA A10", "bf16", 125.0),
    ("Tesla V100-SXM2-32GB", "fp16", 125.0),
    ("Tesla T4", "fp32", 8.1),
    ("Tesla V100-SXM2-32GB", "bf16", None),  # no bf16 there: measured instead
    ("Some Future GPU", "bf16", None),
])
def test_the_table_matches_the_most_specific_name(name, precision, want):
    assert peak.table_peak(name, precision) == want


def test_fp32_on_cuda_counts_as_tf32_only_when_torch_allows_it():
    was = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert peak.cuda_precision("fp32") == "fp32"
        torch.set_float32_matmul_precision("high")
        assert peak.cuda_precision("fp32") == "tf32"
        assert peak.cuda_precision("bf16") == "bf16"
    finally:
        torch.set_float32_matmul_precision(was)


def test_the_override_wins_and_cpu_measures(monkeypatch):
    assert peak.device_peak("cuda", "bf16", 123.0) == (123.0, "trainer.peak_tflops")
    monkeypatch.setattr(peak.flops, "measured_peak_tflops", lambda *a, **k: 0.5)
    assert peak.device_peak("cpu", "bf16") == (0.5, "cpu fp32 matmul, measured")


def test_cuda_reads_the_device_name_then_measures_what_the_table_lacks(monkeypatch):
    seen = []
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Tesla V100-SXM2-16GB")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(peak.flops, "measured_peak_tflops", lambda dtype, device: seen.append((dtype, device)) or 77.0)
    assert peak.device_peak("cuda", "fp16").tflops == 125.0
    assert peak.device_peak("cuda", "bf16") == (77.0, "Tesla V100-SXM2-16GB bf16 matmul, measured")
    assert seen == [(torch.bfloat16, "cuda:0")]
    # fp32 with TF32 allowed: a V100 has no TF32 row, so its float32 matmul is measured.
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "high")
    assert peak.device_peak("cuda", "fp32") == (77.0, "Tesla V100-SXM2-16GB tf32 matmul, measured")
    assert seen[-1] == (torch.float32, "cuda:0")


def test_an_mfu_above_100_percent_is_left_out_with_a_warning(tmp_path, capsys):
    with MetricsLogger(tmp_path, {"logger": {"backend": "none"}}, enabled=True, flops_per_item=1e6,
                       peak_tflops=1.0, throughput_key="tokens_per_s") as log:
        low = log.log(1, loss=1.0, tokens_per_s=5e5)  # 0.5 TFLOP/s of 1: 50%
        high = log.log(2, loss=1.0, tokens_per_s=5e6)  # 5 TFLOP/s of 1: a wrong peak
        log.log(3, loss=1.0, tokens_per_s=5e6)
    assert low["mfu"] == pytest.approx(0.5) and high["mfu"] is None
    out = capsys.readouterr().out
    assert out.count("MFU would read 500%") == 1 and "mfu 500" not in out
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["mfu"] for r in rows] == [pytest.approx(0.5), None, None]
