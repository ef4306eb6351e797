"""``python train.py recipe=wide_deep``: one command-line run shared by several assertions.

The run (dp2, a tiny MLP, planted synthetic data, clipping on, a checkpoint
every 2 steps) writes metrics.jsonl with the throughput and memory columns
and an AUC row (AUC, log loss, the planted model's Bayes AUC) at each
evaluation. Its step-2 checkpoint, resumed under dp2_tp2 on the shared rank
pool (another layout: tables split 4 ways instead of 2, the lazy Adam
pieces resharded), gives the same steps 3 and 4 and the same AUC. Bad configs fail before any
process starts.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from recipes.registry import get
from tests.cli.pooled import losses as _losses, train_pooled
from toolkit.config import ConfigError, compose, validate

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = ["recipe=wide_deep", "model=wide-deep-tiny", "data.train_rows=4096", "data.val_rows=1000",
        "trainer.global_batch_size=64", "trainer.micro_batch_size=8", "trainer.log_every=1", "trainer.eval_every=2",
        "trainer.save_every=2", "trainer.grad_clip=1.0", "trainer.max_steps=4", "trainer.peak_tflops=1",
        "logger=none"]


def _rows(run_dir) -> list:
    with open(os.path.join(str(run_dir), "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def run(tmp_path_factory, sbp_cache):
    run_dir = tmp_path_factory.mktemp("wide_deep")
    env = {**os.environ, "SBP_CACHE_DIR": sbp_cache, "HYDRA_FULL_ERROR": "1", "SBP_TIMEOUT": "120"}
    out = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), *TINY, "parallel=dp2",
                          f"hydra.run.dir={run_dir}"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return run_dir, out.stdout


def test_metrics_and_auc_rows(run):
    run_dir, stdout = run
    assert "wide_deep data: 4096 train rows, 1000 held out" in stdout
    rows = _rows(run_dir)
    train = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "auc" in r]
    assert [r["step"] for r in train] == [1, 2, 3, 4] and [r["step"] for r in evals] == [2, 4]
    for r in train:
        assert {"loss", "lr", "grad_norm", "samples_per_s", "tflops", "mfu", "mem"} <= set(r), r
        assert r["grad_norm"] > 0 and r["samples_per_s"] > 0
    for r in evals:
        assert set(r) == {"step", "auc", "logloss", "bayes_auc", "bayes_logloss"}, r
        assert 0 < r["auc"] < 1 and 0.7 < r["bayes_auc"] < 0.95 and r["logloss"] > r["bayes_logloss"] > 0


def test_resume_in_another_layout(run, sbp_cache, tmp_path):
    """The step-2 checkpoint of the dp2 run, continued under dp2_tp2, gives its steps 3-4 and final AUC; it
    holds the facts a resume is checked against (how ids hash to rows)."""
    from toolkit import checkpoint as ckpt

    run_dir, _ = run
    assert ckpt.plain_value(os.path.join(run_dir, "checkpoints", "step_2"), "facts") == {
        "model.hash_seed": 0, "model.field_vocab_sizes": None}
    shutil.copytree(os.path.join(run_dir, "checkpoints", "step_2"), tmp_path / "checkpoints" / "step_2")
    (tmp_path / "checkpoints" / "latest").write_text("step_2")
    losses = train_pooled([*TINY, "parallel=dp2_tp2", "trainer.resume=auto"], tmp_path, sbp_cache)
    want = _losses(run_dir)
    assert len(losses) == 2 and all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(losses, want[2:])), (losses, want)
    auc = [r["auc"] for r in _rows(tmp_path) if "auc" in r]
    assert abs(auc[-1] - [r["auc"] for r in _rows(run_dir) if "auc" in r][-1]) <= 1e-6


@pytest.mark.parametrize("override, message", [
    ("parallel=dp2_pp2", "not split into pipeline stages"),
    ("parallel=dp2_zero1", "parallel.zero=1: wide_deep"),
    ("trainer.precision=bf16", "runs in fp32"),
    ("trainer.optimizer=sgd", "LazyAdamW"),
    ("data.source=criteo_tsv", "needs data.path"),
    ("data.source=criteo_tsv data.path=/nonexistent/day_0.tsv", "names no file"),
    ("data.train_rows=4", "more than data.train_rows=4"),
    ("model.field_vocab_sizes=[3,4]", "give 26 sizes"),
    ("+model.hidden_size=3", "model.hidden_size"),
])
def test_bad_configs_fail_before_any_process(override, message):
    with pytest.raises(ConfigError, match=message):
        cfg = compose([*TINY, *override.split()], run_dir="/tmp/unused")
        validate(cfg, get("wide_deep"), world_size=int(cfg.parallel.dp) * int(cfg.parallel.tp) * int(cfg.parallel.pp))
