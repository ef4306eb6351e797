"""The training loop every recipe shares; runs on every rank of a launched job.

``train(cfg, recipe)`` knows recipes only through ``toolkit.recipe.Recipe``:

1. lays out the job: one ``(dp, tp)`` placement per pipeline stage (``(dp, cp, tp)`` with context parallelism)
   (``toolkit.mesh``); this rank's stage and its shard of the data (from
   the recipe's ``data_sbp``);
2. prepares the data (``recipe.prepare``: built once and cached) and this
   rank's micro-batches (``recipe.data``: a deterministic, resumable sampler
   sharded over the data shards);
3. builds the full model from the seed, keeps this rank's stage, or
   stages under ``parallel.pp_virtual`` (``toolkit.stages``, when the recipe
   has a pipeline split; each stage's forward then runs on a view of the
   rank's module), gives it the
   recipe's plan (``distribute_module``, or ZeRO's rewrite of it),
   optionally activation checkpointing; the recipe's optimizer with warmup
   + cosine;
4. runs each step as actors (``runtime.pipeline.PipelineStep``, also for
   ``pp = 1``): micro-batches through the runtime data pipeline, forward and
   backward, one gradient reduction, global-norm clipping, the update;
5. logs loss, lr, grad norm, throughput (``<unit>_per_s``, over the steps
   since the last logged one), TFLOP/s, MFU and peak memory
   (``toolkit.metrics``: console, ``metrics.jsonl``, W&B on rank 0), the
   host waiting for the device only there, every ``trainer.log_every``
   steps, and evaluates periodically (``recipe.evaluate``);
6. checkpoints every ``trainer.save_every`` steps and at the end, resumes
   with ``trainer.resume=auto``, starts from ``trainer.init_from`` weights
   (``toolkit.run_state``).

Returns the last logged row on rank 0 (``None`` elsewhere).
"""
from __future__ import annotations

import contextlib
import time
from functools import partial

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_leaves

import sbp_core as sc
from runtime.host_memory import keep_freed_host_memory
from runtime.pipeline import PipelineConfig, PipelineStep, stage_of
from runtime.pipeline.schedule import chunk_ranks
from toolkit import run_state
from toolkit.config import typed, validate
from toolkit.mesh import context_plan, model_names, plan_for_module, stage_placements, with_context, with_overrides
from toolkit.metrics import MetricsLogger, reset_peak_memory
from toolkit.optim import build_scheduler, lr_at
from toolkit.peak import device_peak
from toolkit.recipe import data_shard, recipe_batch
from toolkit.stages import boundary_specs, chunk_views, keep_stages, stage_ranges
from toolkit.zero import apply_zero


def _progress(total: int, initial: int, enabled: bool):
    if not enabled:
        return contextlib.nullcontext(None)
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, leave=False)


