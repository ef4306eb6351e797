"""``recipe=insightface`` jobs: one tiny dp2 run (metrics, verification rows, checkpoints), resumed on dp4.

Both run the ranks' side of ``train.py`` on the shared rank pool
(``tests.cli.pooled``) on a tiny synthetic set: dp2, 4 steps, a checkpoint
and a verification every 2. Its step-2 checkpoint is then resumed in another
layout, dp4, whose steps 3 and 4 must give the straight run's losses (the
same global batch; batch norm and the class-split softmax are exact in any
layout).
"""
from __future__ import annotations

import json
import os
import shutil

import pytest

from tests.cli.pooled import losses, train_pooled

TINY = ["recipe=insightface", "model.width=4", "model.image_size=16", "model.num_classes=10",
        "model.head.embedding_size=16", "data.synthetic.images_per_identity=4", "data.synthetic.val_identities=10",
        "data.synthetic.val_pairs=40", "trainer.global_batch_size=16", "trainer.max_steps=4",
        "trainer.warmup_steps=2", "trainer.save_every=2", "trainer.eval_every=2", "trainer.log_every=1",
        "trainer.peak_tflops=1.0", "logger=none"]


@pytest.fixture(scope="module")
def run(tmp_path_factory, sbp_cache):
    run_dir = tmp_path_factory.mktemp("insightface")
    train_pooled([*TINY, "parallel=dp2", "trainer.micro_batch_size=8"], run_dir, sbp_cache)
    return run_dir


def test_metrics_and_verification_rows(run):
    with open(os.path.join(run, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    train = [r for r in rows if "loss" in r]
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    assert all({"lr", "grad_norm", "images_per_s", "tflops", "mfu"} <= set(r) for r in train), train[0]
    evals = [r for r in rows if "verify_acc" in r]
    assert [r["step"] for r in evals] == [2, 4]
    assert all(0.0 <= r["verify_acc"] <= 1.0 and 0.0 <= r["tar_at_far_1e-3"] <= 1.0 for r in evals), evals
    assert sorted(os.listdir(os.path.join(run, "checkpoints"))) == ["latest", "step_2", "step_4"]


def test_resume_in_another_layout(run, tmp_path, sbp_cache):
    shutil.copytree(os.path.join(run, "checkpoints", "step_2"), tmp_path / "checkpoints" / "step_2")
    (tmp_path / "checkpoints" / "latest").write_text("step_2")
    resumed = train_pooled([*TINY, "parallel=dp4", "trainer.micro_batch_size=4", "trainer.resume=auto"], tmp_path,
                           sbp_cache)
    straight = losses(run)
    assert len(resumed) == 2, resumed  # steps 3 and 4
    assert all(abs(a - b) <= 1e-4 * abs(b) for a, b in zip(resumed, straight[2:])), (resumed, straight)


def test_partial_fc_resumes_the_draws_of_the_straight_run(tmp_path, sbp_cache):
    """Partial FC (100 classes, sample_rate 0.2: shards of 50 draw negatives beside a batch's positives) on
    dp2: resumed from step 2 under ZeRO-1 (the backbone's momentum sharded over dp, Partial FC's SGD stepping
    the sampled rows of its class shard), steps 3 and 4 draw the straight run's samples (the draw counter is
    checkpointed; restarted at 0 they gave other losses) and give its losses."""
    pfc = [*TINY, "model.num_classes=100", "model.head.sample_rate=0.2", "parallel=dp2",
           "trainer.micro_batch_size=8", "trainer.eval_every=0"]
    straight = train_pooled(pfc, tmp_path / "straight", sbp_cache)
    resumed_dir = tmp_path / "resumed"
    shutil.copytree(tmp_path / "straight" / "checkpoints" / "step_2", resumed_dir / "checkpoints" / "step_2")
    (resumed_dir / "checkpoints" / "latest").write_text("step_2")
    resumed = train_pooled([*pfc, "parallel.zero=1", "trainer.resume=auto"], resumed_dir, sbp_cache)
    assert len(straight) == 4 and len(resumed) == 2, (straight, resumed)
    assert all(abs(a - b) <= 1e-6 * abs(b) for a, b in zip(resumed, straight[2:])), (resumed, straight)
