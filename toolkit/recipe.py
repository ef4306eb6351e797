"""What a recipe hands the trainer: a plain torch model, its data and its parallel plan, as data.

One contract for language, vision and recommendation models: the trainer
(``toolkit.trainer``) calls these hooks and nothing recipe-specific. A
recipe package ``recipes/<name>/recipe.py`` defines ``RECIPE = <a subclass
instance>``; ``recipes.registry.get(name)`` finds it.

Configuration. ``cfg.model`` and ``cfg.data`` are typed by the recipe's
``model_schema`` / ``data_schema`` dataclasses (unknown keys and wrong types
are a ``ConfigError`` before any process starts, see
``toolkit.config.validate``); ``check`` adds the recipe's own cross-field
rules. ``configs/recipe/<name>.yaml`` picks the recipe's default model, data
and trainer groups.

Data. Every micro-batch is a dict of fields (``batch_fields``: per-sample
shape and dtype), all laid out ``data_sbp`` on a stage's ``(dp, tp)`` mesh.
Its ``S(0)`` mesh axes cut the batch into shards (GPT-2's ``(S(0), B)``: one
shard per dp index, read by every tp rank; ``(S(0), S(0))``: one shard per
rank). ``data`` returns a rank's shard of every micro-batch as runtime
data-pipeline actors (``toolkit.data.MicroBatches`` over any indexable
source does the sampling and sharding). The first stage reads the
``inputs`` fields, the last stage the ``labels`` fields.

Computation. ``stage_forward(module, x, labels)``: ``x`` is the dict of input
fields (global tensors) on the first stage, else what the stage before
returned (one tensor, or a tuple of them; laid out ``act_sbp``); ``labels``
the dict of label fields on the last stage, else ``None``. It returns the
stage's output (a tensor or a tuple of tensors, of any shapes and dtypes:
``toolkit.stages.boundary_specs`` finds them by running the stages on meta
tensors), or the scalar loss on the last stage. ``pipeline`` names the
repeated layers and the modules before and after them
(``toolkit.stages``); the model's ``forward`` skips the modules a stage
does not hold (set to ``None``). ``None`` means the model is not split into
stages (``check`` refuses ``pp > 1``).
"""
from __future__ import annotations

import contextlib
import os
from abc import ABC, abstractmethod
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from sbp_core.sbp import Broadcast, Split
from toolkit.checkpoint import manifest
from toolkit.checkpoint.directory import latest
from toolkit.run_state import checkpoint_root
from toolkit.stages import layer_paths, layers_of


def sbp_text(sbp: tuple) -> str:
    return "(" + ", ".join(map(str, sbp)) + ")"


