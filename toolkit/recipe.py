"""What a recipe hands the trainer: a plain torch model and its parallel plan, as data.

The trainer (``toolkit.trainer``) knows nothing of GPT-2; a recipe package
(``recipes/gpt2``) fills a ``Recipe``:

- ``build_model(model_cfg) -> nn.Module``: the full model on every rank
  (the same seed gives the same values);
- ``mesh_plan(sequence_parallel) -> dict``: parameter patterns and
  ``<module>:input/output`` pins to an SBP on the stage's ``(dp, tp)`` mesh;
- ``pipeline``: ``{"layers", "first", "last"}`` module paths (see
  ``toolkit.stages``), ``tied``: parameter-name pairs shared by the first and
  last stage;
- ``stage_forward(module, x, labels)``: a stage's output, or the loss on the
  last stage;
- ``data_sbp`` / ``act_sbp``: token ids and stage-boundary activations on the
  mesh; ``hidden_size(model_cfg)``: the boundary activation's last dim;
- ``checkpoint_layers(module)``: wrap each repeated layer in activation
  checkpointing (``torch.utils.checkpoint``), in place.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable


@dataclass(frozen=True)
class Recipe:
    name: str
    build_model: Callable
    mesh_plan: Callable
    pipeline: dict
    stage_forward: Callable
    data_sbp: tuple
    act_sbp: tuple
    hidden_size: Callable
    checkpoint_layers: Callable
    tied: list = field(default_factory=list)
