"""Every layout's per-step losses equal ``single``'s; ``python train.py`` as users type it; bad configs fail first.

A tiny GPT-2 on a small slice of the stdlib corpus, 3 steps, dropout 0, the
same global batch in every layout. The tokenizer and token files are built
once into a per-session sbp_cache (``SBP_CACHE_DIR``) and shared by all runs.
Layouts run on the shared rank pool (``tests.cli.pooled``: the ranks' side
of train.py); the command line itself runs for a sweep, the 16-process
``dp2_tp4_pp2`` layout and config errors.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.cli.pooled import losses as _losses, train_pooled

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = ["model.n_layer=4", "model.n_embd=64", "model.n_head=4", "model.vocab_size=512", "model.n_positions=64",
        "data.max_bytes=300000", "trainer.global_batch_size=16", "trainer.micro_batch_size=2",
        "trainer.max_steps=3", "trainer.log_every=1", "trainer.eval_every=0", "logger=none",
        "trainer.peak_tflops=1"]


def _train(args, cache, timeout=600):
    env = {**os.environ, "SBP_CACHE_DIR": cache, "HYDRA_FULL_ERROR": "1", "SBP_TIMEOUT": "120"}
    return subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="session")
def single(single_run):
    return single_run[1]


# dp2 with 16 KiB gradient buckets: many collectives overlapping backward instead of one; dp2_tp2 with
# sequence parallelism: LayerNorm gradients partial on both axes, boxed in coalesced rounds, in small buckets
@pytest.mark.parametrize("layout", ["dp2 parallel.bucket_mb=0.015625", "tp2", "pp2", "dp2_tp2_pp2", "dp2_pp2_zero2",
                                    "dp2_tp2_zero3",
                                    "dp2_tp2 parallel.sequence_parallel=true parallel.bucket_mb=0.015625",
                                    # context parallel: the position embedding's gradient comes back split on cp
                                    # (ZeRO-1 reduces it); cp2 x tp2 sequence-parallel: benchkit/parity.py
                                    "dp2_cp2_zero1 trainer.micro_batch_size=1"])
def test_layout_losses_equal_single(layout, single, sbp_cache, tmp_path):
    layout, *options = layout.split()
    losses = train_pooled([*TINY, f"parallel={layout}", *options], tmp_path, sbp_cache)
    assert len(losses) == 3
    for a, b in zip(losses, single):
        assert abs(a - b) <= 1e-4 * abs(b), (layout, losses, single)


def test_fine_tuning_a_hugging_face_gpt2_is_the_same_in_every_layout(single_run, sbp_cache, tmp_path):
    """``trainer.init_from=<a GPT2LMHeadModel directory>``: single and dp2_tp2_pp2 (each rank reading its boxes:
    ``c_attn``'s columns of its heads in our per-head order, its vocabulary rows, the last stage's LM head from
    the embedding) start from its weights, not the seed's, and log the same losses."""
    import shutil

    transformers = pytest.importorskip("transformers")
    import torch

    torch.manual_seed(5)
    hf = tmp_path / "hf"
    transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=512, n_positions=64, n_embd=64, n_layer=4, n_head=4, initializer_range=0.2)).save_pretrained(hf)
    shutil.copyfile(single_run[0] / "tokenizer.json", hf / "tokenizer.json")  # the corpus's token ids
    tuned = [*TINY, f"trainer.init_from={hf}", "model.dropout=0.0"]
    alone = train_pooled([*tuned, "parallel=single"], tmp_path / "single", sbp_cache)
    split = train_pooled([*tuned, "parallel=dp2_tp2_pp2"], tmp_path / "split", sbp_cache)
    assert abs(alone[0] - single_run[1][0]) > 0.1, alone
    for a, b in zip(split, alone):
        assert abs(a - b) <= 1e-4 * abs(b), (split, alone)


def test_steps_between_log_steps_keep_the_loss_on_the_last_stage(single, sbp_cache, tmp_path):
    """pp2, logging steps 1 and 3: step 2 does not send its loss to rank 0; the logged losses are single's."""
    losses = train_pooled([*TINY, "parallel=pp2", "trainer.log_every=3"], tmp_path, sbp_cache)
    assert len(losses) == 2
    for a, b in zip(losses, single[::2]):
        assert abs(a - b) <= 1e-4 * abs(b), (losses, single)


