"""Structured (typed) schema of a training job's configuration.

One dataclass per Hydra config group plus the root :class:`TrainConfig`.
:func:`register_schema` stores the root under the name ``sbp_schema`` in
Hydra's ``ConfigStore``; ``configs/config.yaml`` lists ``sbp_schema`` first in
its defaults, so every group YAML and every command-line override is merged
*into these types*: an unknown key (``trainer.lrr=1``) or a wrong type
(``trainer.lr=fast``) fails at composition, before anything starts. Value
ranges and cross-field rules (degrees vs. world size, batch arithmetic, ...)
are checked afterwards by :func:`toolkit.config.validate.validate`.

Choices that are strings (``trainer.precision``, ``data.source``, ...) are
kept as ``str`` so the trainer compares plain strings; ``validate`` checks
them against the tuples below.

Interpolations: ``data.seq_len`` defaults to ``${model.n_positions}`` and
``data.vocab_size`` to ``${model.vocab_size}``; ``run_dir`` is Hydra's output
directory. :func:`typed` rebuilds a typed config from a plain container (what
crosses process boundaries).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional

from omegaconf import II, DictConfig, OmegaConf

RECIPES = ("gpt2",)
DEVICES = ("auto", "cpu", "cuda")
PP_SCHEDULES = ("1f1b", "gpipe")
PRECISIONS = ("fp32", "bf16")
RESUME_MODES = ("none", "auto")
DATA_SOURCES = ("stdlib", "text")
LOGGER_BACKENDS = ("wandb", "none")
WANDB_MODES = ("online", "offline", "disabled")


@dataclass
class RecipeConfig:
    """Which recipe (model family + parallel plan) the job runs."""

    name: str = "gpt2"


@dataclass
class ModelConfig:
    """GPT-2 dimensions; ``dropout`` sets GPT-2's three dropout probabilities at once.

    ``name`` labels the preset (run names, W&B); the dimensions are what count.
    """

    name: str = "gpt2-tiny"
    vocab_size: int = 8192
    n_positions: int = 256
    n_embd: int = 128
    n_layer: int = 4
    n_head: int = 4
    dropout: float = 0.0
    layer_norm_epsilon: float = 1e-5
    initializer_range: float = 0.02


@dataclass
class ParallelConfig:
    """Degrees and knobs of the parallel layout; ``world = dp * tp * pp`` processes.

    - ``zero``: ZeRO stage 0..3 over the dp axis (ignored, with a warning, when dp == 1).
    - ``pp_schedule``: ``1f1b`` or ``gpipe``; ``pp_virtual``: model chunks per
      pipeline rank (1 = no interleaving).
    - ``stage_layers``: transformer blocks per pipeline stage (``pp * pp_virtual``
      entries summing to ``model.n_layer``); ``None`` = uniform split.
    - ``sequence_parallel``: split activations along the sequence axis over tp
      outside the tensor-parallel matmuls (Megatron's sequence parallelism).

    The number of micro-batches is not a knob: it is the gradient accumulation
    ``global_batch_size / (micro_batch_size * dp)``.
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1
    zero: int = 0
    pp_schedule: str = "1f1b"
    pp_virtual: int = 1
    stage_layers: Optional[List[int]] = None
    sequence_parallel: bool = False


@dataclass
class DataConfig:
    """The token stream (mapped onto ``toolkit.data.prepare``).

    - ``source``: ``stdlib`` (this Python's standard-library source, always
      available) or ``text`` (the local ``path``: a file or directory of
      ``.txt``/``.jsonl``/``.parquet``; ``text_field`` names the column of the
      latter two).
    - ``vocab_size``: ids of the BPE tokenizer trained on the corpus (at most
      ``model.vocab_size``, which may be padded above it); ``tokenizer``: a
      ``tokenizer.json`` to use instead of training one.
    - ``seq_len``: tokens per sample (at most ``model.n_positions``).
    - ``val_fraction``: share of documents held out for evaluation (0 only
      with ``trainer.eval_every=0``).
    - ``cache_dir``: where tokenizers and token files are cached.
    - ``max_bytes``: corpus bytes read at most (``None`` = all).
    """

    source: str = "stdlib"
    path: Optional[str] = None
    text_field: str = "text"
    tokenizer: Optional[str] = None
    vocab_size: int = II("model.vocab_size")
    seq_len: int = II("model.n_positions")
    val_fraction: float = 0.05
    cache_dir: str = "${oc.env:SBP_CACHE_DIR,'~/.cache/sbp-recipes'}"
    max_bytes: Optional[int] = 4_000_000


@dataclass
class TrainerConfig:
    """Optimisation, evaluation, checkpointing and precision of the training loop.

    Batch sizes are in samples (sequences). ``grad_clip`` 0 disables clipping;
    ``eval_every`` / ``save_every`` 0 disable periodic evaluation / saving.
    ``peak_tflops`` is one device's peak for MFU (``None`` = measured by
    :func:`toolkit.flops.measured_peak_tflops`). ``resume: auto`` continues
    from the newest checkpoint in the run directory if any. ``init_from``:
    ``None`` (random init), a checkpoint path, or a Hugging Face GPT-2 name.
    """

    max_steps: int = 200
    seed: int = 1234
    micro_batch_size: int = 4
    global_batch_size: int = 32
    lr: float = 6e-4
    min_lr: float = 6e-5
    warmup_steps: int = 20
    weight_decay: float = 0.1
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    grad_clip: float = 1.0
    eval_every: int = 50
    eval_steps: int = 10
    log_every: int = 10
    precision: str = "fp32"
    activation_checkpointing: bool = False
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

    ``device``: ``auto`` (CUDA when there are enough visible devices for the
    local ranks, else CPU), ``cpu`` or ``cuda``.
    """

    recipe: RecipeConfig = field(default_factory=RecipeConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    run_dir: str = "runs/default"
    device: str = "auto"


SCHEMA_NAME = "sbp_schema"


def register_schema() -> None:
    """Store :class:`TrainConfig` as ``sbp_schema`` in Hydra's ConfigStore (idempotent)."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name=SCHEMA_NAME, node=TrainConfig)


def typed(cfg: Any) -> DictConfig:
    """A typed :class:`TrainConfig` DictConfig from a DictConfig or plain dict.

    Raises ``omegaconf`` validation errors (wrapped by callers) for unknown
    keys and wrong types; missing keys take the schema defaults. A DictConfig
    is merged as a plain container (interpolations kept, not resolved):
    merging typed nodes into typed nodes would let keys added with Hydra's
    ``+key=value`` through.
    """
    if OmegaConf.is_config(cfg):
        cfg = OmegaConf.to_container(cfg, resolve=False)
    return OmegaConf.merge(OmegaConf.structured(TrainConfig), cfg)


def gpt2_config_kwargs(model: Any) -> dict:
    """Keyword arguments of ``recipes.gpt2.model.GPT2Config`` for a ``model`` config node.

    ``dropout`` becomes ``embd_pdrop``, ``resid_pdrop`` and ``attn_pdrop``.
    Use: ``GPT2Config(**gpt2_config_kwargs(cfg.model))``.
    """
    return dict(vocab_size=int(model.vocab_size), n_positions=int(model.n_positions),
                n_embd=int(model.n_embd), n_layer=int(model.n_layer), n_head=int(model.n_head),
                embd_pdrop=float(model.dropout), resid_pdrop=float(model.dropout),
                attn_pdrop=float(model.dropout), layer_norm_epsilon=float(model.layer_norm_epsilon),
                initializer_range=float(model.initializer_range))
