"""Resuming is exact: N steps straight equal N/2, stop, resume, N/2 — in the same layout and in another.

The jobs run on the shared rank pool (``tests.cli.pooled``): the ranks' side
of ``python train.py ... trainer.resume=auto``.
"""
from __future__ import annotations

import shutil

import pytest

from tests.cli.pooled import train_pooled
from tests.cli.test_train_cli import TINY

STEPS = [a for a in TINY if not a.startswith("trainer.max_steps")]


def _run(sbp_cache, run_dir, layout, steps, resume=False):
    args = [*STEPS, f"parallel={layout}", f"trainer.max_steps={steps}"]
    return train_pooled(args + (["trainer.resume=auto"] if resume else []), run_dir, sbp_cache)


@pytest.fixture(scope="module")
def straight(tmp_path_factory, sbp_cache):
    return _run(sbp_cache, tmp_path_factory.mktemp("straight"), "dp2_tp2_pp2", 4)


def test_same_layout_resume_is_bit_identical(straight, sbp_cache, tmp_path):
    _run(sbp_cache, tmp_path, "dp2_tp2_pp2", 2)
    shutil.copytree(tmp_path, tmp_path.parent / "half", dirs_exist_ok=True)
    losses = _run(sbp_cache, tmp_path, "dp2_tp2_pp2", 4, resume=True)
    assert losses == straight

    # The same checkpoint, resumed on one process.
    other = _run(sbp_cache, tmp_path.parent / "half", "single", 4, resume=True)
    assert other[:2] == straight[:2]
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(other[2:], straight[2:])), (other, straight)


def test_single_to_tp2_resume(straight, sbp_cache, tmp_path):
    _run(sbp_cache, tmp_path, "single", 2)
    losses = _run(sbp_cache, tmp_path, "tp2", 4, resume=True)
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(losses, straight)), (losses, straight)


def _loss_scale(run_dir, step):
    from toolkit import checkpoint as ckpt

    return ckpt.load(str(run_dir / "checkpoints" / f"step_{step}"), {"loss_scale": None})["loss_scale"]


def test_fp16_trains_and_resumes_its_loss_scale(sbp_cache, tmp_path):
    fp16 = ["trainer.precision=fp16", "trainer.save_every=2"]
    first = train_pooled([*STEPS, "parallel=dp2", "trainer.max_steps=2", *fp16], tmp_path, sbp_cache)
    assert _loss_scale(tmp_path, 2) == {"scale": 2.0**16, "growth_tracker": 2}
    losses = train_pooled([*STEPS, "parallel=dp2", "trainer.max_steps=4", "trainer.resume=auto", *fp16],
                          tmp_path, sbp_cache)
    # Two clean steps more: the tracker counts on from the checkpoint's 2, not from a fresh 0.
    assert _loss_scale(tmp_path, 4) == {"scale": 2.0**16, "growth_tracker": 4}
    assert losses[:2] == first and len(losses) == 4 and losses[-1] < losses[0]


def test_virtual_stages_resume_under_another_schedule(straight, sbp_cache, tmp_path):
    """Interleaved 1F1B (two stages per rank) saves; ZB-V (the first and last stage on one rank) resumes."""
    train_pooled([*STEPS, "parallel=pp2", "parallel.pp_virtual=2", "trainer.max_steps=2"], tmp_path, sbp_cache)
    losses = train_pooled([*STEPS, "parallel=pp2", "parallel.pp_schedule=zbv", "parallel.pp_virtual=2",
                           "trainer.max_steps=4", "trainer.resume=auto"], tmp_path, sbp_cache)
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(losses, straight)), (losses, straight)


def test_resume_with_dropout_draws_the_masks_and_rates_it_would_have_drawn(sbp_cache, tmp_path):
    """Dropout on: the resumed steps' masks come from the checkpoint's RNG state, and their learning rates
    from its schedule (step 5's loss is the first to see the second update after the resume), so the
    losses are bit for bit those of the run that never stopped."""
    drop = [*STEPS, "parallel=single", "model.dropout=0.1"]
    straight = train_pooled([*drop, "trainer.max_steps=5"], tmp_path / "straight", sbp_cache)
    train_pooled([*drop, "trainer.max_steps=2"], tmp_path / "half", sbp_cache)
    resumed = train_pooled([*drop, "trainer.max_steps=5", "trainer.resume=auto"], tmp_path / "half", sbp_cache)
    assert resumed == straight, (resumed, straight)