def test_sixteen_processes_from_the_command_line(single, sbp_cache, tmp_path):
    """``python train.py parallel=dp2_tp4_pp2``: train.py spawns 16 ranks itself; losses equal single's."""
    out = _train([*TINY, "parallel=dp2_tp4_pp2", f"hydra.run.dir={tmp_path}"], sbp_cache)
    assert out.returncode == 0, out.stderr[-3000:]
    losses = _losses(tmp_path)
    assert len(losses) == 3 and all(abs(a - b) <= 1e-4 * abs(b) for a, b in zip(losses, single)), (losses, single)


@pytest.mark.parametrize("layout, option, tolerance", [
    ("tp2_pp2", "trainer.activation_checkpointing=true", 1e-4), ("tp2_pp2", "trainer.precision=bf16", 2e-2),
    # pp4: one-device stages run on plain tensors; checkpointed layers recompute in backward on them too
    ("pp4", "trainer.activation_checkpointing=true", 1e-4),
    # ZeRO-3: checkpointed layers gather their weights again in backward, outside the units' gathers
    ("dp2_tp2_zero3", "trainer.activation_checkpointing=true", 1e-4)])
def test_activation_checkpointing_and_bf16_under_pipelines_and_zero3(layout, option, tolerance, single, sbp_cache, tmp_path):
    losses = train_pooled([*TINY, f"parallel={layout}", option], tmp_path, sbp_cache)
    assert len(losses) == 3 and all(abs(a - b) <= tolerance * abs(b) for a, b in zip(losses, single)), (losses, single)


@pytest.mark.parametrize("options", [
    "parallel=pp2 parallel.pp_virtual=2",  # interleaved 1F1B
    "parallel=dp2_pp2_zero1 parallel.pp_virtual=2",
    "parallel=dp2_pp2_zero2 parallel.pp_schedule=zb",
    "parallel=dp2_pp2_zero1 parallel.pp_schedule=zb parallel.pp_virtual=2",  # interleaved zero bubble
    "parallel=dp2_pp2_zero3 parallel.pp_schedule=zbv parallel.pp_virtual=2",  # the tied copies on one rank
    "parallel=tp2_pp2 parallel.pp_schedule=zb trainer.activation_checkpointing=true",
    "parallel=tp2_pp2 parallel.pp_schedule=zbv parallel.pp_virtual=2 trainer.activation_checkpointing=true",
    "parallel=pp2 parallel.pp_schedule=looped_bfs parallel.pp_virtual=2",
])
def test_virtual_and_zero_bubble_schedules_equal_single(options, single, sbp_cache, tmp_path):
    losses = train_pooled([*TINY, *options.split()], tmp_path, sbp_cache)
    assert len(losses) == 3 and all(abs(a - b) <= 1e-4 * abs(b) for a, b in zip(losses, single)), (losses, single)


# pp2: two one-device stages, each forward compiled; the second's input is the boundary's leaf. With
# pp_virtual=2 each rank compiles the views of its two stages; with activation checkpointing, the
# checkpointed blocks (torch.compile traces checkpoint only without a context_fn).
@pytest.mark.parametrize("layout", ["parallel=pp2", "parallel=pp2 parallel.pp_virtual=2",
                                    "parallel=pp2 trainer.activation_checkpointing=true"])
def test_compiled_stage_forwards_agree_with_eager(layout, single, sbp_cache, tmp_path):
    losses = train_pooled([*TINY, *layout.split(), "trainer.compile=true"], tmp_path, sbp_cache)
    assert len(losses) == 3 and all(abs(a - b) <= 1e-3 * abs(b) for a, b in zip(losses, single)), (losses, single)


def test_multirun_sweeps_layouts_into_one_directory_each(single, sbp_cache, tmp_path):
    out = _train(["-m", *TINY, "parallel=single,dp2", f"hydra.sweep.dir={tmp_path}"], sbp_cache)
    assert out.returncode == 0, out.stderr[-3000:]
    for job in ("0", "1"):
        losses = _losses(tmp_path / job)
        assert all(abs(a - b) <= 1e-4 * abs(b) for a, b in zip(losses, single)), (job, losses, single)
        assert (tmp_path / job / "config.yaml").exists()


@pytest.mark.parametrize("override, message", [
    # One error of validation, one of composition; test_config*.py hold every rule's message.
    ("parallel=tp3", "model.n_head=4: must divide by parallel.tp=3"),
    ("trainer.nonsense=1", "nonsense"),
])
def test_config_errors_stop_before_any_process_starts(override, message, sbp_cache, tmp_path):
    out = _train([*TINY, override, f"hydra.run.dir={tmp_path}"], sbp_cache, timeout=120)
    assert out.returncode != 0 and message in out.stderr + out.stdout, (out.stderr[-2000:])
    assert not (tmp_path / "metrics.jsonl").exists()