class Job:
    """One rank's share of a training job: its stage module, optimizer, data and pipelined step."""

    def __init__(self, cfg, recipe, layout=None):
        """``layout``: what ``validate`` returned for ``cfg`` before the ranks started (``train.py``), or ``None``
        to validate here (a job started some other way: tests, scripts)."""
        with sc.initialising():  # peers may wait through one rank's preparing, building, loading
            self._start(cfg, recipe, layout)

    def _start(self, cfg, recipe, layout) -> None:
        self.recipe = recipe
        self.layout = lay = layout if layout is not None else validate(cfg, recipe, world_size=dist.get_world_size())
        if lay.world_size != dist.get_world_size():
            raise ValueError(f"the job was laid out for {lay.world_size} ranks but {dist.get_world_size()} joined")
        self.cfg = cfg = typed(cfg, recipe)
        self.rank = rank = dist.get_rank()
        keep_freed_host_memory()  # every step reuses the last one's host memory instead of faulting in fresh pages
        tr = cfg.trainer
        self.placements = stage_placements(lay.dp, lay.tp, lay.pp, "cuda" if lay.device == "cuda" else "cpu", lay.cp)
        self.stage = stage_of(self.placements, rank)
        mesh = self.placements[self.stage]
        # The recipe's layouts on this job's mesh: with cp > 1 the sequence is split on the cp axis.
        self.data_sbp, self.act_sbp = (with_context(s, lay.cp, recipe.context_dim) for s in (recipe.data_sbp,
                                                                                              recipe.act_sbp))
        self.data_shard, self.data_shards = data_shard(self.data_sbp, mesh.shape, mesh.coords(rank))
        self.data = recipe.prepare(cfg)
        self.train_batches = recipe.data(cfg, self.data, "train", self.data_shard, self.data_shards, lay)
        init, ranges = self._build_stage(mesh)
        self.pipe = self._pipeline(ranges)
        self.val_batches = None
        if tr.eval_every:
            self.val_batches = recipe.data(cfg, self.data, "val", self.data_shard, self.data_shards, lay)
        self.step = 0
        if init:
            run_state.load_weights(self, init)
        if str(tr.resume) == "auto":
            self.step = run_state.resume(self)
            if self.step >= int(tr.max_steps) and self.rank == 0:
                print(f"nothing to train: the checkpoint is at step {self.step} and trainer.max_steps="
                      f"{int(tr.max_steps)}; raise trainer.max_steps to train on", flush=True)
        if self.rank == 0:
            recipe.on_start(self)

    def _build_stage(self, mesh) -> tuple:
        """This rank's stage module, distributed on ``mesh`` (or ZeRO's rewrite), its optimizer and schedule.

        Returns ``(checkpoint to load or None, the stages' layer ranges or None)``."""
        cfg, recipe, lay, tr = self.cfg, self.recipe, self.layout, self.cfg.trainer
        init = recipe.weights_path(str(tr.init_from)) if tr.init_from else None
        if tr.init_from and init is None:  # validated where the job started; this rank's machine lacks it
            raise FileNotFoundError(f"trainer.init_from={tr.init_from!r}: not found on rank {self.rank}'s machine")
        ranges, split, self.chunks = None, recipe.pipeline_plan(cfg.model), None
        v = lay.pp_virtual
        stages = [c for c, r in enumerate(chunk_ranks(str(cfg.parallel.pp_schedule), lay.pp, v)) if r == self.stage]
        cut = whole = None
        if split is not None:
            ranges = stage_ranges(recipe.n_layers(cfg.model), lay.pp * v,
                                  list(lay.stage_layers) if lay.stage_layers else None)
            cut = partial(keep_stages, plan=split, ranges=ranges, stages=stages)
            with torch.random.fork_rng(devices=[]), torch.device("meta"):
                whole = recipe.build_model(cfg.model)  # the full model's names and size (as n_layers builds it)
        torch.manual_seed(int(tr.seed))
        self.module = recipe.build_stage(cfg.model, cut or (lambda model: model))
        whole = self.module if whole is None else whole
        names = model_names(whole)
        self.n_params = sum(p.numel() for p in whole.parameters())
        if init and recipe.init_weights(self.module, init, cfg):
            init = None  # a foreign format, read into the stage
        if tr.activation_checkpointing:
            recipe.checkpoint_layers(self.module, cfg.model)
        plan = plan_for_module(self.module, with_overrides(recipe.mesh_plan(cfg), cfg.parallel.plan), names)
        plan = context_plan(plan, lay.cp, recipe.context_dim)
        self.zero = None
        bucket_bytes = max(1, int(float(cfg.parallel.bucket_mb) * 2**20))
        if lay.zero:
            # ZeRO rewrites the plan: masters S on the dp axis, a cast to B feeds the compute.
            self.module, self.zero = apply_zero(self.module, mesh, plan, stage=lay.zero, dp_axis=0,
                                                bucket_bytes=bucket_bytes)
        else:
            sc.distribute_module(self.module, mesh, plan, bucket_bytes)
        self.module.__dict__.pop("init_shard", None)  # init_weights' reader of the files, done (Recipe.init_weights)
        # With ZeRO the step syncs the masters' gradients and refreshes the compute copies itself
        # (PipelineStep): no optimizer hooks, which would make the step dispatch per op on global tensors.
        self.optimizer = recipe.build_optimizer(self.module, cfg)
        self.scheduler = build_scheduler(self.optimizer, tr)
        if v > 1:  # each stage's forward runs a view of the rank's module (made last: it shares what came before)
            self.chunks = chunk_views(self.module, split, ranges, stages)
        return init, ranges

    def _pipeline(self, ranges) -> PipelineStep:
        """The pipelined step: the micro-batch's fields, each boundary's tensors, the stage forward as the trainer
        runs it (compiled, under autocast) and fp16's loss scale."""
        cfg, recipe, lay, tr = self.cfg, self.recipe, self.layout, self.cfg.trainer
        rows = lay.micro_batch_size * lay.data_shards
        batch = {k: ((rows, *shape), dtype) for k, (shape, dtype) in recipe_batch(cfg, recipe).items()}
        acts = boundary_specs(lambda: recipe.build_model(cfg.model), recipe.stage_forward,
                              recipe.pipeline_plan(cfg.model), ranges, batch, recipe.inputs) if lay.pp > 1 else []
        self.pipe_cfg = PipelineConfig(
            self.placements, lay.accumulation, batch, acts,
            self.data_sbp, self.act_sbp, recipe.inputs, recipe.labels, schedule=str(cfg.parallel.pp_schedule),
            max_grad_norm=float(tr.grad_clip) if tr.grad_clip else None, tied=list(recipe.tied_pairs(cfg.model)),
            rows_weigh_equally=recipe.rows_weigh_equally, split_last_backward=not tr.compile, virtual=lay.pp_virtual)
        forward = recipe.stage_forward
        if tr.compile:
            modules = list(self.chunks.values()) if self.chunks else [self.module]
            forward = compiled_forward(forward, modules, verbose=self.rank == 0)
        if tr.precision != "fp32":
            forward = autocast_forward(forward, self.placements[0].device_type, AUTOCAST[tr.precision])
        # fp16 needs its loss scaled (GradScaler's dynamic scale; the skip is decided for the whole job).
        scaler = sc.LossScaler() if tr.precision == "fp16" else None
        return PipelineStep(self.pipe_cfg, self.module, self.optimizer, forward, self.train_batches,
                            self.scheduler, loss_scale=scaler, zero=self.zero, chunks=self.chunks)

    def lr(self, step: int) -> float:
        tr = self.cfg.trainer
        return lr_at(step, float(tr.lr), float(tr.min_lr), int(tr.warmup_steps), int(tr.max_steps))

    def close(self) -> None:
        """Stop the batches read ahead for steps that will not run (``MicroBatches.close``)."""
        for batches in (self.train_batches, self.val_batches):
            close = getattr(batches, "close", None)
            if close is not None:
                close()

    def evaluate_loss(self) -> float | None:
        """Mean loss over ``trainer.eval_steps`` validation global batches, forward only (known on rank 0)."""
        n = int(self.cfg.trainer.eval_steps) * self.layout.accumulation
        return self.pipe.evaluate(self.val_batches, n, index=0)


AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _holds_global(x) -> bool:
    """Whether ``x`` (a tensor, or a dict, tuple or list of them: a batch, a stage's boundary tensors) holds a
    global tensor."""
    return any(isinstance(t, sc.GlobalTensor) for t in tree_leaves(x))


def compiled_forward(forward, modules: list, verbose: bool = False):
    """``forward(module, x, labels)`` with each of ``modules`` compiled (``trainer.compile=true``): the rank's
    stage module, or each of its stages' (virtual stages).

    ``torch.compile`` traces plain tensors: a stage that runs on them (one
    device, or a data-parallel stage after its audit; ``runtime.pipeline``)
    calls the compiled module, whose parameters are the swapped-in leaves of
    the step (inputs to the graph, so swapping them recompiles nothing); the
    stage's last backward is not split (``split_last_backward``: the compiled
    backward gives every gradient at once). A call on global tensors (a
    data-parallel stage's first, audited micro-batch; ``sc.explain``) runs
    eager, and says so once.
    """
    compiled = {id(m): torch.compile(m) for m in modules}
    told = []

    def run(mod, x, labels=None):
        if _holds_global(x) or _holds_global(labels):
            if verbose and not told:
                told.append(True)
                print("trainer.compile: a forward on global tensors runs eager (a data-parallel stage's first, "
                      "audited micro-batch, or sc.explain); the forwards on plain tensors are compiled", flush=True)
            return forward(mod, x, labels)
        return forward(compiled.get(id(mod), mod), x, labels)

    return run


