"""Checks a composed config before anything starts, and derives the job's layout.

:func:`validate` merges the config into the typed schema, ``model`` and
``data`` into the recipe's (unknown keys, wrong types), then checks every
value range and cross-field rule, collecting *all* problems into one
:class:`ConfigError`:

- ``recipe.name`` names the recipe given;
- ``dp * cp * tp * pp`` equals the processes available: torchrun's / Slurm's world
  size when launched (see :mod:`toolkit.config.environment`), else what will
  be spawned; with ``device=cuda`` (or ``auto`` on a CUDA machine) the ranks
  on a node must not outnumber its visible devices. A pipeline on CUDA
  with ``CUDA_DEVICE_MAX_CONNECTIONS=1`` in the environment warns (see
  ``docs/design.md``: its channels' communicators may then deadlock).
- With a pipeline split: the recipe's layer count divides by
  ``pp * pp_virtual``, or ``stage_layers`` has ``pp * pp_virtual`` positive
  entries summing to it; ``pp_virtual > 1`` needs ``pp > 1``; ``zbv`` needs
  ``pp_virtual = 2``; the zero-bubble schedules (``zb``, ``zbv``) split
  each backward in two, which a compiled stage cannot (``trainer.compile``).
  No schedule needs the micro-batches to be a multiple of ``pp``: each
  follows from quotas, not from rounds of ``pp`` micro-batches.
- ``global_batch_size`` divides by ``micro_batch_size * data_shards`` (the
  batch shards the recipe's ``data_sbp`` cuts over a stage's mesh: ``dp``
  for ``(S(0), B)``, ``dp * tp`` for ``(S(0), S(0))``); the quotient is the
  gradient accumulation, which must be at least ``pp`` when ``pp > 1``.
- ``bucket_mb`` (gradient MiB per collective) is positive; each
  ``parallel.plan`` entry is ``B`` or ``S(d)``, matches something in the
  model and splits no parameter past its dimensions (a meta build).
- ``zero`` in 0..3; ``zero > 0`` with ``dp == 1`` warns (:class:`ConfigWarning`)
  and the layout's effective ``zero`` is 0; ``sequence_parallel`` with
  ``tp == 1`` warns too (it splits nothing).
- ``cp > 1`` needs a recipe with a sequence (``Recipe.context_dim``), and
  is refused with ``trainer.compile`` (a context-parallel stage runs on
  global tensors; ``parallel.auto`` refuses it before searching,
  ``toolkit.search.auto.refuse_context``); the recipe checks that its sequence divides by ``cp``; with
  ``micro_batch_size > 1`` it warns (the sequence split cannot stay
  through a linear layer's folded batch and sequence).
- Every choice-valued string is one of its choices (schema tuples).
- The checkpoint ``trainer.init_from`` names, and with ``trainer.resume=auto``
  the run directory's newest one: readable, and holding every model tensor
  in the model's shape (from the metadata alone); a resumed one saved with
  the recipe's ``resume_facts`` of this config (a changed ``trainer.seed``
  warns).
- Then the recipe's own rules (``Recipe.check``: divisibility by tp,
  sequence length, class counts, ...).

The result, :class:`JobLayout`, carries the derived numbers the trainer
needs (accumulation, data shards, per-stage layer counts, effective ZeRO
stage, device).
"""
from __future__ import annotations

import math
import os
import re
import warnings
from dataclasses import dataclass, replace
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from toolkit.config import schema as S
from toolkit.config.environment import cluster_env, cuda_device_count, resolve_device
from toolkit.config.errors import ConfigError, ConfigWarning
from runtime.pipeline.schedule import too_few_micro_batches
from toolkit.config.parallel_name import ZERO_STAGES, parallel_name

