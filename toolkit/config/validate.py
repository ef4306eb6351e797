"""Checks a composed config before anything starts, and derives the job's layout.

:func:`validate` merges the config into the typed schema (unknown keys,
wrong types), then checks every value range and cross-field rule, collecting
*all* problems into one :class:`ConfigError`:

- ``dp * tp * pp`` equals the processes available: torchrun's / Slurm's world
  size when launched (see :mod:`toolkit.config.environment`), else what will
  be spawned; with ``device=cuda`` (or ``auto`` on a CUDA machine) the ranks
  on a node must not outnumber its visible devices.
- ``model.n_head`` and ``model.vocab_size`` divide by ``tp``; ``model.n_layer``
  divides by ``pp * pp_virtual``, or ``stage_layers`` has ``pp * pp_virtual``
  positive entries summing to ``n_layer``.
- ``global_batch_size`` divides by ``micro_batch_size * dp``; the quotient is
  the gradient accumulation, which must be at least ``pp`` when ``pp > 1``
  (fewer micro-batches than stages leaves stages idle for the whole step).
- ``zero`` in 0..3; ``zero > 0`` with ``dp == 1`` warns (:class:`ConfigWarning`)
  and the layout's effective ``zero`` is 0.
- ``data.seq_len <= model.n_positions``; ``data.vocab_size <= model.vocab_size``.
- Every choice-valued string is one of its choices (schema tuples).

The result, :class:`JobLayout`, carries the derived numbers the trainer
needs (accumulation, per-stage layer counts, effective ZeRO stage, device).
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from toolkit.config import schema as S
from toolkit.config.environment import cluster_env, cuda_device_count, resolve_device
from toolkit.config.errors import ConfigError, ConfigWarning
from toolkit.config.parallel_name import ZERO_STAGES, parallel_name

#: Dimensions of the published GPT-2 checkpoints (for ``trainer.init_from``).
HF_GPT2_DIMS = {
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768, n_positions=1024),
    "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024, n_positions=1024),
    "gpt2-large": dict(n_layer=36, n_head=20, n_embd=1280, n_positions=1024),
    "gpt2-xl": dict(n_layer=48, n_head=25, n_embd=1600, n_positions=1024),
}


@dataclass(frozen=True)
class JobLayout:
    """What a valid config means for the job (all derived, nothing to look up again).

    ``rank = pp_i * dp * tp + dp_i * tp + tp_i`` (DESIGN.md). ``zero`` is the
    effective stage (0 when ``dp == 1``). ``stage_layers[s]`` is the number
    of transformer blocks of pipeline chunk ``s`` (``pp * pp_virtual``
    chunks; chunk ``s`` runs on stage ``s % pp``). ``accumulation`` is the
    number of micro-batches per optimizer step on each dp replica.
    """

    name: str
    world_size: int
    dp: int
    tp: int
    pp: int
    zero: int
    pp_virtual: int
    stage_layers: tuple
    micro_batch_size: int
    global_batch_size: int
    accumulation: int
    seq_len: int
    tokens_per_step: int
    device: str  # "cpu" or "cuda"
    launched: Optional[str]  # "torchrun", "slurm" or None (train.py spawns the ranks)


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


def _typed(cfg: Any) -> DictConfig:
    try:
        return S.typed(cfg)
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None) or "config"
        raise ConfigError(f"{key}: {str(err).splitlines()[0]}; valid: the fields and types of "
                          "toolkit/config/schema.py") from None


def _get(problems: list, node: DictConfig, key: str, field: str):
    """A value, or ``None`` with a problem recorded when it is missing or does not resolve."""
    if OmegaConf.is_missing(node, key):
        problems.append(f"{field}=???: a value is required")
        return None
    try:
        return node[key]
    except OmegaConfBaseException as err:
        problems.append(f"{field}: {str(err).splitlines()[0]}")
        return None


def _check_stages(problems: list, par, n_layer: int) -> tuple:
    chunks = par.pp * par.pp_virtual
    if par.stage_layers is None:
        if n_layer % chunks:
            problems.append(f"model.n_layer={n_layer}: does not divide into parallel.pp*pp_virtual="
                            f"{chunks} equal stages; valid: pp*pp_virtual among "
                            f"{[d for d in range(1, n_layer + 1) if n_layer % d == 0]}, or set "
                            f"parallel.stage_layers to {chunks} positive counts summing to {n_layer}")
            return ()
        return (n_layer // chunks,) * chunks
    layers = tuple(int(x) for x in par.stage_layers)
    if len(layers) != chunks or any(x < 1 for x in layers) or sum(layers) != n_layer:
        problems.append(f"parallel.stage_layers={list(layers)}: needs {chunks} (pp*pp_virtual) "
                        f"entries, each >= 1, summing to model.n_layer={n_layer}")
        return ()
    return layers


def validate(cfg: Any, world_size: Optional[int] = None) -> JobLayout:
    """Check ``cfg`` (DictConfig or dict of the :class:`~toolkit.config.schema.TrainConfig` shape).

    ``world_size``: the processes the job has; ``None`` reads torchrun's or
    Slurm's environment, else assumes ``dp * tp * pp`` will be spawned.
    Returns the :class:`JobLayout`; raises :class:`ConfigError` listing every
    problem; warns :class:`ConfigWarning` for ignored settings. Does not
    modify ``cfg`` and does not resolve ``run_dir`` (Hydra's output dir).
    """
    cfg = _typed(cfg)
    p: list[str] = []
    m, par, data, tr, log = cfg.model, cfg.parallel, cfg.data, cfg.trainer, cfg.logger

    _choice(p, "recipe.name", cfg.recipe.name, S.RECIPES)
    _choice(p, "device", cfg.device, S.DEVICES)

    # model
    for key in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head"):
        _at_least(p, f"model.{key}", m[key], 1)
    if m.n_head >= 1 and m.n_embd % m.n_head:
        p.append(f"model.n_embd={m.n_embd}: must divide by model.n_head={m.n_head} (head dim)")
    if not 0.0 <= m.dropout < 1.0:
        p.append(f"model.dropout={m.dropout}: must be in [0, 1)")

    # parallel degrees
    degrees_ok = all([_at_least(p, f"parallel.{k}", par[k], 1) for k in ("dp", "tp", "pp", "pp_virtual")])
    _choice(p, "parallel.zero", par.zero, ZERO_STAGES)
    _choice(p, "parallel.pp_schedule", par.pp_schedule, S.PP_SCHEDULES)
    zero = par.zero if par.zero in ZERO_STAGES else 0
    if zero and par.dp == 1:
        warnings.warn(f"parallel.zero={zero} with parallel.dp=1 shards nothing; running with zero=0",
                      ConfigWarning, stacklevel=2)
        zero = 0
    stage_layers: tuple = ()
    world = par.dp * par.tp * par.pp if degrees_ok else 0
    layout_name = parallel_name(par.dp, par.tp, par.pp, par.zero) if degrees_ok else "?"
    env = cluster_env()
    launched = env.kind if env is not None else None
    if degrees_ok:
        if par.pp_virtual != 1:
            p.append(f"parallel.pp_virtual={par.pp_virtual}: interleaved (virtual) stages are not supported "
                     "by the pipeline executor; valid: 1")
        if m.n_head % par.tp:
            p.append(f"model.n_head={m.n_head}: must divide by parallel.tp={par.tp} (whole heads per "
                     f"rank); valid tp: {[d for d in range(1, m.n_head + 1) if m.n_head % d == 0]}")
        if m.vocab_size % par.tp:
            padded = math.ceil(m.vocab_size / (128 * par.tp)) * 128 * par.tp
            p.append(f"model.vocab_size={m.vocab_size}: must divide by parallel.tp={par.tp} (vocab-"
                     f"parallel embedding and loss); valid: pad it, e.g. model.vocab_size={padded}")
        stage_layers = _check_stages(p, par, m.n_layer) if m.n_layer >= 1 else ()
        if world_size is None:
            world_size = env.world_size if env is not None else world
        if world != world_size:
            source = {"torchrun": f"torchrun's WORLD_SIZE is {world_size}",
                      "slurm": f"Slurm's SLURM_STEP_NUM_TASKS is {world_size}"}.get(
                launched, f"{world_size} are available")
            p.append(f"parallel={layout_name}: dp*tp*pp = {par.dp}*{par.tp}*{par.pp} = {world} processes, "
                     f"but {source}; valid: a layout with {world_size} processes "
                     f"(e.g. {', '.join(layouts_for(world_size))}) or launch {world}")
    elif world_size is None:
        world_size = env.world_size if env is not None else 0
    if par.sequence_parallel and par.tp > 1 and data.seq_len % par.tp:
        p.append(f"data.seq_len={data.seq_len}: sequence_parallel splits it over parallel.tp={par.tp}; "
                 "valid: a multiple of tp, or parallel.sequence_parallel=false")

    # device
    device = "cpu"
    if cfg.device in S.DEVICES and world:
        local = (env.local_world_size or world) if env is not None else world
        try:
            device = resolve_device(cfg.device, local)
        except ConfigError as err:
            p.extend(err.problems)
        if cfg.device == "auto" and device == "cpu" and 0 < (count := cuda_device_count()) < local:
            warnings.warn(f"device=auto: {count} CUDA devices for {local} local ranks; running on CPU "
                          "(gloo)", ConfigWarning, stacklevel=2)

    # batch arithmetic
    accumulation = 0
    mb, gb = tr.micro_batch_size, tr.global_batch_size
    sizes_ok = [_at_least(p, "trainer.micro_batch_size", mb, 1),
                _at_least(p, "trainer.global_batch_size", gb, 1)]
    if all(sizes_ok) and degrees_ok:
        if gb % (mb * par.dp):
            per = mb * par.dp
            p.append(f"trainer.global_batch_size={gb}: must divide by trainer.micro_batch_size*parallel.dp"
                     f" = {mb}*{par.dp} = {per}; valid: a multiple of {per}, e.g. "
                     f"{max(per, gb // per * per)} or {(gb // per + 1) * per}")
        else:
            accumulation = gb // (mb * par.dp)
            if par.pp > 1 and accumulation < par.pp:
                p.append(f"trainer.global_batch_size={gb}: gives {accumulation} micro-batches per step "
                         f"(global/(micro*dp) = {gb}/({mb}*{par.dp})), fewer than parallel.pp={par.pp} "
                         f"stages; valid: global_batch_size >= {mb * par.dp * par.pp} (a multiple of "
                         f"{mb * par.dp}) or a smaller micro_batch_size")

    # data
    _choice(p, "data.source", data.source, S.DATA_SOURCES)
    if data.source == "text":
        if OmegaConf.is_missing(data, "path") or data.path is None:
            p.append("data.path=None: data.source=text needs a path; valid: a .txt/.jsonl/.parquet file "
                     "or a directory of them")
    seq_len = _get(p, data, "seq_len", "data.seq_len")
    if seq_len is not None and _at_least(p, "data.seq_len", seq_len, 2, " (next-token targets)") \
            and seq_len > m.n_positions:
        p.append(f"data.seq_len={seq_len}: exceeds model.n_positions={m.n_positions}; "
                 f"valid: 2..{m.n_positions}")
    vocab = _get(p, data, "vocab_size", "data.vocab_size")
    if vocab is not None and not 2 <= vocab <= m.vocab_size:
        p.append(f"data.vocab_size={vocab}: token ids must index the embedding; "
                 f"valid: 2..model.vocab_size={m.vocab_size}")
    if not 0.0 <= data.val_fraction < 1.0:
        p.append(f"data.val_fraction={data.val_fraction}: must be in [0, 1)")
    elif data.val_fraction == 0 and tr.eval_every > 0:
        p.append(f"data.val_fraction=0.0: holds out nothing, but trainer.eval_every={tr.eval_every} "
                 "evaluates; valid: data.val_fraction > 0, or trainer.eval_every=0")
    if data.max_bytes is not None:
        _at_least(p, "data.max_bytes", data.max_bytes, 1, " (or null for the whole corpus)")

    # trainer
    _at_least(p, "trainer.max_steps", tr.max_steps, 1)
    if not tr.lr > 0:
        p.append(f"trainer.lr={tr.lr}: must be > 0")
    if not 0 <= tr.min_lr <= tr.lr:
        p.append(f"trainer.min_lr={tr.min_lr}: must be in [0, trainer.lr={tr.lr}]")
    if tr.warmup_steps < 0:
        p.append(f"trainer.warmup_steps={tr.warmup_steps}: must be >= 0")
    _at_least(p, "trainer.weight_decay", tr.weight_decay, 0.0)
    if len(tr.betas) != 2 or not all(0.0 <= b < 1.0 for b in tr.betas):
        p.append(f"trainer.betas={list(tr.betas)}: must be two numbers in [0, 1), e.g. [0.9, 0.95]")
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
    if tr.init_from in HF_GPT2_DIMS:
        wrong = {k: m[k] for k, v in HF_GPT2_DIMS[tr.init_from].items() if m[k] != v}
        if wrong:
            want = HF_GPT2_DIMS[tr.init_from]
            p.append(f"trainer.init_from={tr.init_from!r}: the checkpoint has "
                     f"{ {k: want[k] for k in wrong} } but the model has {wrong}; valid: "
                     f"model={tr.init_from}")
        if m.vocab_size < 50257:
            p.append(f"trainer.init_from={tr.init_from!r}: the checkpoint has 50257 tokens, "
                     f"model.vocab_size={m.vocab_size} is smaller; valid: >= 50257")

    # logger
    _choice(p, "logger.backend", log.backend, S.LOGGER_BACKENDS)
    if log.mode is not None:
        _choice(p, "logger.mode", log.mode, S.WANDB_MODES)

    if p:
        raise ConfigError(p)
    tokens = gb * seq_len
    return JobLayout(name=layout_name, world_size=world, dp=par.dp, tp=par.tp, pp=par.pp, zero=zero,
                     pp_virtual=par.pp_virtual, stage_layers=stage_layers, micro_batch_size=mb,
                     global_batch_size=gb, accumulation=accumulation, seq_len=seq_len,
                     tokens_per_step=tokens, device=device, launched=launched)
