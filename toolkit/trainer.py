"""The training loop every recipe shares; runs on every rank of a launched job.

``train(cfg, recipe)``:

1. lays out the job: one ``(dp, tp)`` placement per pipeline stage
   (``toolkit.mesh``); this rank's stage and data-parallel index;
2. prepares the data (tokenizer and token files, built once and cached) and
   this rank's micro-batches (``toolkit.data.MicroBatches``: a
   deterministic, resumable sampler sharded over dp);
3. builds the full model from the seed, keeps this rank's stage
   (``toolkit.stages``), gives it the recipe's plan (``distribute_module``),
   optionally activation checkpointing; AdamW with warmup + cosine;
4. runs each step as actors (``runtime.pipeline.PipelineStep``, also for
   ``pp = 1``): micro-batches through the runtime data pipeline, forward and
   backward, one gradient reduction, global-norm clipping, the update;
5. logs loss, lr, grad norm, tokens/s, TFLOP/s, MFU and peak memory
   (``toolkit.metrics``: console, ``metrics.jsonl``, W&B on rank 0) and
   evaluates periodically (validation loss and perplexity);
6. checkpoints every ``trainer.save_every`` steps and at the end, resumes
   with ``trainer.resume=auto``, starts from ``trainer.init_from`` weights
   (``toolkit.run_state``).

Returns the last logged row on rank 0 (``None`` elsewhere).
"""
from __future__ import annotations

import contextlib
import os
import time

import torch
import torch.distributed as dist

import sbp_core as sc
from runtime.pipeline import PipelineConfig, PipelineStep
from toolkit import flops, run_state
from toolkit.config import validate
from toolkit.data import MicroBatches, prepare
from toolkit.mesh import plan_for_module, stage_placements
from toolkit.metrics import MetricsLogger
from toolkit.optim import build_optimizer, build_scheduler, lr_at
from toolkit.stages import keep_stage, stage_ranges


def _progress(total: int, initial: int, enabled: bool):
    if not enabled:
        return contextlib.nullcontext(None)
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, leave=False)