def autocast_forward(forward, device_type, dtype=torch.bfloat16):
    """``forward`` under autocast to ``dtype``, returning fp32 (``trainer.precision=bf16`` or ``fp16``)."""
    def run(module, x, labels=None):
        with torch.autocast(device_type, dtype=dtype):
            out = forward(module, x, labels)
        if labels is not None:
            return out.float()
        return tuple(t.float() if t.is_floating_point() else t for t in out) if isinstance(out, (tuple, list)) \
            else out.float() if out.is_floating_point() else out

    return run


def _synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def train(cfg, recipe, layout=None):
    """Train ``recipe`` as ``cfg`` says, on this rank (every rank of the job calls it); rank 0 returns the last
    logged metrics. ``layout``: see ``Job``."""
    reset_peak_memory()  # this job's peak, from its build on
    job = Job(cfg, recipe, layout)
    cfg, lay, tr = job.cfg, job.layout, job.cfg.trainer
    peak = device_peak(lay.device if lay.device == "cuda" else "cpu", str(tr.precision), tr.peak_tflops)
    if job.rank == 0:
        print(f"mfu against {peak.tflops:g} TFLOP/s per device ({peak.source})", flush=True)
    per_item = recipe.flops_per_item(cfg, job.n_params)
    throughput = f"{recipe.throughput_unit}_per_s"
    last = None
    try:
        with MetricsLogger(cfg.run_dir, cfg, enabled=job.rank == 0, flops_per_item=per_item, peak_tflops=peak.tflops,
                           n_devices=lay.world_size, throughput_key=throughput) as logger, \
                _progress(int(tr.max_steps), job.step, job.rank == 0) as bar:
            window, steps_in_window = time.perf_counter(), 0
            for step in range(job.step, int(tr.max_steps)):
                lr = job.lr(step)
                logging = (step + 1) % int(tr.log_every) == 0 or step == 0 or step + 1 == int(tr.max_steps)
                loss = job.pipe.step(step, report=logging)  # a device tensor: the step queues its work, returns
                job.step = step + 1
                steps_in_window += 1
                if bar is not None:
                    bar.update(1)
                if logging:
                    # The host waits for the device here only: reading the loss, every log_every steps.
                    loss = None if loss is None or job.rank != 0 else float(loss)
                    _synchronize(lay.device)
                    seconds = (time.perf_counter() - window) / steps_in_window
                    if bar is not None:
                        bar.set_postfix(loss=f"{loss:.4f}" if loss is not None else "?")
                    scale = {} if job.pipe.loss_scale is None else \
                        {"loss_scale": job.pipe.loss_scale.scale, "skipped": bool(job.pipe.skipped)}
                    last = logger.log(job.step, loss=loss, lr=lr, grad_norm=job.pipe.grad_norm, **scale,
                                      **{throughput: lay.items_per_step / seconds}) or last
                    window, steps_in_window = time.perf_counter(), 0
                if tr.eval_every and (job.step % int(tr.eval_every) == 0 or job.step == int(tr.max_steps)):
                    metrics = recipe.evaluate(job)
                    if job.rank == 0 and metrics:
                        last = {**(last or {}), **logger.log_eval(job.step, **metrics)}
                    window, steps_in_window = time.perf_counter(), 0
                if (tr.save_every and job.step % int(tr.save_every) == 0) or job.step == int(tr.max_steps):
                    run_state.save(job, job.step)
                    window, steps_in_window = time.perf_counter(), 0
    finally:
        job.close()  # nothing keeps loading behind the caller's back
    return last if job.rank == 0 else None