class Recipe(ABC):
    """Base class of every recipe; subclasses set the attributes and override what differs.

    Attributes: ``name``; ``model_schema``/``data_schema`` (dataclasses);
    ``data_sbp`` (the batch on the ``(dp, tp)`` mesh); ``inputs``/``labels``
    (field names); ``pipeline`` (dict or ``None``); ``act_sbp`` (stage
    boundary activations); ``tied`` (parameter-name pairs of one parameter,
    which a pipeline may hold on its first and last stage; ``tied_pairs``
    when the model config decides); ``throughput_unit`` ("tokens", "images", "samples": the
    metrics key is ``<unit>_per_s``); ``rows_weigh_equally``: the loss is a
    mean over the batch's rows (samples, or tokens of equal count per row)
    in which every row weighs the same, whatever the data — no ignored
    targets that vary by row, no per-sample weights — so a pure data-parallel stage may run on
    plain tensors, each replica's loss scaled by 1/replicas
    (``runtime.pipeline.plain_stage``; an audit of the first micro-batch
    still checks the forward for anything else coupling rows);
    ``sequence_parallel``: ``mesh_plan`` has a sequence-parallel variant,
    chosen by ``parallel.sequence_parallel`` (refused for other recipes
    before spawn, and never proposed by the search); ``context_dim``: the
    sequence dim of the batch fields, of the plan's activation pins and of
    the stage boundaries, which ``parallel.cp`` splits (``toolkit.mesh.with_context``;
    ``None``: no sequence, ``cp > 1`` is refused).
    """

    name: str = ""
    model_schema: type = None
    data_schema: type = None
    data_sbp: tuple = (Split(0), Broadcast())
    inputs: tuple = ()
    labels: tuple = ()
    pipeline: dict | None = None
    act_sbp: tuple = (Split(0), Broadcast())
    tied: tuple = ()
    throughput_unit: str = "samples"
    rows_weigh_equally: bool = False
    sequence_parallel: bool = False
    context_dim: int | None = None

    # -- configuration -------------------------------------------------------------------------

    def check(self, cfg, layout) -> list:
        """Problems with ``cfg`` this recipe knows of (``layout``: the generic ``JobLayout``), as strings.

        Called by ``toolkit.config.validate`` after the generic checks passed,
        before any process starts. The base refuses ``pp > 1`` without a
        ``pipeline``.
        """
        if layout.pp > 1 and self.pipeline_plan(cfg.model) is None:
            return [f"parallel.pp={layout.pp}: recipe {self.name} is not split into pipeline stages; valid: pp=1 "
                    f"(use dp and tp)"]
        return []

    def pipeline_plan(self, model_cfg) -> dict | None:
        """The pipeline split of the model ``model_cfg`` builds (``toolkit.stages``), or ``None``: ``pipeline``."""
        return self.pipeline

    def tied_pairs(self, model_cfg) -> tuple:
        """The ``(name, name)`` pairs of one parameter in the model ``model_cfg`` builds: ``tied``."""
        return tuple(self.tied)

    def n_layers(self, model_cfg) -> int:
        """How many repeated layers (``pipeline_plan``'s ``layers``, the unit of the stage split), counted on a meta model."""
        plan = self.pipeline_plan(model_cfg)
        if plan is None:
            raise NotImplementedError(f"recipe {self.name} has no pipeline split")
        with torch.random.fork_rng(devices=[]), torch.device("meta"):
            model = self.build_model(model_cfg)
        return len(layer_paths(model, plan))

    # -- model and plan ------------------------------------------------------------------------

    @abstractmethod
    def build_model(self, model_cfg) -> nn.Module:
        """The plain torch model for ``cfg.model`` (no distributed code; the trainer distributes it)."""

    def build_stage(self, model_cfg, cut) -> nn.Module:
        """This rank's module: ``cut`` (which keeps this rank's pipeline stages of a model, in place, and
        returns it; the identity without a pipeline) applied to the model, initialised as the whole model is
        from the global seed.

        This builds the whole model first. A recipe whose model can give any
        box of any parameter the whole model's values overrides it to allocate
        only the rank's shards (GPT-2: built on the meta device and cut, its
        parameters left there for ``distribute_module`` to build with the
        model's ``init_shard``).
        """
        return cut(self.build_model(model_cfg))

    def mesh_plan(self, cfg) -> dict:
        """Parameter patterns and ``<module>:input/output`` pins to an SBP on a stage's ``(dp, tp)`` mesh."""
        return {}

    @abstractmethod
    def stage_forward(self, module, x, labels=None):
        """One stage's forward on a micro-batch, as the module docstring's "Computation" states."""

    def checkpoint_layers(self, module, model_cfg) -> None:
        """Wrap each repeated layer (``pipeline_plan``'s ``layers``) this stage holds in activation checkpointing,
        in place: its activations are recomputed in backward instead of kept (``torch.utils.checkpoint``).
        Batch norm's running statistics come out of the recompute as the forward left them
        (``_RunningStatsKept``): updated once."""
        plan = self.pipeline_plan(model_cfg)
        if plan is None:
            raise NotImplementedError(f"recipe {self.name} does not support trainer.activation_checkpointing")
        for layer in layers_of(module, plan):
            if layer is not None:
                inner = layer.forward
                norms = [m for m in layer.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
                # Only where needed: torch.compile traces checkpoint only without a context_fn.
                extra = {"context_fn": partial(_recompute_context, norms)} if norms else {}
                layer.forward = partial(checkpoint, inner, use_reentrant=False, **extra)

    def build_optimizer(self, module, cfg):
        """The optimizer of this rank's stage; ``cfg`` is the job's (typed) config (default:
        ``trainer.optimizer``, AdamW or SGD)."""
        from toolkit.optim import build_optimizer

        return build_optimizer(module, cfg.trainer)

    # -- data ----------------------------------------------------------------------------------

    @abstractmethod
    def batch_fields(self, cfg) -> dict:
        """``{field: (per-sample shape, dtype)}`` of one micro-batch."""

    def prepare(self, cfg):
        """Every rank, before the model: build or find the data (cached; safe under concurrent ranks)."""
        return None

    @abstractmethod
    def data(self, cfg, prepared, split: str, shard: int, n_shards: int, layout):
        """Shard ``shard`` of ``n_shards`` of ``split`` ("train" or "val")'s micro-batches, or ``None`` (no such split).

        ``prepared``: what ``prepare`` returned; ``layout``: the ``JobLayout``
        (``global_batch_size``, ``accumulation``).
        The result has ``stages(device, quota, prefix)`` (runtime data-pipeline
        actors), a settable ``step``, and yields ``{field: local tensor}`` per
        piece (see ``toolkit.data.MicroBatches``).
        """

    # -- evaluation and accounting -------------------------------------------------------------

    def evaluate(self, job) -> dict | None:
        """Evaluation metrics for the eval row (known on rank 0; other ranks may return ``None``).

        Called on every rank every ``trainer.eval_every`` steps. Default: the
        mean loss of ``trainer.eval_steps`` validation batches through the
        pipeline, as ``val_loss``.
        """
        if job.val_batches is None:
            return None
        return {"val_loss": job.evaluate_loss()}

    def items_per_sample(self, cfg) -> int:
        """Throughput items in one sample (tokens per sequence for a language model)."""
        return 1

    def flops_per_item(self, cfg, n_params: int) -> float | None:
        """Training FLOPs per throughput item (for TFLOP/s and MFU), or ``None`` if not modelled."""
        return None

    # -- run files -----------------------------------------------------------------------------

    def weights_path(self, init_from: str) -> str | None:
        """The local path ``trainer.init_from`` names (our checkpoint, or a directory ``init_weights`` reads),
        or ``None`` when there is none: the job is refused before any process starts. A run directory
        names its ``checkpoints/``. Only paths here; a recipe may also resolve names (GPT-2: a Hugging Face
        model in the local hub cache)."""
        path = os.path.expanduser(init_from)
        if not os.path.exists(path):
            return None
        run_root = checkpoint_root(path)
        if not os.path.isfile(os.path.join(path, manifest.NAME)) and latest(run_root) is not None:
            return run_root
        return path

    def reads_weights(self, path: str) -> bool:
        """Whether ``init_weights`` reads ``path`` (a foreign format), so that validation does not refuse it
        for not being our checkpoint."""
        return False

    def weights_problems(self, path: str, cfg) -> list:
        """What is wrong with ``path``, a directory ``reads_weights`` accepts, for the model ``cfg.model``
        describes (other dimensions, no weights file), from its metadata alone: checked before any process
        starts, as our checkpoints are. One message per problem, without the ``trainer.init_from`` prefix."""
        return []

    def init_weights(self, model, path: str, cfg) -> bool:
        """Load ``trainer.init_from`` weights of a foreign format into ``model``, this rank's stage of the model
        (``build_stage``: the full model's names; ``path``: what ``weights_path`` resolved), or leave its meta
        parameters to an ``init_shard`` set on the instance that reads them, so that ``distribute_module`` reads
        only this rank's boxes (the trainer deletes that attribute once the parameters are laid out); ``False``
        if not one."""
        return False

    def extra_state(self, cfg) -> dict:
        """JSON-able facts saved with every checkpoint (e.g. what an exporter needs)."""
        return {}

    def resume_facts(self, cfg) -> dict:
        """``{config field: value}`` the saved state means something only under, beyond its tensors' names
        and shapes (checked apart): saved with every checkpoint, and ``trainer.resume=auto`` with other
        values is refused before spawning. E.g. Wide&Deep's hash seed, which decides the table row of each
        id: the same shapes, other meanings."""
        return {}

    def on_start(self, job) -> None:
        """Rank 0, once the job is built: write run artifacts (e.g. the tokenizer)."""


def field_layout(placement, sbp: tuple, rows: int, shape: tuple, dtype: torch.dtype):
    """The ``sbp_core.Layout`` of a data field: ``rows`` samples of ``shape`` on ``placement``."""
    from sbp_core import Layout

    return Layout(placement, tuple(sbp), torch.Size((rows, *shape)), dtype)


def data_shard(sbp: tuple, mesh_shape: tuple, mesh_index: tuple) -> tuple:
    """``(shard, n_shards)`` of the rank at ``mesh_index``: the mesh axes whose SBP splits dim 0 cut the batch.

    Nested in mesh-axis order (the first such axis outermost), as nested
    ``tensor_split`` lays out an N-d ``S(0)``. An axis splitting another dim
    (context parallelism's sequence) reads the same samples on each of its
    ranks; the pipeline keeps each rank's part of them (``PipelineStep``).
    """
    shard, count = 0, 1
    for s, size, i in zip(sbp, mesh_shape, mesh_index):
        if isinstance(s, Split) and s.axis == 0:
            shard, count = shard * size + i, count * size
    return shard, count


def recipe_batch(cfg: Any, recipe: Recipe) -> dict:
    """``{field: (shape, dtype)}`` checked: every input and label field is listed."""
    fields = recipe.batch_fields(cfg)
    missing = [f for f in (*recipe.inputs, *recipe.labels) if f not in fields]
    if missing:
        raise ValueError(f"recipe {recipe.name}: inputs/labels {missing} are not batch fields {sorted(fields)}")
    return fields


def _recompute_context(norms: list):
    """``checkpoint``'s ``context_fn``: nothing around the forward, ``_RunningStatsKept`` around the recompute."""
    return contextlib.nullcontext(), _RunningStatsKept(norms)


class _RunningStatsKept:
    """Around a recompute: batch norms' running statistics (and ``num_batches_tracked``) come out as they
    went in. The recompute updates them again; they are put back after it. (Turning the update off would
    change the op torch records, and with it the tensors the recompute saves, which checkpoint refuses.)
    Re-entrant: a split backward (input gradients, then weights) recomputes a layer twice."""

    def __init__(self, norms: list):
        self.norms, self.kept = norms, []

    @torch.no_grad()
    def __enter__(self):
        self.kept.append([(b, b.clone()) for m in self.norms
                          for b in (m.running_mean, m.running_var, m.num_batches_tracked) if b is not None])

    @torch.no_grad()
    def __exit__(self, *exc):
        for b, value in self.kept.pop():
            b.copy_(value)
