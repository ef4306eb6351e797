"""``python train.py recipe=insightface``: one tiny dp2 run, its metrics and evaluations, and a resume on 5 ranks.

One ``train.py`` subprocess (dp2, 4 steps, a checkpoint every 2, verification
every 2) on a tiny synthetic set; then its step-2 checkpoint is resumed in
another layout, dp5 on the shared rank pool (``toolkit.trainer.train`` in
process), whose steps 3 and 4 must give the straight run's losses (the
batch is the same global batch, batch norm and the class-split softmax are
exact in any layout).
"""
from __future__ import annotations

import json
import os
import shutil

import pytest
from omegaconf import OmegaConf

from tests.cli.test_train_cli import _train
from toolkit.rank_pool import get_pool

TINY = ["recipe=insightface", "parallel=dp2", "model.width=4", "model.image_size=16", "model.num_classes=10",
        "model.head.embedding_size=16", "data.synthetic.images_per_identity=4", "data.synthetic.val_identities=10",
        "data.synthetic.val_pairs=40", "trainer.global_batch_size=20", "trainer.micro_batch_size=10",
        "trainer.max_steps=4", "trainer.warmup_steps=2", "trainer.save_every=2", "trainer.eval_every=2",
        "trainer.log_every=1", "trainer.peak_tflops=1.0", "logger=none"]


def _rows(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def run(tmp_path_factory, sbp_cache):
    run_dir = str(tmp_path_factory.mktemp("insightface"))
    out = _train([*TINY, f"hydra.run.dir={run_dir}"], sbp_cache)
    assert out.returncode == 0, out.stderr[-3000:]
    return run_dir


def test_metrics_and_verification_rows(run):
    rows = _rows(run)
    train = [r for r in rows if "loss" in r]
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    assert all({"lr", "grad_norm", "images_per_s", "tflops", "mfu"} <= set(r) for r in train), train[0]
    evals = [r for r in rows if "verify_acc" in r]
    assert [r["step"] for r in evals] == [2, 4]
    assert all(0.0 <= r["verify_acc"] <= 1.0 and 0.0 <= r["tar_at_far_1e-3"] <= 1.0 for r in evals), evals
    assert sorted(os.listdir(os.path.join(run, "checkpoints"))) == ["latest", "step_2", "step_4"]


def _resume(cfg: dict):
    from recipes.registry import get
    from toolkit.trainer import train

    return train(OmegaConf.create(cfg), get("insightface"))


def test_resume_in_another_layout(run, tmp_path):
    half = tmp_path / "half"
    shutil.copytree(os.path.join(run, "checkpoints", "step_2"), half / "checkpoints" / "step_2")
    (half / "checkpoints" / "latest").write_text("step_2")
    cfg = OmegaConf.to_container(OmegaConf.load(os.path.join(run, "config.yaml")))
    cfg["parallel"].update(dp=5, tp=1, pp=1)
    cfg["trainer"].update(resume="auto", micro_batch_size=4)
    cfg["run_dir"] = str(half)
    get_pool(5).run(_resume, cfg)
    straight = {r["step"]: r["loss"] for r in _rows(run) if "loss" in r}
    resumed = {r["step"]: r["loss"] for r in _rows(half) if "loss" in r}
    assert sorted(resumed) == [3, 4]
    assert all(abs(resumed[s] - straight[s]) <= 1e-4 * abs(straight[s]) for s in (3, 4)), (resumed, straight)