@dataclass(frozen=True)
class JobLayout:
    """What a valid config means for the job (all derived, nothing to look up again).

    ``rank = pp_i * dp * cp * tp + dp_i * cp * tp + cp_i * tp + tp_i`` (docs/design.md). ``zero`` is the
    effective stage (0 when ``dp == 1``). ``stage_layers[s]`` is the number
    of transformer blocks of pipeline chunk ``s`` (``pp * pp_virtual``
    chunks; chunk ``s`` runs on stage ``s % pp``). ``data_shards``: the
    shards a micro-batch is cut into over a stage's mesh; ``accumulation``:
    micro-batches per optimizer step on each shard; ``items_per_step``:
    throughput items (tokens, images, samples) in one global batch.
    """

    name: str
    world_size: int
    dp: int
    tp: int
    pp: int
    zero: int
    pp_virtual: int
    cp: int
    stage_layers: tuple
    micro_batch_size: int
    global_batch_size: int
    accumulation: int
    data_shards: int
    items_per_step: int
    device: str  # "cpu" or "cuda"
    launched: Optional[str]  # "torchrun", "slurm" or None (train.py spawns the ranks)


def _init_from_problems(given: str, path: str, cfg, recipe) -> list:
    """Our checkpoint at ``path`` against the model's parameter shapes (a meta build), from its metadata alone:
    a corrupt checkpoint, or one saved with other model settings, would fail on every rank after spawning.
    A directory in a format the recipe reads (``Recipe.reads_weights``) is the recipe's to check; anything
    else is refused."""
    from toolkit import checkpoint as ckpt
    from toolkit.checkpoint.directory import resolve

    if recipe.reads_weights(path):
        return [f"trainer.init_from={given!r}: {x}" for x in recipe.weights_problems(path, cfg)]
    try:
        resolve(path)
    except ckpt.CheckpointError as err:
        return [f"trainer.init_from={given!r}: {err}; valid: our checkpoint (<run>/checkpoints/step_<N>, a "
                "checkpoint root or a run directory), or a format recipe " + recipe.name + " reads"]
    return _model_problems(f"trainer.init_from={given!r}", "the checkpoint's model", path, cfg, recipe,
                           "the model settings it was saved with (its run's config.yaml, or its extra.model_config)")


def _resume_problems(cfg, recipe) -> list:
    """``trainer.resume=auto``: the run's newest complete checkpoint (if any) against the model, as
    ``trainer.init_from``'s, and against the recipe's ``resume_facts``; a changed ``trainer.seed`` warns. A
    run directory that Hydra has not resolved here is checked as it loads."""
    from toolkit import checkpoint as ckpt
    from toolkit.run_state import checkpoint_root, facts_problems, resume_facts

    try:
        root = checkpoint_root(str(cfg.run_dir))
    except (OmegaConfBaseException, ValueError):
        return []
    path = ckpt.latest(root)
    if path is None:
        return []
    problems = _model_problems("trainer.resume=auto", f"the model of the run's newest checkpoint ({path})", path,
                               cfg, recipe, "the model settings of the run it continues (config.yaml in its run "
                               "directory), or another run directory (hydra.run.dir)")
    if problems:
        return problems
    try:
        saved = ckpt.plain_value(path, "facts")
        seed = (ckpt.plain_value(path, "sampler") or {}).get("seed")
    except ckpt.CheckpointError as err:
        return [f"trainer.resume=auto: {err}"]
    if seed is not None and seed != cfg.trainer.seed:
        warnings.warn(f"trainer.resume=auto: trainer.seed={cfg.trainer.seed}, the run's newest checkpoint ({path}) "
                      f"was saved with {seed}: the batches from its step on follow the config's seed, its random "
                      "states are the checkpoint's", ConfigWarning, stacklevel=4)
    return facts_problems(saved, resume_facts(recipe, cfg), path)


def _meta_model(cfg, recipe):
    """``cfg.model`` built on the meta device (no memory, the RNG untouched), or ``None`` for a model config
    that does not build: its own checks report that, or it fails as it builds."""
    import torch

    try:
        with torch.random.fork_rng(devices=[]), torch.device("meta"):
            return recipe.build_model(cfg.model)
    except (ValueError, TypeError, KeyError, RuntimeError, NotImplementedError):
        return None


