"""MetricsLogger: metrics.jsonl rows, console line, rank gating, W&B offline."""
from __future__ import annotations

import json
import math
import time

import pytest
import torch
from omegaconf import OmegaConf

from toolkit.metrics import MetricsLogger, peak_memory_bytes, read_metrics, wandb_mode


def cfg_with(backend="none", mode=None, name=None):
    return OmegaConf.create({"model": {"name": "gpt2-tiny"}, "parallel": {"dp": 2, "cp": 2, "tp": 1, "pp": 1, "zero": 0},
                             "logger": {"backend": backend, "project": "sbp-test", "name": name,
                                        "entity": None, "mode": mode, "tags": ["test"]}})


def test_rows_console_and_derived_fields(tmp_path, capsys):
    with MetricsLogger(tmp_path, cfg_with(), enabled=True, flops_per_item=1e6, peak_tflops=0.5,
                       n_devices=2) as log:
        row = log.log(10, loss=torch.tensor(3.25), lr=6e-4, grad_norm=0.5, tokens_per_s=2e5)
        log.log_eval(10, val_loss=2.0, val_ppl=math.exp(2.0))
    assert row["tflops"] == pytest.approx(0.2)  # 2e5 tok/s * 1e6 FLOP/tok
    assert row["mfu"] == pytest.approx(0.2)  # 0.2 / (0.5 * 2)
    rows = read_metrics(tmp_path)
    assert list(rows[0]) == ["step", "loss", "lr", "grad_norm", "tokens_per_s", "tflops", "mfu", "mem"]
    assert rows[0]["step"] == 10 and rows[0]["loss"] == 3.25 and rows[0]["mem"] > 1e6
    assert rows[1] == {"step": 10, "val_loss": 2.0, "val_ppl": pytest.approx(math.exp(2.0))}
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("step 10 | loss 3.2500 | lr 6.00e-04 | grad_norm 0.500 | 200,000 tok/s")
    assert "mfu 20.0%" in out[0] and "MiB" in out[0]
    assert out[1] == "step 10 | val_loss 2.0000 | val_ppl 7.39"


def test_non_finite_values_are_strict_json(tmp_path, capsys):
    with MetricsLogger(tmp_path, cfg_with(), enabled=True) as log:
        log.log(1, loss=float("nan"), mem=5)
        log.log_eval(1, val_loss=1e9, val_ppl=float("inf"))
    text = (tmp_path / "metrics.jsonl").read_text()
    assert "NaN" not in text and "Infinity" not in text
    rows = [json.loads(line) for line in text.splitlines()]
    assert rows[0] == {"step": 1, "loss": None, "mem": 5} and rows[1]["val_ppl"] is None
    assert "loss nan" in capsys.readouterr().out


def test_disabled_logger_writes_nothing(tmp_path):
    log = MetricsLogger(tmp_path / "run", cfg_with("wandb"), enabled=False)
    assert log.log(1, loss=1.0) is None and log.log_eval(1, val_loss=1.0) is None
    log.close()
    assert not (tmp_path / "run").exists()


def test_enabled_defaults_to_rank_zero(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    assert not MetricsLogger(tmp_path, cfg_with()).enabled
    monkeypatch.setenv("RANK", "0")
    log = MetricsLogger(tmp_path, cfg_with())
    assert log.enabled
    log.close()


def test_appends_across_loggers(tmp_path):
    for step in (1, 2):
        with MetricsLogger(tmp_path, cfg_with(), enabled=True, console=False) as log:
            log.log(step, loss=1.0)
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]


def test_bad_values_and_backend(tmp_path):
    with MetricsLogger(tmp_path, cfg_with(), enabled=True, console=False) as log:
        with pytest.raises(TypeError, match="not loggable"):
            log.log(1, loss=[1.0])
    with pytest.raises(ValueError, match="valid: wandb, none"):
        MetricsLogger(tmp_path, cfg_with("tensorboard"), enabled=True)


@pytest.mark.cuda
def test_a_jobs_peak_memory_starts_at_its_build():
    """``train`` resets the CUDA peak first: a later job in the process does not report an earlier one's."""
    from toolkit.metrics import reset_peak_memory

    big = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    del big
    reset_peak_memory()
    small = torch.empty(2**20, dtype=torch.uint8, device="cuda")
    assert peak_memory_bytes() < 128 * 2**20
    del small


def test_peak_memory_is_bytes():
    before = peak_memory_bytes()
    block = torch.ones(64 * 2**20 // 4)  # 64 MiB touched
    assert peak_memory_bytes() >= before and peak_memory_bytes() > 64 * 2**20
    del block


def test_wandb_mode(monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    assert wandb_mode(None) == "offline"
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert wandb_mode(None) == "online"
    assert wandb_mode("disabled") == "disabled"


def test_wandb_offline_run(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    start = time.monotonic()
    log = MetricsLogger(tmp_path, cfg_with("wandb"), enabled=True, console=False)
    init_s = time.monotonic() - start
    try:
        assert log.wandb_run is not None and log.wandb_run.name == "gpt2-tiny_dp2_cp2"
        assert log.wandb_run.config["parallel"]["dp"] == 2
        log.log(1, loss=2.5, lr=1e-3)
        log.log_eval(1, val_loss=2.4)
    finally:
        log.close()
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and any(runs[0].glob("*.wandb"))
    assert init_s < 20, f"wandb.init took {init_s:.1f} s"


def test_an_explicit_mfu_or_tflops_is_kept(tmp_path):
    log = MetricsLogger(tmp_path, {"logger": {"backend": "none"}}, enabled=True, flops_per_item=1e6,
                        peak_tflops=1.0, console=False)
    row = log.log(1, tokens_per_s=1000.0, mfu=0.5, mem=0)
    assert row["mfu"] == 0.5 and row["tflops"] == pytest.approx(1e-3)
    assert log.log(2, tokens_per_s=1000.0, tflops=7.0, mem=0)["tflops"] == 7.0