class Job:
    """One rank's share of a training job: its stage module, optimizer, data and pipelined step."""

    def __init__(self, cfg, recipe, zero=None):
        self.cfg, self.recipe = cfg, recipe
        self.layout = lay = validate(cfg, world_size=dist.get_world_size())
        self.rank = rank = dist.get_rank()
        tr = cfg.trainer
        device_type = "cuda" if lay.device == "cuda" else "cpu"
        self.placements = stage_placements(lay.dp, lay.tp, lay.pp, device_type)
        self.stage = rank // (lay.dp * lay.tp)
        self.dp_rank = (rank % (lay.dp * lay.tp)) // lay.tp
        d = cfg.data
        self.data = prepare(d.path if d.source == "text" else d.source, int(d.vocab_size), int(d.seq_len),
                            float(d.val_fraction), os.path.expanduser(str(d.cache_dir)),
                            max_bytes=d.max_bytes, seed=int(tr.seed), tokenizer=d.tokenizer, text_field=d.text_field)
        self.train_batches = MicroBatches.from_prepared(self.data, "train", lay.global_batch_size, int(tr.seed),
                                                        lay.accumulation, lay.dp, self.dp_rank)
        torch.manual_seed(int(tr.seed))
        model = recipe.build_model(cfg.model)
        init = str(tr.init_from) if tr.init_from else None
        if init and run_state.is_hf_dir(init):
            run_state.load_hf_into(model, init, cfg.model)
        names = tuple({n for n, _ in model.named_parameters(remove_duplicate=False)}
                      | {n for n, _ in model.named_modules()})
        self.n_params = sum(p.numel() for p in model.parameters())
        ranges = stage_ranges(int(cfg.model.n_layer), lay.pp, list(lay.stage_layers) if lay.stage_layers else None)
        self.module = keep_stage(model, recipe.pipeline, ranges, self.stage)
        if tr.activation_checkpointing:
            recipe.checkpoint_layers(self.module)
        plan = plan_for_module(self.module, recipe.mesh_plan(bool(cfg.parallel.sequence_parallel)), names)
        self.zero = None
        if lay.zero and zero is None:
            raise ValueError(f"parallel.zero={lay.zero} needs ZeRO's apply function: call "
                             "train(cfg, recipe, recipes.zero.apply_zero) as train.py does")
        if lay.zero:
            # ZeRO rewrites the plan: masters S on the dp axis, a cast to B feeds the compute.
            self.module, self.zero = zero(self.module, self.placements[self.stage], plan, stage=lay.zero, dp_axis=0)
        else:
            sc.distribute_module(self.module, self.placements[self.stage], plan)
        self.optimizer = build_optimizer(self.module, tr)
        if self.zero is not None:
            self.zero.attach(self.optimizer)
        self.scheduler = build_scheduler(self.optimizer, tr)
        rows = lay.micro_batch_size * lay.dp
        seq = int(d.seq_len)
        self.pipe_cfg = PipelineConfig(
            self.placements, lay.accumulation, (rows, seq), (rows, seq, recipe.hidden_size(cfg.model)),
            recipe.data_sbp, recipe.act_sbp, schedule=str(cfg.parallel.pp_schedule),
            max_grad_norm=float(tr.grad_clip) if tr.grad_clip else None, tied=recipe.tied)
        forward = recipe.stage_forward
        if tr.precision == "bf16":
            forward = _autocast(forward, device_type)
        self.pipe = PipelineStep(self.pipe_cfg, self.module, self.optimizer, forward, self.train_batches,
                                 self.scheduler)
        self.val_batches = None
        if tr.eval_every and self.data.n_val_sequences:
            self.val_batches = MicroBatches.from_prepared(self.data, "val", lay.global_batch_size, int(tr.seed),
                                                          lay.accumulation, lay.dp, self.dp_rank)
        self.step = 0
        if init and not run_state.is_hf_dir(init):
            run_state.load_weights(self, init)
        if str(tr.resume) == "auto":
            self.step = run_state.resume(self)
        if self.rank == 0:
            run_state.write_tokenizer(self)

    def lr(self, step: int) -> float:
        tr = self.cfg.trainer
        return lr_at(step, float(tr.lr), float(tr.min_lr), int(tr.warmup_steps), int(tr.max_steps))

    def evaluate(self) -> float | None:
        """Mean validation loss over ``trainer.eval_steps`` global batches (known on rank 0)."""
        n = int(self.cfg.trainer.eval_steps) * self.layout.accumulation
        return self.pipe.evaluate(self.val_batches, n, index=0)


def _autocast(forward, device_type):
    def run(module, x, labels=None):
        with torch.autocast(device_type, dtype=torch.bfloat16):
            out = forward(module, x, labels)
        return out.float() if labels is not None else out.to(torch.float32)

    return run


def train(cfg, recipe, zero=None):
    """``zero``: ``recipes.zero.apply_zero`` (passed in: toolkit does not import recipes), used when ``parallel.zero > 0``."""
    job = Job(cfg, recipe, zero)
    lay, tr = job.layout, cfg.trainer
    peak = float(tr.peak_tflops) if tr.peak_tflops else flops.measured_peak_tflops()
    fpt = flops.model_flops_per_token(cfg.model, int(cfg.data.seq_len), n_params=job.n_params)
    last = None
    with MetricsLogger(cfg.run_dir, cfg, enabled=job.rank == 0, flops_per_token=fpt, peak_tflops=peak,
                       n_devices=lay.world_size) as logger, _progress(int(tr.max_steps), job.step, job.rank == 0) as bar:
        for step in range(job.step, int(tr.max_steps)):
            lr = job.lr(step)
            start = time.perf_counter()
            loss = job.pipe.step(step)
            seconds = time.perf_counter() - start
            job.step = step + 1
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{loss:.4f}" if loss is not None else "?")
            if job.step % int(tr.log_every) == 0 or job.step == 1 or job.step == int(tr.max_steps):
                last = logger.log(job.step, loss=loss, lr=lr, grad_norm=job.pipe.grad_norm,
                                  tokens_per_s=lay.tokens_per_step / seconds) or last
            if job.val_batches is not None and (job.step % int(tr.eval_every) == 0 or job.step == int(tr.max_steps)):
                val = job.evaluate()
                if job.rank == 0:
                    last = {**(last or {}), **logger.log_eval(job.step, val)}
            if (tr.save_every and job.step % int(tr.save_every) == 0) or job.step == int(tr.max_steps):
                run_state.save(job, job.step)
    return last if job.rank == 0 else None
