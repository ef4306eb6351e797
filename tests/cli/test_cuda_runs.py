"""Every recipe trains, evaluates, checkpoints and resumes on one GPU through ``train.py`` (``pytest -m cuda``).

These runs take the paths only CUDA takes beyond what ``scripts/gpu_check.py``
runs (which evaluates nothing): cuDNN's batch norm in InsightFace's
evaluation on global tensors, Wide&Deep's held-out rows moved to the
device and scored back on the host, the partial FC's class draw beside CUDA
labels, fused optimizers, the copy stream and the read-ahead threads; and
the LLaMA recipe's experts, post-norm layers and sliding window.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COMMON = ["trainer.max_steps=2", "trainer.log_every=1", "trainer.eval_every=2", "trainer.save_every=2",
          "trainer.peak_tflops=1", "logger=none", "device=cuda"]
CASES = {
    "gpt2": (["recipe=gpt2", "model.n_layer=2", "model.n_embd=64", "model.n_head=4", "model.vocab_size=512",
              "model.n_positions=64", "data.max_bytes=300000", "trainer.global_batch_size=8",
              "trainer.micro_batch_size=4", "trainer.precision=bf16"], "val_loss"),
    "insightface": (["recipe=insightface", "model.width=4", "model.image_size=16", "model.num_classes=10",
                     "model.head.embedding_size=16", "model.head.sample_rate=0.5",
                     "data.synthetic.images_per_identity=4", "data.synthetic.val_identities=10",
                     "data.synthetic.val_pairs=40", "trainer.global_batch_size=16"], "verify_acc"),
    "wide_deep": (["recipe=wide_deep", "model=wide-deep-tiny", "data.train_rows=4096", "data.val_rows=1000",
                   "trainer.global_batch_size=64", "trainer.micro_batch_size=32"], "auc"),
    "llama": (["recipe=llama", "model.num_hidden_layers=2", "model.hidden_size=64", "model.intermediate_size=96",
               "model.num_attention_heads=4", "model.num_key_value_heads=2", "model.vocab_size=512",
               "model.max_position_embeddings=64", "model.tie_word_embeddings=true", "data.max_bytes=300000",
               "trainer.global_batch_size=8", "trainer.micro_batch_size=4", "trainer.precision=bf16"], "val_loss"),
    # The LLaMA recipe's other kernels on CUDA, last (the step limit cuts it first): experts dispatched by
    # scatter and gather with a capacity that drops, OLMo 2's norms (over the projections, after each block) and
    # Mistral's sliding window (16 of 64 positions: a masked attention kernel, not flash).
    "llama-variants": (["recipe=llama", "model=mixtral-tiny", "model.num_hidden_layers=2", "model.hidden_size=64",
                        "model.intermediate_size=96", "model.num_attention_heads=4", "model.num_key_value_heads=2",
                        "model.vocab_size=512", "model.max_position_embeddings=64", "model.capacity_factor=1.0", "model.qk_norm=true", "model.qk_norm_over=projection",
                        "model.post_norm=true", "model.sliding_window=16", "data.max_bytes=300000",
                        "trainer.global_batch_size=8", "trainer.micro_batch_size=4", "trainer.precision=bf16"],
                       "val_loss"),
}


def _train(overrides: list, run_dir, sbp_cache: str) -> list:
    """``train.py`` on the GPU into ``run_dir``; the rows of its metrics file."""
    env = {**os.environ, "SBP_CACHE_DIR": sbp_cache, "HYDRA_FULL_ERROR": "1", "SBP_TIMEOUT": "120"}
    out = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), *overrides, f"hydra.run.dir={run_dir}"],
                         env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    with open(run_dir / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


@pytest.mark.cuda
# Wide&Deep first (the step limit of .ci/gpu cuts the last): its lazy Adam keeps row moments of its own, which a
# checkpoint loads on the host and the resume must put on the GPU.
@pytest.mark.parametrize("recipe", sorted(CASES, key=lambda r: r != "wide_deep"))
def test_a_recipe_trains_evaluates_saves_and_resumes_on_one_gpu(recipe, tmp_path, sbp_cache):
    """Two steps, an evaluation and a checkpoint; then a third step resumed from it, whose checkpoint loads
    on the host and goes back to the GPU (model, optimizer state of every kind, random state)."""
    overrides, metric = CASES[recipe]
    rows = _train([*overrides, *COMMON], tmp_path, sbp_cache)
    assert [r["step"] for r in rows if "loss" in r] == [1, 2], rows
    assert [r["step"] for r in rows if metric in r] == [2], rows
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["latest", "step_2"]
    rows = _train([*overrides, *COMMON, "trainer.max_steps=3", "trainer.resume=auto"], tmp_path, sbp_cache)
    assert [r["step"] for r in rows if "loss" in r][-1:] == [3], rows
    assert "step_3" in os.listdir(tmp_path / "checkpoints")
