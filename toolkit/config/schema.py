"""Structured (typed) schema of a training job's configuration.

One dataclass per Hydra config group plus the root :class:`TrainConfig`.
:func:`register_schema` stores the root under the name ``sbp_schema`` in
Hydra's ``ConfigStore``; ``configs/config.yaml`` lists ``sbp_schema`` first in
its defaults, so every group YAML and every command-line override is merged
*into these types*: an unknown key (``trainer.lrr=1``) or a wrong type
(``trainer.lr=fast``) fails at composition, before anything starts. The
``model`` and ``data`` groups belong to the recipe (language, vision and
recommendation models share nothing there): their dataclasses are the
recipe's ``model_schema``/``data_schema``, applied by :func:`typed` with the
recipe, which :func:`toolkit.config.validate.validate` does before anything
starts. Value ranges and cross-field rules (degrees vs. world size, batch
arithmetic, ...) are checked there too.

Choices that are strings (``trainer.precision``, ``trainer.optimizer``, ...)
are kept as ``str`` so the trainer compares plain strings; ``validate``
checks them against the tuples below.

``run_dir`` is Hydra's output directory. :func:`typed` rebuilds a typed
config from a plain container (what crosses process boundaries).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from omegaconf import MISSING, DictConfig, OmegaConf

from runtime.pipeline.schedule import SCHEDULES

DEVICES = ("auto", "cpu", "cuda")
PP_SCHEDULES = SCHEDULES  # the runtime's (runtime.pipeline.schedule)
PRECISIONS = ("fp32", "bf16", "fp16")
RESUME_MODES = ("none", "auto")
OPTIMIZERS = ("adamw", "sgd")
LOGGER_BACKENDS = ("wandb", "none")
WANDB_MODES = ("online", "offline", "disabled")


@dataclass
class RecipeConfig:
    """Which recipe (model family, data and parallel plan) the job runs: a name ``recipes.registry`` knows."""

    name: str = "gpt2"


@dataclass
class SearchConfig:
    """``parallel=auto``'s search (``toolkit.search``): a cluster file, and Metropolis-Hastings' knobs.

    ``cluster``: a preset name in ``configs/cluster`` or a YAML path;
    ``devices``: devices to use (``None``: the launcher's world size, else
    the cluster's); ``budget``: proposals; ``beta``: acceptance sharpness
    (relative cost); ``cache_dir``: where found plans are kept, keyed by
    model, data, batch and cluster.
    """

    cluster: str = "this_machine"
    devices: Optional[int] = None
    budget: int = 150
    beta: float = 20.0
    seed: int = 0
    cache_dir: str = "${oc.env:SBP_CACHE_DIR,'~/.cache/sbp-recipes'}/plans"


@dataclass
class ParallelConfig:
    """Degrees and knobs of the parallel layout; ``world = dp * cp * tp * pp`` processes.

    - ``cp``: context parallelism, the sequence split over ``cp`` ranks of
      each stage's mesh, ``(dp, cp, tp)`` (a recipe with a sequence:
      ``Recipe.context_dim``). Parameters are whole on the cp axis and their
      gradients summed over it, as over dp; activations are split on the
      sequence, and attention gathers what each query block needs (keys and
      values, or another split the op rules find cheaper).

    - ``zero``: ZeRO stage 0..3 over the dp axis (ignored, with a warning, when dp == 1).
    - ``pp_schedule``: ``1f1b`` (interleaved 1F1B when ``pp_virtual > 1``),
      ``gpipe`` or ``looped_bfs`` (the same rule: every micro-batch's
      forwards before the backwards, shallower stages first), ``zb`` (ZB-H1:
      backward split into input and weight gradients, weight passes filling
      the bubbles; interleaved zero bubble when ``pp_virtual > 1``) or ``zbv`` (ZB-V: two stages per rank in a V, needs
      ``pp_virtual=2``); each follows from placements, quotas and
      priorities (``runtime.pipeline.schedule``). ``pp_virtual``: model
      chunks (stages) per pipeline rank, placed round robin (Megatron's
      virtual stages), 1 = no interleaving.
    - ``stage_layers``: transformer blocks per pipeline stage (``pp * pp_virtual``
      entries summing to ``model.n_layer``); ``None`` = uniform split.
    - ``sequence_parallel``: the recipe's sequence-parallel variant of its
      plan, where it has one (``Recipe.sequence_parallel``; GPT-2: activations
      split along the sequence over tp outside the tensor-parallel matmuls,
      Megatron's sequence parallelism).
    - ``plan``: per-op layouts, ``{parameter pattern: tp-axis SBP}`` (``B``,
      ``S(<dim>)``) put before the recipe's plan (first match wins; the dp
      axis stays ``B``), e.g. ``{"*.mlp.c_fc.weight": "B"}`` runs that matmul
      replicated; ``parallel=auto`` writes it.
    - ``bucket_mb``: gradient MiB per collective that starts during backward
      (data-parallel all-reduce, ZeRO 1-2 reduce-scatter); DDP's
      ``bucket_cap_mb`` and its default, 25. The first bucket holds at most
      1 MiB of it so communication starts early.
    - ``auto``: search the layout (``toolkit.search``, ``search.*``)
      before training, or reuse the cached result for this model and cluster.

    The number of micro-batches is not a knob: it is the gradient accumulation
    ``global_batch_size / (micro_batch_size * dp)``.
    """

    dp: int = 1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    zero: int = 0
    pp_schedule: str = "1f1b"
    pp_virtual: int = 1
    stage_layers: Optional[List[int]] = None
    sequence_parallel: bool = False
    plan: Dict[str, str] = field(default_factory=dict)
    bucket_mb: float = 25.0
    auto: bool = False
    search: SearchConfig = field(default_factory=SearchConfig)


@dataclass
class TrainerConfig:
    """Optimisation, evaluation, checkpointing and precision of the training loop.

    Batch sizes are in samples (sequences, images, rows). ``optimizer``:
    ``adamw`` (``betas``, ``eps``) or ``sgd`` (``momentum``), unless the
    recipe builds its own. ``grad_clip`` 0 disables clipping;
    ``eval_every`` / ``save_every`` 0 disable periodic evaluation / saving.
    ``peak_tflops`` is one device's peak for MFU (``None`` = the device's
    dense peak for the precision, :func:`toolkit.peak.device_peak`).
    ``precision``: ``fp32``, ``bf16`` (autocast) or ``fp16`` (autocast with
    dynamic loss scaling, ``sbp_core.LossScaler``). ``compile``:
    ``torch.compile`` each stage's forward where it runs on plain tensors
    (``toolkit.trainer.compiled_forward``). ``resume: auto`` continues
    from the newest checkpoint in the run directory if any. ``init_from``:
    ``None`` (random init), a checkpoint path, or what the recipe's
    ``init_weights`` reads (GPT-2: a Hugging Face GPT-2 directory, or a
    published GPT-2's name in the local hub cache); ``Recipe.weights_path``
    resolves it, and a value it cannot resolve is refused before any process starts.
    ``lr``, ``min_lr`` and ``warmup_steps`` have no default here: the
    recipe's trainer group (``configs/trainer/<name>.yaml``) sets them.
    """

    max_steps: int = 200
    seed: int = 1234
    optimizer: str = "adamw"
    momentum: float = 0.9
    micro_batch_size: int = 4
    global_batch_size: int = 32
    # The learning rate and its schedule are the recipe's (its trainer group), not the toolkit's: no default.
    lr: float = MISSING
    min_lr: float = MISSING
    warmup_steps: int = MISSING
    weight_decay: float = 0.1
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    grad_clip: float = 1.0
    eval_every: int = 50
    eval_steps: int = 10
    log_every: int = 10
    precision: str = "fp32"
    activation_checkpointing: bool = False
    compile: bool = False
    peak_tflops: Optional[float] = None
    resume: str = "none"
    save_every: int = 0
    keep_last: int = 2
    init_from: Optional[str] = None


@dataclass
class LoggerConfig:
    """Metrics mirror: ``wandb`` or ``none``; ``metrics.jsonl`` is written either way.

    ``name`` is the W&B run name (``None`` = ``<model.name>_<parallel name>``);
    ``mode`` ``None`` = ``online`` when ``WANDB_API_KEY`` is set, else ``offline``.
    """

    backend: str = "wandb"
    project: str = "sbp-recipes"
    name: Optional[str] = None
    entity: Optional[str] = None
    mode: Optional[str] = None
    tags: List[str] = field(default_factory=list)


@dataclass
class TrainConfig:
    """The root: one field per config group plus the run directory and device kind.

    ``model`` and ``data`` belong to the recipe: :func:`typed` with the
    recipe merges them into its ``model_schema``/``data_schema``.

    ``device``: ``auto`` (CUDA when there are enough visible devices for the
    local ranks, else CPU), ``cpu`` or ``cuda``.
    """

    recipe: RecipeConfig = field(default_factory=RecipeConfig)
    model: Any = field(default_factory=dict)  # typed by the recipe's model_schema (see typed)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: Any = field(default_factory=dict)  # typed by the recipe's data_schema
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    run_dir: str = "runs/default"
    device: str = "auto"


SCHEMA_NAME = "sbp_schema"


def register_schema() -> None:
    """Store :class:`TrainConfig` as ``sbp_schema`` in Hydra's ConfigStore (idempotent)."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name=SCHEMA_NAME, node=TrainConfig)


def typed(cfg: Any, recipe: Any = None) -> DictConfig:
    """A typed :class:`TrainConfig` DictConfig from a DictConfig or plain dict.

    ``recipe`` (a ``toolkit.recipe.Recipe``): ``model`` and ``data`` are
    typed by its ``model_schema`` and ``data_schema`` too; without it they
    stay plain nodes. Raises ``omegaconf`` validation errors (wrapped by
    callers) for unknown keys and wrong types; missing keys take the schema
    defaults. A DictConfig is merged as a plain container (interpolations
    kept, not resolved): merging typed nodes into typed nodes would let keys
    added with Hydra's ``+key=value`` through.
    """
    if OmegaConf.is_config(cfg):
        cfg = OmegaConf.to_container(cfg, resolve=False)
    base = OmegaConf.structured(TrainConfig)
    if recipe is not None:
        base = OmegaConf.merge(base, {"model": OmegaConf.structured(recipe.model_schema),
                                      "data": OmegaConf.structured(recipe.data_schema)})
    return OmegaConf.merge(base, cfg)