def _model_problems(field: str, what: str, path: str, cfg, recipe, valid: str) -> list:
    """Checkpoint ``path``'s model tensors against the model's (a meta build) from its metadata alone: a
    corrupt checkpoint, or one saved with other model settings, would fail on every rank after spawning."""
    from toolkit import checkpoint as ckpt

    model = _meta_model(cfg, recipe)
    if model is None:
        return []
    here = model.state_dict()
    try:
        saved = ckpt.tensor_shapes(path, "model", here, tied=recipe.tied_pairs(cfg.model))
    except ckpt.CheckpointError as err:
        return [f"{field}: {err}"]
    partners = {b for a, b in recipe.tied_pairs(cfg.model) if a in here}  # one parameter under two names: named once
    wrong = [f"{n} is not there" if saved[n] is None else f"{n} is {list(saved[n])} there, {list(t.shape)} here"
             for n, t in here.items() if saved[n] != tuple(t.shape) and n not in partners]
    if not wrong:
        return []
    return [f"{field}: {what} has other tensors or shapes than model.*: "
            + "; ".join(wrong[:3]) + (f"; and {len(wrong) - 3} more" if len(wrong) > 3 else "") + f"; valid: {valid}"]


def _choice(problems: list, field: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        problems.append(f"{field}={value!r}: unknown choice; valid: {', '.join(map(str, choices))}")


def _at_least(problems: list, field: str, value: Any, low, note: str = "") -> bool:
    if value < low:
        problems.append(f"{field}={value!r}: must be >= {low}{note}")
        return False
    return True


def layouts_for(world: int, limit: int = 6) -> list[str]:
    """Some layout names with ``dp * tp * pp == world`` (for error messages)."""
    names = []
    for tp in (d for d in range(1, world + 1) if world % d == 0):
        for pp in (d for d in range(1, world // tp + 1) if (world // tp) % d == 0):
            names.append(parallel_name(world // (tp * pp), tp, pp))
    names.sort(key=lambda n: (n.count("_"), n))
    return names[:limit]


def _typed(cfg: Any, recipe) -> DictConfig:
    try:
        return S.typed(cfg, recipe)
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None) or "config"
        where = "toolkit/config/schema.py"
        if key.startswith(("model", "data")):
            schema = recipe.model_schema if key.startswith("model") else recipe.data_schema
            where = f"{schema.__module__}.{schema.__qualname__} (recipe {recipe.name})"
        raise ConfigError(f"{key}: {str(err).splitlines()[0]}; valid: the fields and types of {where}") from None


def _check_stages(problems: list, par, n_layer: int) -> tuple:
    chunks = par.pp * par.pp_virtual
    if par.stage_layers is None:
        if n_layer % chunks:
            problems.append(f"model: {n_layer} layers do not divide into parallel.pp*pp_virtual="
                            f"{chunks} equal stages; valid: pp*pp_virtual among "
                            f"{[d for d in range(1, n_layer + 1) if n_layer % d == 0]}, or set "
                            f"parallel.stage_layers to {chunks} positive counts summing to {n_layer}")
            return ()
        return (n_layer // chunks,) * chunks
    layers = tuple(int(x) for x in par.stage_layers)
    if len(layers) != chunks or any(x < 1 for x in layers) or sum(layers) != n_layer:
        problems.append(f"parallel.stage_layers={list(layers)}: needs {chunks} (pp*pp_virtual) "
                        f"entries, each >= 1, summing to the model's {n_layer} layers")
        return ()
    return layers


def _plan_problems(plan: dict, cfg, recipe) -> list:
    """``parallel.plan``'s patterns against the model (a meta build), as ``sbp_core.distribute_module``
    checks them on every rank: a pattern names parameters or buffers, ``<module>:input``/``inputs``/
    ``output`` a module's activations; and a split ``S(d)`` of parameters needs ``d`` below the rank of
    every one it matches."""
    import fnmatch

    model = _meta_model(cfg, recipe)
    if model is None:
        return []
    params = dict(model.named_parameters(remove_duplicate=False))
    tensors = list(params) + [n for n, _ in model.named_buffers()]
    modules = [n for n, _ in model.named_modules()]
    out = []
    for pattern, text in plan.items():
        target, _, pin = str(pattern).partition(":")
        if pin not in ("", "input", "inputs", "output"):
            out.append(f"parallel.plan[{pattern!r}]: after ':' comes input, inputs or output")
            continue
        if not any(fnmatch.fnmatchcase(n, target) for n in (modules if pin else tensors)):
            kind, some = ("module", modules[1:5]) if pin else ("parameter or buffer", sorted(params)[:4])
            out.append(f"parallel.plan[{pattern!r}]: matches no {kind} of the model; some names: {some}")
            continue
        dim = None if pin else re.fullmatch(r"S\((\d+)\)", str(text).strip())
        small = [n for n, t in params.items() if fnmatch.fnmatchcase(n, target) and dim and int(dim[1]) >= t.dim()]
        if small:
            out.append(f"parallel.plan[{pattern!r}]={text!r}: {small[0]} has {params[small[0]].dim()} dimensions; "
                       f"valid: B or S(0..{params[small[0]].dim() - 1})")
    return out


def _check_parallel(p: list, cfg, recipe, world_size: Optional[int], env) -> tuple:
    """The parallel section: ``(degrees_ok, zero, world, world_size, layout name, stage_layers)``."""
    par = cfg.parallel
    degrees_ok = all([_at_least(p, f"parallel.{k}", par[k], 1) for k in ("dp", "cp", "tp", "pp", "pp_virtual")])
    _choice(p, "parallel.zero", par.zero, ZERO_STAGES)
    _choice(p, "parallel.pp_schedule", par.pp_schedule, S.PP_SCHEDULES)
    if not par.bucket_mb > 0:
        p.append(f"parallel.bucket_mb={par.bucket_mb!r}: gradient MiB per collective, must be > 0 (DDP's default: 25)")
    plan = dict(par.plan)
    for pattern, text in plan.items():
        if not re.fullmatch(r"B|S\(\d+\)", str(text).strip()):
            p.append(f"parallel.plan[{pattern!r}]={text!r}: a tp-axis layout; valid: B or S(<dim>)")
    if plan and not p:
        p.extend(_plan_problems(plan, cfg, recipe))
    if par.auto:
        p.append("parallel.auto=true: the search runs in train.py before the job (toolkit.search.resolve); "
                 "valid: a resolved config with parallel.auto=false")
    if par.cp > 1 and recipe.context_dim is None:
        p.append(f"parallel.cp={par.cp}: splits the sequence, and recipe {recipe.name} has none (Recipe.context_dim); "
                 "valid: 1")
    if par.sequence_parallel and not recipe.sequence_parallel:
        p.append(f"parallel.sequence_parallel=true: recipe {recipe.name}'s plan has no sequence-parallel variant "
                 "(no sequence axis to split); valid: false")
    elif par.sequence_parallel and par.tp == 1:  # as Megatron, which turns it off with a warning
        warnings.warn("parallel.sequence_parallel=true with parallel.tp=1 splits the sequence over one rank: "
                      "nothing to split", ConfigWarning, stacklevel=3)
    zero = par.zero if par.zero in ZERO_STAGES else 0
    if zero and par.dp == 1:
        warnings.warn(f"parallel.zero={zero} with parallel.dp=1 shards nothing; running with zero=0",
                      ConfigWarning, stacklevel=3)
        zero = 0
    stage_layers: tuple = ()
    world = par.dp * par.cp * par.tp * par.pp if degrees_ok else 0
    layout_name = parallel_name(par.dp, par.tp, par.pp, par.zero, par.cp) if degrees_ok else "?"
    if not degrees_ok:
        return False, zero, world, (env.world_size if env is not None else 0) if world_size is None else world_size, \
            layout_name, stage_layers
    if par.pp_schedule == "zbv" and par.pp_virtual != 2:
        p.append(f"parallel.pp_schedule=zbv: places two stages per pipeline rank in a V; needs "
                 f"parallel.pp_virtual=2, got {par.pp_virtual}")
    if par.pp_virtual > 1 and par.pp == 1:
        p.append(f"parallel.pp_virtual={par.pp_virtual}: virtual stages interleave a pipeline; needs parallel.pp > 1 "
                 "(valid with pp=1: pp_virtual=1)")
    if par.pp_virtual > 1 and recipe.pipeline_plan(cfg.model) is None:
        p.append(f"parallel.pp_virtual={par.pp_virtual}: recipe {recipe.name} has no pipeline split; valid: 1")
    if recipe.pipeline_plan(cfg.model) is not None:
        try:  # counted on a meta model (Recipe.n_layers): a bad model config may not build
            n_layer = recipe.n_layers(cfg.model)
        except (ValueError, TypeError, KeyError, RuntimeError) as err:
            p.append(f"model: cannot be built to count its pipeline layers ({err})")
        else:
            stage_layers = _check_stages(p, par, n_layer)
    if world_size is None:
        world_size = env.world_size if env is not None else world
    if world != world_size:
        source = {"torchrun": f"torchrun's WORLD_SIZE is {world_size}",
                  "slurm": f"Slurm's SLURM_STEP_NUM_TASKS is {world_size}"}.get(
            env.kind if env is not None else None, f"{world_size} are available")
        degrees = ("dp", "cp", "tp", "pp") if par.cp > 1 else ("dp", "tp", "pp")
        p.append(f"parallel={layout_name}: {'*'.join(degrees)} = {'*'.join(str(par[k]) for k in degrees)} = {world} "
                 "processes, "
                 f"but {source}; valid: a layout with {world_size} processes "
                 f"(e.g. {', '.join(layouts_for(world_size))}) or launch {world}")
    return True, zero, world, world_size, layout_name, stage_layers


def _check_device(p: list, cfg, env, world: int) -> str:
    """``cpu`` or ``cuda``: what ``cfg.device`` resolves to for this host's ranks."""
    device = "cpu"
    if cfg.device in S.DEVICES and world:
        local = env.sharing_devices(world) if env is not None else world
        try:
            device = resolve_device(cfg.device, local)
        except ConfigError as err:
            p.extend(err.problems)
        if cfg.device == "auto" and device == "cpu" and 0 < (count := cuda_device_count()) < local:
            warnings.warn(f"device=auto: {count} CUDA devices for {local} local ranks; running on CPU "
                          "(gloo)", ConfigWarning, stacklevel=3)
    if device == "cuda" and cfg.parallel.pp > 1 and os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1":
        warnings.warn("CUDA_DEVICE_MAX_CONNECTIONS=1 (a Megatron-LM setting for its tensor-parallel overlap) makes "
                      "each GPU start every stream's work in one launch order; a pipeline's channels each drive "
                      "an NCCL communicator of their own from a thread of their own, and NCCL documents that "
                      "communicators in flight together can then deadlock (here: every rank ends with a timeout "
                      "error after SBP_TIMEOUT). This runtime does not need it; unset it for pipeline jobs",
                      ConfigWarning, stacklevel=3)
    return device


def _check_batch(p: list, tr, par, shards: int, layout_name: str, degrees_ok: bool) -> int:
    """Micro-batches per step (gradient accumulation; 0 where the sizes are wrong)."""
    mb, gb = tr.micro_batch_size, tr.global_batch_size
    sizes_ok = [_at_least(p, "trainer.micro_batch_size", mb, 1),
                _at_least(p, "trainer.global_batch_size", gb, 1)]
    if not (all(sizes_ok) and degrees_ok):
        return 0
    per = mb * shards
    what = "parallel.dp" if shards == par.dp else f"the {shards} data shards of {layout_name}"
    if gb % per:
        p.append(f"trainer.global_batch_size={gb}: must divide by trainer.micro_batch_size*{what}"
                 f" = {mb}*{shards} = {per}; valid: a multiple of {per}, e.g. "
                 f"{max(per, gb // per * per)} or {(gb // per + 1) * per}")
        return 0
    accumulation = gb // per
    if too_few_micro_batches(accumulation, par.pp):
        p.append(f"trainer.global_batch_size={gb}: gives {accumulation} micro-batches per step "
                 f"(global/(micro*shards) = {gb}/({mb}*{shards})), fewer than parallel.pp={par.pp} "
                 f"stages; valid: global_batch_size >= {per * par.pp} (a multiple of "
                 f"{per}) or a smaller micro_batch_size")
    return accumulation


def _check_trainer(p: list, tr, par, recipe, zero: int) -> None:
    _at_least(p, "trainer.max_steps", tr.max_steps, 1)
    missing = [k for k in ("lr", "min_lr", "warmup_steps") if OmegaConf.is_missing(tr, k)]
    for k in missing:
        p.append(f"trainer.{k}: not set; the recipe's trainer group sets it (configs/trainer/<name>.yaml), "
                 f"or give trainer.{k}=<value>")
    if not missing:
        if not tr.lr > 0:
            p.append(f"trainer.lr={tr.lr}: must be > 0")
        if not 0 <= tr.min_lr <= tr.lr:
            p.append(f"trainer.min_lr={tr.min_lr}: must be in [0, trainer.lr={tr.lr}]")
        if tr.warmup_steps < 0:
            p.append(f"trainer.warmup_steps={tr.warmup_steps}: must be >= 0")
    _at_least(p, "trainer.weight_decay", tr.weight_decay, 0.0)
    _choice(p, "trainer.optimizer", tr.optimizer, S.OPTIMIZERS)
    if len(tr.betas) != 2 or not all(0.0 <= b < 1.0 for b in tr.betas):
        p.append(f"trainer.betas={list(tr.betas)}: must be two numbers in [0, 1), e.g. [0.9, 0.95]")
    if not 0.0 <= tr.momentum < 1.0:
        p.append(f"trainer.momentum={tr.momentum}: must be in [0, 1)")
    if not tr.eps > 0:
        p.append(f"trainer.eps={tr.eps}: must be > 0")
    _at_least(p, "trainer.grad_clip", tr.grad_clip, 0.0, " (0 disables clipping)")
    _at_least(p, "trainer.eval_every", tr.eval_every, 0, " (0 disables evaluation)")
    _at_least(p, "trainer.eval_steps", tr.eval_steps, 1)
    _at_least(p, "trainer.log_every", tr.log_every, 1)
    _at_least(p, "trainer.save_every", tr.save_every, 0, " (0 saves only at the end)")
    _at_least(p, "trainer.keep_last", tr.keep_last, 1)
    _choice(p, "trainer.precision", tr.precision, S.PRECISIONS)
    _choice(p, "trainer.resume", tr.resume, S.RESUME_MODES)
    if tr.peak_tflops is not None and not tr.peak_tflops > 0:
        p.append(f"trainer.peak_tflops={tr.peak_tflops}: must be > 0, or null to measure it")
    if tr.compile and (par.tp > 1 or zero or (par.dp > 1 and not recipe.rows_weigh_equally)):
        why = f"tp={par.tp}" if par.tp > 1 else f"zero={zero}" if zero else \
            f"dp={par.dp} with recipe {recipe.name}, whose loss rows may weigh unequally"
        p.append(f"trainer.compile=true: compiles the stage forwards that run on plain tensors, and with {why} "
                 "every stage runs on global tensors; valid: tp=1 and zero=0, and dp=1 unless the recipe's "
                 "rows weigh equally (then data-parallel stages run plain after their first micro-batch)")
    if tr.compile and par.cp > 1:
        p.append(f"trainer.compile=true: compiles the stage forwards that run on plain tensors, and with cp={par.cp} "
                 "every stage runs on global tensors (its attention gathers keys and values); valid: cp=1")
    if tr.compile and par.pp_schedule in ("zb", "zbv"):
        p.append(f"trainer.compile=true: parallel.pp_schedule={par.pp_schedule} splits every backward into input and "
                 "weight gradients, and a compiled stage's backward is one node that gives both at once; valid: "
                 "trainer.compile=false, or pp_schedule 1f1b, gpipe or looped_bfs")


def validate(cfg: Any, recipe, world_size: Optional[int] = None) -> JobLayout:
    """Check ``cfg`` (DictConfig or dict of the :class:`~toolkit.config.schema.TrainConfig` shape) for ``recipe``.

    ``recipe``: the ``toolkit.recipe.Recipe`` named by ``cfg.recipe.name``
    (``recipes.registry.get``). ``world_size``: the processes the job has;
    ``None`` reads torchrun's or Slurm's environment, else assumes
    ``dp * cp * tp * pp`` will be spawned. Returns the :class:`JobLayout`; raises
    :class:`ConfigError` listing every problem; warns :class:`ConfigWarning`
    for ignored settings. Does not modify ``cfg``; reads ``run_dir`` (Hydra's
    output dir) only with ``trainer.resume=auto``.
    """
    cfg = _typed(cfg, recipe)
    p: list[str] = []
    par, tr, log = cfg.parallel, cfg.trainer, cfg.logger
    # A recipe of one's own is named by its import path (module:attribute, recipes.registry).
    if cfg.recipe.name != recipe.name and ":" not in str(cfg.recipe.name):
        p.append(f"recipe.name={cfg.recipe.name!r}: does not name the recipe validated against, {recipe.name!r}")
    _choice(p, "device", cfg.device, S.DEVICES)
    env = cluster_env()
    degrees_ok, zero, world, world_size, layout_name, stage_layers = _check_parallel(p, cfg, recipe, world_size, env)
    device = _check_device(p, cfg, env, world)
    from toolkit.recipe import data_shard

    shards = data_shard(recipe.data_sbp, (par.dp, par.tp), (0, 0))[1] if degrees_ok else 1
    accumulation = _check_batch(p, tr, par, shards, layout_name, degrees_ok)
    if degrees_ok and par.cp > 1 and tr.micro_batch_size > 1:
        warnings.warn(f"parallel.cp={par.cp} with trainer.micro_batch_size={tr.micro_batch_size}: torch's linear "
                      "layers fold a [batch, sequence, features] input's batch and sequence into one dim, where a "
                      "sequence split of several samples cannot stay, so activations are exchanged to a batch split "
                      "around them (exact, the same memory per rank, but all-to-alls that data parallelism over the "
                      "same ranks does without); context parallelism keeps the sequence split with "
                      "micro_batch_size=1", ConfigWarning, stacklevel=2)
    _check_trainer(p, tr, par, recipe, zero)
    _choice(p, "logger.backend", log.backend, S.LOGGER_BACKENDS)
    if log.mode is not None:
        _choice(p, "logger.mode", log.mode, S.WANDB_MODES)

    mb, gb = tr.micro_batch_size, tr.global_batch_size
    layout = JobLayout(name=layout_name, world_size=world, dp=par.dp, tp=par.tp, pp=par.pp, zero=zero,
                       pp_virtual=par.pp_virtual, cp=par.cp, stage_layers=stage_layers, micro_batch_size=mb,
                       global_batch_size=gb, accumulation=accumulation, data_shards=shards, items_per_step=0,
                       device=device, launched=env.kind if env is not None else None)
    weights = recipe.weights_path(str(tr.init_from)) if tr.init_from else None
    if tr.init_from and weights is None:
        p.append(f"trainer.init_from={tr.init_from!r}: no such file or directory"
                 + ("" if os.path.isabs(os.path.expanduser(str(tr.init_from)))  # a hub name has one "/"
                    else f" (nor a name recipe {recipe.name} resolves)")
                 + "; valid: a checkpoint directory (<run>/checkpoints/step_<N>) or what the recipe's docs list")
    elif weights is not None:
        p.extend(_init_from_problems(str(tr.init_from), weights, cfg, recipe))
    from toolkit.run_state import resume_facts

    try:
        resume_facts(recipe, cfg)  # saved with every checkpoint: JSON data
    except TypeError as err:
        p.append(str(err))
    else:
        if tr.resume == "auto":
            p.extend(_resume_problems(cfg, recipe))
    if degrees_ok:
        try:
            p.extend(recipe.check(cfg, layout))
        except OmegaConfBaseException as err:
            p.append(f"{getattr(err, 'full_key', None) or 'config'}: {str(err).splitlines()[0]}")
    if p:
        raise ConfigError(p)
    return replace(layout, items_per_step=gb * recipe.items_per_sample(cfg))
